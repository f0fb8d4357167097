// sampling.hpp: choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).
#pragma once

#include <cstdint>

namespace tessera {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy
  int top_k = 0;             // 0: no limit
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 1234;
  // Throws ConfigError naming --temperature, --top-k or --top-p when out of range.
  void validate() const;
};

// logits over the true vocabulary (n entries); u uniform in [0, 1). Greedy (temperature 0 or
// top_k 1) takes the first index of the largest logit. Otherwise: logits / temperature, keep the
// top_k largest, softmax, keep the smallest prefix (by decreasing probability) whose mass reaches
// top_p, renormalize, and invert the CDF at u.
int32_t sample_token(const float* logits, int64_t n, const SamplingOptions& opts, double u);

}  // namespace tessera
