// sampling.hpp: choosing the next token of each row of logits, the reference for the CUDA
// sampler (backend/cuda/sampling.cu). Greedy (temperature 0 or top_k 1) takes the first index of
// the largest logit. Otherwise: sort by decreasing logit (ties by index), keep the top_k largest,
// p_i = exp((l_i - l_max) / temperature) in double, keep the smallest prefix whose share of the
// mass reaches top_p, and invert the cumulative sum of what is kept at u * (its sum).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace tessera {

// How one row is sampled; u uniform in [0, 1).
struct TokenSampling {
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  double top_p = 1.0;        // (0, 1]
  double u = 0.0;
  bool greedy() const { return temperature == 0 || top_k == 1; }
};

namespace cpu {

inline int32_t sample_token(const float* logits, int64_t n, const TokenSampling& o) {
  if (o.greedy()) return static_cast<int32_t>(std::max_element(logits, logits + n) - logits);
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
  const double target = o.u * kept;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (target < acc) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace cpu
}  // namespace tessera
