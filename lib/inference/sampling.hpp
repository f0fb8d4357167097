// sampling.hpp: choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus)
// with Megatron's per-step decay; log-probabilities of chosen tokens.
#pragma once

#include <cstdint>

#include "backend/cpu/sampling.hpp"

namespace tessera {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy
  int top_k = 0;             // 0: no limit
  double top_p = 1.0;        // (0, 1]
  // Megatron's --top-p-decay / --top-p-bound: after each generated token top_p becomes
  // max(top_p * decay, bound) (decay 0: no decay).
  double top_p_decay = 0.0;  // [0, 1]
  double top_p_bound = 0.0;  // [0, top_p]
  uint64_t seed = 1234;
  // Throws ConfigError naming --temperature, --top-k or --top-p when out of range.
  void validate() const;
  // top_p after `steps` generated tokens.
  double top_p_at(int64_t steps) const;
  // These options for one row, with the uniform draw u (what Backend::sample_tokens takes).
  TokenSampling token_sampling(double u) const;
};

// logits over the true vocabulary (n entries); u uniform in [0, 1). Greedy (temperature 0 or
// top_k 1) takes the first index of the largest logit. Otherwise: logits / temperature, keep the
// top_k largest, softmax, keep the smallest prefix (by decreasing probability) whose mass reaches
// top_p, renormalize, and invert the CDF at u.
int32_t sample_token(const float* logits, int64_t n, const SamplingOptions& opts, double u);

// log softmax(logits)[token] over n entries, in double (the model's distribution, before any
// temperature or truncation).
double token_log_prob(const float* logits, int64_t n, int32_t token);

}  // namespace tessera
