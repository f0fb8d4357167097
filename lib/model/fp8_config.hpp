// fp8_config.hpp: what Megatron's --fp8-* options say (options/fp8.cpp parses them;
// model/fp8.hpp acts on them; docs/training.md, "FP8").
#pragma once

#include <cstdint>
#include <string>

#include "core/fp8.hpp"

namespace tessera {

enum class Fp8Recipe { Delayed, Tensorwise };

struct Fp8Config {
  bool enabled = false;  // --fp8-format given
  bool hybrid = false;   // --fp8-format hybrid: E5M2 output gradients (else everything E4M3)
  Fp8Recipe recipe = Fp8Recipe::Delayed;
  int margin = 0;                // --fp8-margin (delayed)
  int amax_history_len = 1;      // --fp8-amax-history-len (delayed)
  bool amax_most_recent = true;  // --fp8-amax-compute-algo most_recent (else max)
  // --first-last-layers-bf16: the first and last layers' GEMMs stay in the model's precision.
  bool first_last_bf16 = false;
  int layers_at_start_bf16 = 1, layers_at_end_bf16 = 1;

  // Whether `layer` (global index) of `num_layers` runs its GEMMs in FP8.
  bool layer_in_fp8(int layer, int num_layers) const;
  Fp8Format grad_format() const { return hybrid ? Fp8Format::E5M2 : Fp8Format::E4M3; }
  // "hybrid, tensorwise" / "e4m3, delayed (history 16, max, margin 0)", plus the bf16 layers.
  std::string describe(int num_layers) const;
};

// The FP8 tensors of a layer: the input, weight and output gradient of QKV, the projection, FC1 and
// FC2, then of each expert's FC1 and FC2 in an MoE model (every layer the same width). The
// delayed-scaling state in checkpoints has these columns (train/fp8_checkpoint.hpp).
inline int64_t fp8_state_columns(int num_experts) {
  return 12 + 6 * int64_t(num_experts);
}

}  // namespace tessera
