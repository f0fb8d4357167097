// hf_llama.hpp: Hugging Face LlamaForCausalLM import and export, and of the models of the same
// shape that differ in config.json only: Qwen2ForCausalLM (biases on q, k and v alone: Tessera's
// --disable-bias-linear --add-qkv-bias), Qwen3ForCausalLM (q_norm and k_norm: --qk-layernorm),
// MistralForCausalLM (no biases; sliding windows refused), and the mixtures of experts
// MixtralForCausalLM and Qwen3MoeForCausalLM (dense layers by mlp_only_layers). config.json
// (hidden_size, num_key_value_heads, rope_theta, rms_norm_eps, tie_word_embeddings, ...) and
// safetensors with the model.* tensor names, in one file or in shards listed by
// model.safetensors.index.json. Linear weights are [out, in] on both sides. Hugging Face's
// q_proj/k_proj/v_proj, gate_proj/ up_proj rows are concatenated into Tessera's attn.q + attn.kv
// (or attn.qkv) and mlp.fc1. Both sides rotate features (i, i + d/2) ("rotate half"), so the q/k
// rows need no permutation.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/safetensors.hpp"

namespace tessera {

// The model_type in DIR/config.json ("gpt2", "llama", ...); throws ConfigError naming the file.
std::string hf_model_type(const std::string& dir);
// The model of DIR/config.json (a Llama-family or DeepSeek-V3 model, as HfLlama reads it), from
// the config alone: no weights needed (tessera-plan --hf-config). ConfigError naming the file.
GPTConfig hf_model_config(const std::string& dir, int make_vocab_size_divisible_by);

struct HfExportOptions {
  std::string dtype = "bf16";             // bf16 | f32 (| f16)
  uint64_t max_shard_bytes = 5000000000;  // save_pretrained's default 5 GB
  // llama | qwen2 | qwen3 | qwen3_moe | mistral | mixtral; empty: qwen3 (qwen3_moe) for a model
  // with --qk-layernorm, mixtral for another MoE, qwen2 for QKV-only biases, else llama.
  std::string architecture;
};

// The model_type an export writes for `cfg` when `asked` ("" or an --hf-architecture value);
// ConfigError for an unknown one.
std::string hf_export_architecture(const GPTConfig& cfg, const std::string& asked);
// The Hugging Face class of a model_type ("qwen3" -> "Qwen3ForCausalLM"; gpt2 included).
std::string hf_class_name(const std::string& arch);

// Writes DIR/config.json and the safetensors (DIR/model.safetensors, or model-0000k-of-0000n
// shards with DIR/model.safetensors.index.json when larger than max_shard_bytes) from a checkpoint
// of a Llama-family model (any layout).
void export_hf_llama(const CheckpointReader& ckpt, const std::string& dir,
                     const HfExportOptions& options,
                     const std::function<void(const std::string&)>& progress);

// A Hugging Face Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Mixtral or DeepSeek-V3 directory opened
// for import.
class HfLlama {
 public:
  // Reads DIR/config.json and the safetensors; checks every tensor's presence and shape against
  // the config; throws ConfigError naming the file.
  HfLlama(const std::string& dir, int make_vocab_size_divisible_by);
  const GPTConfig& config() const { return cfg_; }
  // Fills `out` with the slice `spec` describes of the tensor in Tessera's layout.
  void read_slice(const ParamSpec& spec, float* out) const;
  // The per-layer state beside the parameters a checkpoint holds (DeepSeek-V3: each MoE layer's
  // e_score_correction_bias as the router's expert bias); empty for other layers and models.
  std::vector<ExtraTensor> layer_state(int layer) const;

 private:
  GPTConfig cfg_;
  std::string dir_, arch_;  // arch_: config.json's model_type
  std::unique_ptr<SafetensorsDir> st_;
};

}  // namespace tessera
