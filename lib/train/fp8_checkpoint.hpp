// fp8_checkpoint.hpp: FP8's delayed-scaling state in checkpoints (docs/checkpoints.md, "FP8"):
// one tensor per transformer layer, group "fp8", name "layers.L.fp8", shape (H + 1, columns): the H
// rows of amax history and the scales of the layer's FP8 tensors (QKV, projection, FC1, FC2, then
// each expert's FC1 and FC2; each input, weight, output gradient: fp8_state_columns). The state
// is the same on every TP, DP, CP and EP rank (its amaxes are reduced over them; every rank keeps
// every expert's), so it is saved unsplit in each file of the layer's stage and loads at any
// layout, expert-parallel size included.
#pragma once

#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "checkpoint/checkpoint.hpp"
#include "model/gpt.hpp"

namespace tessera {

// This rank's layers' state, staged on the host (empty without delayed scaling).
std::vector<ExtraTensor> fp8_checkpoint_tensors(GPTModel& model, Backend& be);

// Restores the state of this rank's layers from `r` where the checkpoint has it for this run's
// recipe; returns the line to log when it does not apply (no FP8 state in the checkpoint, state
// this run does not use, another history length), else "".
std::string restore_fp8_state(const CheckpointReader& r, GPTModel& model, Backend& be);

}  // namespace tessera
