// hf_gpt2.hpp: Hugging Face GPT-2 (GPT2LMHeadModel) import and export: model.safetensors with the
// transformer.* tensor names and Conv1D [in, out] weights, plus config.json. Tessera stores linear
// weights [out, in] with QKV as [3, heads, head_dim, hidden]; the output order of HF's c_attn
// (q | k | v, head-major inside each) is the same, so conversion is a transpose.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/safetensors.hpp"

namespace tessera {

// Writes DIR/model.safetensors and DIR/config.json from a checkpoint (any layout).
void export_hf_gpt2(const CheckpointReader& ckpt, const std::string& dir,
                    const std::function<void(const std::string&)>& progress);

// A Hugging Face GPT-2 directory opened for import.
class HfGpt2 {
 public:
  // Reads DIR/config.json and DIR/model.safetensors; throws ConfigError naming the file.
  HfGpt2(const std::string& dir, int make_vocab_size_divisible_by);
  const GPTConfig& config() const { return cfg_; }
  // Fills `out` with the slice `spec` describes of the tensor in Tessera's layout.
  void read_slice(const ParamSpec& spec, float* out) const;

 private:
  GPTConfig cfg_;
  std::unique_ptr<SafetensorsReader> st_;
  std::string prefix_;  // "transformer." or "" (GPT2Model files)
};

}  // namespace tessera
