// hf_family.hpp: a Hugging Face family's adapter to the Llama-shaped mapping of hf_llama.cpp (as
// torchtitan gives each model its state-dict adapter). The Llama family (llama, qwen2, qwen3,
// qwen3_moe, mistral, mixtral) differs from Llama in config.json only and is mapped by
// hf_llama.cpp itself; a family with tensors of its own (DeepSeek-V3: multi-latent attention,
// shared experts, multi-token prediction layers, the router's correction bias) brings all of its
// mapping in its own file (hf_deepseek.cpp) behind this interface.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/gpt_config.hpp"

namespace tessera {

// A tensor of a Hugging Face directory beside the parameters' parts: a layer's router state
// (checkpoint group "router"), or a copy of a parameter the family repeats.
struct HfExtra {
  std::string name;
  Shape shape;
  int bias_layer = -1;      // >= 0: that layer's expert bias
  std::string copy_of;      // else: the Tessera parameter this tensor repeats
  std::string copy_reason;  // why the copy must equal it (the error's second half)
};

struct HfFamily {
  const char* model_type;  // config.json's
  const char* class_name;  // its architectures[0]
  // The Hugging Face tensors whose rows, concatenated, make Tessera parameter `n` where the
  // family names it its own way; empty: the Llama names (hf_llama.cpp). `num_layers`: the
  // model's layers (tensors of extra layers follow them).
  std::vector<std::string> (*parts)(const std::string& n, int num_layers);
  // The tensors beside the parameters (empty: none).
  std::vector<HfExtra> (*extras)(const GPTConfig& cfg);
  // Fills cfg from config.json (`text`, read from `path`) with the config class's defaults for
  // absent keys; `aux_coeff` gets the auxiliary-loss coefficient. ConfigError naming the file
  // and the setting for what Tessera does not compute; a key it does not read is said.
  void (*parse_config)(const std::string& path, const std::string& text, GPTConfig& cfg,
                       double& aux_coeff);
  // The config.json of an export of `cfg` (tensors in `torch_dtype`).
  std::string (*config_json)(const GPTConfig& cfg, const std::string& torch_dtype,
                             double aux_coeff);
  // ConfigError naming `ck` for a checkpoint the family's class cannot hold.
  void (*check_exportable)(const GPTConfig& cfg, const std::string& ck);
};

// The adapter of model_type `arch`, or null for the Llama family's types (hf_llama.cpp).
const HfFamily* hf_family(const std::string& arch);

}  // namespace tessera
