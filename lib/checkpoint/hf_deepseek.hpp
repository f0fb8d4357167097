// hf_deepseek.hpp: Hugging Face DeepseekV3ForCausalLM (model_type deepseek_v3) as a family
// adapter (checkpoint/hf_family.hpp): config.json to and from Tessera's model options (multi-latent
// attention with YaRN, the noaux_tc router with sigmoid scores, e_score_correction_bias and
// group-limited top-k, shared experts, the first layers dense, multi-token prediction as
// num_nextn_predict_layers), its tensor names (MLA's projections, the router, shared experts, the
// MTP layers after the model's) and the tensors beside the parameters (the correction biases, the
// MTP layers' copies of the embedding and the output layer). The Llama-named tensors and the
// import and export themselves are hf_llama.cpp's (docs/checkpoints.md).
#pragma once

#include "checkpoint/hf_family.hpp"

namespace tessera {

const HfFamily& deepseek_v3_family();

}  // namespace tessera
