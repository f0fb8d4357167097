// swiglu.hpp: the SwiGLU activation of Llama's MLP: out = silu(gate) * up, silu(x) = x sigmoid(x),
// where each row of the fc1 output holds [gate (F) | up (F)].
#pragma once

#include <cmath>
#include <cstdint>

namespace tessera::cpu {

// out (N,F); inp (N,2F).
template <typename T>
void swiglu_forward(T* out, const T* inp, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* g = inp + n * 2 * F;
    const T* u = g + F;
    T* y = out + n * F;
    for (int64_t i = 0; i < F; ++i) {
      const T sig = T(1) / (T(1) + std::exp(-g[i]));
      y[i] = g[i] * sig * u[i];
    }
  }
}

// dinp (N,2F) overwritten: d gate = dout * up * silu'(gate), d up = dout * silu(gate), with
// silu'(x) = sig(x) (1 + x (1 - sig(x))).
template <typename T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* g = inp + n * 2 * F;
    const T* u = g + F;
    const T* dy = dout + n * F;
    T* dg = dinp + n * 2 * F;
    T* du = dg + F;
    for (int64_t i = 0; i < F; ++i) {
      const T sig = T(1) / (T(1) + std::exp(-g[i]));
      const T silu = g[i] * sig;
      dg[i] = dy[i] * u[i] * sig * (T(1) + g[i] * (T(1) - sig));
      du[i] = dy[i] * silu;
    }
  }
}

}  // namespace tessera::cpu
