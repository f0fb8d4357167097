// matmul.hpp: linear layer y = x W^T + b with W stored [out, in] (nn.Linear / Megatron order).
#pragma once

#include <cstdint>

#include "backend/cpu/gemm.hpp"

namespace tessera::cpu {

// out is (N,OC), inp is (N,IC), weight is (OC,IC), bias is (OC) or null.
template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int64_t IC,
                    int64_t OC) {
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) out[n * OC + o] = bias[o];
  }
  gemm(false, true, N, OC, IC, T(1), inp, IC, weight, IC, bias ? T(1) : T(0), out, OC);
}

// dinp (N,IC) is overwritten (skipped if null); dweight (OC,IC) and dbias (OC) are accumulated
// (skipped if null). The three are independent: computed apart (zero-bubble's B and W passes)
// they are the same bits.
template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                     int64_t N, int64_t IC, int64_t OC) {
  if (dinp) gemm(false, false, N, IC, OC, T(1), dout, OC, weight, IC, T(0), dinp, IC);
  if (dweight) gemm(true, false, OC, IC, N, T(1), dout, OC, inp, IC, T(1), dweight, IC);
  if (dbias) {
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < OC; ++o) {
      T s = 0;
      for (int64_t n = 0; n < N; ++n) s += dout[n * OC + o];
      dbias[o] += s;
    }
  }
}

}  // namespace tessera::cpu
