// gelu.hpp: the MLP's pointwise activations: GELU with the tanh approximation (GPT-2's
// "gelu_new"), and squared ReLU (Megatron's --squared-relu).
#pragma once

#include <cmath>
#include <cstdint>

namespace tessera::cpu {

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2/pi)

// out and inp are (N); out may not alias inp.
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T x = inp[i];
    const T cube = T(0.044715) * x * x * x;
    out[i] = T(0.5) * x * (T(1) + std::tanh(T(kGeluScale) * (x + cube)));
  }
}

// dinp = dout * gelu'(inp); dinp may alias dout.
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T x = inp[i];
    const T u = T(kGeluScale) * (x + T(0.044715) * x * x * x);
    const T th = std::tanh(u);
    const T sech2 = T(1) - th * th;
    const T du = T(kGeluScale) * (T(1) + T(3 * 0.044715) * x * x);
    dinp[i] = dout[i] * (T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * du);
  }
}

// Squared ReLU: out = max(x, 0)^2; out may alias inp.
template <typename T>
void squared_relu_forward(T* out, const T* inp, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T r = inp[i] > T(0) ? inp[i] : T(0);
    out[i] = r * r;
  }
}

// dinp = dout * 2 max(x, 0); dinp may alias dout.
template <typename T>
void squared_relu_backward(T* dinp, const T* inp, const T* dout, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T r = inp[i] > T(0) ? inp[i] : T(0);
    dinp[i] = dout[i] * (T(2) * r);
  }
}

}  // namespace tessera::cpu
