// layernorm.hpp: LayerNorm over the last axis, y = (x - mean) * rstd * w + b.
#pragma once

#include <cmath>
#include <cstdint>

namespace tessera::cpu {

// out, inp are (N,C); mean, rstd are (N) and kept for the backward; weight, bias are (C).
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                       int64_t N, int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    double m = 0;
    for (int64_t i = 0; i < C; ++i) m += x[i];
    m /= C;
    double v = 0;
    for (int64_t i = 0; i < C; ++i) {
      const double d = x[i] - m;
      v += d * d;
    }
    v /= C;
    const double s = 1.0 / std::sqrt(v + eps);
    T* y = out + n * C;
    for (int64_t i = 0; i < C; ++i) y[i] = static_cast<T>((x[i] - m) * s) * weight[i] + bias[i];
    mean[n] = static_cast<T>(m);
    rstd[n] = static_cast<T>(s);
  }
}

// dinp (N,C) is accumulated into (the residual stream's gradient); dweight, dbias accumulated.
template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const T* mean, const T* rstd, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* dy = dout + n * C;
    const T* x = inp + n * C;
    const double m = mean[n], s = rstd[n];
    double dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int64_t i = 0; i < C; ++i) {
      const double xhat = (x[i] - m) * s;
      const double dnorm = static_cast<double>(weight[i]) * dy[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * xhat;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    T* dx = dinp + n * C;
    for (int64_t i = 0; i < C; ++i) {
      const double xhat = (x[i] - m) * s;
      const double dnorm = static_cast<double>(weight[i]) * dy[i];
      dx[i] += static_cast<T>((dnorm - dnorm_mean - xhat * dnorm_norm_mean) * s);
    }
  }
  // Parameter gradients: parallel over channels so each sum has one owner (deterministic).
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < C; ++i) {
    double dw = 0, db = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double xhat = (inp[n * C + i] - static_cast<double>(mean[n])) * rstd[n];
      dw += xhat * dout[n * C + i];
      db += dout[n * C + i];
    }
    dweight[i] += static_cast<T>(dw);
    dbias[i] += static_cast<T>(db);
  }
}

}  // namespace tessera::cpu
