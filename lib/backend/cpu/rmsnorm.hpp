// rmsnorm.hpp: RMSNorm over the last axis (Llama's normalization), y = x * rstd * w with
// rstd = 1/sqrt(mean(x^2) + eps): no mean subtraction, no bias.
#pragma once

#include <cmath>
#include <cstdint>

namespace tessera::cpu {

// out, inp are (N,C); rstd (N) is kept for the backward; weight (C).
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                     double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    double ss = 0;
    for (int64_t i = 0; i < C; ++i) ss += static_cast<double>(x[i]) * x[i];
    const double s = 1.0 / std::sqrt(ss / C + eps);
    T* y = out + n * C;
    for (int64_t i = 0; i < C; ++i) y[i] = static_cast<T>(x[i] * s) * weight[i];
    rstd[n] = static_cast<T>(s);
  }
}

// With xhat = x * rstd: dx = rstd * (w o dy - xhat * mean(w o dy o xhat)). dinp (N,C) is
// accumulated into (the residual stream's gradient); dweight accumulated.
template <typename T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                      const T* rstd, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* dy = dout + n * C;
    const T* x = inp + n * C;
    const double s = rstd[n];
    double dot = 0;
    for (int64_t i = 0; i < C; ++i) dot += static_cast<double>(weight[i]) * dy[i] * x[i] * s;
    dot /= C;
    T* dx = dinp + n * C;
    for (int64_t i = 0; i < C; ++i) {
      const double xhat = x[i] * s;
      dx[i] += static_cast<T>((static_cast<double>(weight[i]) * dy[i] - xhat * dot) * s);
    }
  }
  // The weight gradient: parallel over channels so each sum has one owner (deterministic).
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < C; ++i) {
    double dw = 0;
    for (int64_t n = 0; n < N; ++n)
      dw += static_cast<double>(inp[n * C + i]) * rstd[n] * dout[n * C + i];
    dweight[i] += static_cast<T>(dw);
  }
}

}  // namespace tessera::cpu
