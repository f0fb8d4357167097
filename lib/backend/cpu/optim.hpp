// optim.hpp: AdamW (decoupled weight decay, PyTorch's update order) and gradient-norm helpers.
#pragma once

#include <cmath>
#include <cstdint>

namespace tessera::cpu {

// One AdamW step over n elements; `step` counts from 1. Matches torch.optim.AdamW:
//   p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   p -= (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)
// `grad_scale` multiplies each gradient as it is read (gradient clipping's coefficient).
template <typename T>
void adamw_step(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step,
                double grad_scale = 1.0) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const T step_size = static_cast<T>(lr / bc1);
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T decay = static_cast<T>(1.0 - lr * weight_decay);
  const T b1 = static_cast<T>(beta1), b2 = static_cast<T>(beta2), e = static_cast<T>(eps);
  const T gs = static_cast<T>(grad_scale);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i] * gs;
    T p = param[i] * decay;
    const T mi = b1 * m[i] + (T(1) - b1) * g;
    const T vi = b2 * v[i] + (T(1) - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    p -= step_size * mi / (std::sqrt(vi) / bc2_sqrt + e);
    param[i] = p;
  }
}

// Sum of squares in double over fixed blocks added in order, so the result does not depend on the
// number of threads (exact resume and layout invariance need a reproducible grad norm).
template <typename T>
double sum_squares(const T* x, int64_t n) {
  constexpr int64_t kBlock = 1 << 14;
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  double total = 0;
  constexpr int64_t kChunk = 256;  // blocks summed per pass, so partials stay on the stack
  for (int64_t b0 = 0; b0 < nblocks; b0 += kChunk) {
    double part[kChunk];
    const int64_t b1 = b0 + kChunk < nblocks ? b0 + kChunk : nblocks;
#pragma omp parallel for schedule(static)
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i1 = (b + 1) * kBlock < n ? (b + 1) * kBlock : n;
      double s = 0;
      for (int64_t i = b * kBlock; i < i1; ++i) s += static_cast<double>(x[i]) * x[i];
      part[b - b0] = s;
    }
    for (int64_t b = b0; b < b1; ++b) total += part[b - b0];
  }
  return total;
}

template <typename T>
void scale_inplace(T* x, int64_t n, T s) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

// out = a + b (the residual add); out may alias a or b.
template <typename T>
void add(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace tessera::cpu
