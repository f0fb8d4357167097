// sampling.cpp: greedy, temperature, top-k and top-p sampling.
#include "inference/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/sampling.hpp"
#include "core/error.hpp"

namespace tessera {

void SamplingOptions::validate() const {
  using detail::concat;
  if (!(temperature >= 0) || !std::isfinite(temperature))
    throw ConfigError(
        concat("--temperature=", temperature, " is out of range (allowed: >= 0; 0 is greedy)"));
  if (top_k < 0)
    throw ConfigError(concat("--top-k=", top_k, " is out of range (allowed: >= 0; 0 is no limit)"));
  if (!(top_p > 0 && top_p <= 1))
    throw ConfigError(concat("--top-p=", top_p, " is out of range (allowed: (0, 1])"));
  if (!(top_p_decay >= 0 && top_p_decay <= 1))
    throw ConfigError(
        concat("--top-p-decay=", top_p_decay, " is out of range (allowed: [0, 1]; 0 is no decay)"));
  if (!(top_p_bound >= 0 && top_p_bound <= top_p))
    throw ConfigError(concat("--top-p-bound=", top_p_bound,
                             " is out of range (allowed: [0, --top-p=", top_p, "])"));
}

double SamplingOptions::top_p_at(int64_t steps) const {
  double p = top_p;
  if (top_p_decay > 0)
    for (int64_t i = 0; i < steps; ++i) p = std::max(p * top_p_decay, top_p_bound);
  return p;
}

double token_log_prob(const float* logits, int64_t n, int32_t token) {
  TESSERA_CHECK(token >= 0 && token < n, "token ", token, " outside ", n, " logits");
  const double m = *std::max_element(logits, logits + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - m);
  return static_cast<double>(logits[token]) - m - std::log(sum);
}

int32_t sample_token(const float* logits, int64_t n, const SamplingOptions& o, double u) {
  return cpu::sample_token(logits, n, o.token_sampling(u));
}

TokenSampling SamplingOptions::token_sampling(double u) const {
  TokenSampling t;
  t.temperature = temperature;
  t.top_k = top_k;
  t.top_p = top_p;
  t.u = u;
  return t;
}

}  // namespace tessera
