// router_checkpoint.hpp: the MoE router's aux-loss-free expert bias in checkpoints
// (docs/checkpoints.md, "The expert bias"): one tensor per MoE layer, group "router", name
// "layers.L.mlp.router.expert_bias", shape (E), f32. The bias is the same on every rank (its
// update reads the global batch's loads), so it is saved unsplit in each file of the layer's
// stage and loads at any layout, expert-parallel size included; tessera-reshard carries it and
// the Hugging Face conversion maps it to e_score_correction_bias.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "model/gpt.hpp"

namespace tessera {

// This rank's MoE layers' biases (empty without --moe-router-enable-expert-bias).
std::vector<ExtraTensor> router_checkpoint_tensors(const GPTModel& model);

// Restores the biases of this rank's MoE layers from `r`; returns the line to log when the
// checkpoint has none (they start at zero), else "". A checkpoint with some layers' biases but
// not all, or of another expert count, is a ConfigError (damaged).
std::string restore_router_state(const CheckpointReader& r, GPTModel& model);

}  // namespace tessera
