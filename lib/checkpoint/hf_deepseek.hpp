// hf_deepseek.hpp: Hugging Face DeepseekV3ForCausalLM's config.json (model_type deepseek_v3) to
// and from Tessera's model options: multi-latent attention with YaRN, the noaux_tc router
// (sigmoid scores, e_score_correction_bias, group-limited top-k), shared experts, the first
// layers dense, multi-token prediction (num_nextn_predict_layers). The tensors go through
// hf_llama.cpp's import and export (docs/checkpoints.md).
#pragma once

#include <string>

#include "model/gpt_config.hpp"

namespace tessera {

// Fills cfg from a DeepSeek-V3 config.json (`text`, read from `path`), with DeepseekV3Config's
// defaults for absent keys; `aux_coeff` gets aux_loss_alpha. ConfigError naming the file and the
// setting for what Tessera does not compute (FP8-quantized weights, another topk_method or
// scoring_func, norm_topk_prob false, attention biases, ...).
void parse_deepseek_config(const std::string& path, const std::string& text, GPTConfig& cfg,
                           double& aux_coeff);

// The config.json of a DeepSeek-V3 export of `cfg` (tensors in `torch_dtype`), with `aux_coeff`
// as aux_loss_alpha.
std::string deepseek_config_json(const GPTConfig& cfg, const std::string& torch_dtype,
                                 double aux_coeff);

// ConfigError naming `ck` for a checkpoint DeepseekV3ForCausalLM cannot hold.
void check_deepseek_exportable(const GPTConfig& cfg, const std::string& ck);

}  // namespace tessera
