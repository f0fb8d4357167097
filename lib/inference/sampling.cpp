// sampling.cpp: greedy, temperature, top-k and top-p sampling.
#include "inference/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

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
  if (o.temperature == 0 || o.top_k == 1)
    return static_cast<int32_t>(std::max_element(logits, logits + n) - logits);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  // Decreasing logit, ties by index: a total order, so the result never depends on the sort.
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int64_t k = o.top_k > 0 ? std::min<int64_t>(o.top_k, n) : n;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), by_logit);
  idx.resize(static_cast<size_t>(k));
  std::vector<double> p(idx.size());
  const double m = logits[idx[0]];
  double sum = 0;
  for (size_t i = 0; i < idx.size(); ++i) {
    p[i] = std::exp((logits[idx[i]] - m) / o.temperature);
    sum += p[i];
  }
  size_t keep = idx.size();
  if (o.top_p < 1) {
    double mass = 0;
    for (size_t i = 0; i < idx.size(); ++i) {
      mass += p[i] / sum;
      if (mass >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += p[i];
  double acc = 0;
  const double target = u * kept;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (target < acc) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace tessera
