// swiglu.cu: the SwiGLU activation of Llama's MLP, out = silu(gate) * up with each input row
// [gate (F) | up (F)], forward and backward. 16 bytes of each operand per thread (kVec<T> output
// columns) where F is a multiple of the pack and every base 16-byte aligned, one output element
// per thread otherwise: the same arithmetic per element either way, so the results are bitwise
// the same. Why: at one element per thread, with a 64-bit division per element for its row, the
// Mixtral-shaped step's expert activation ran at ~half of HBM's bandwidth (3.7 ms forward, 4.2
// backward, H200 2026-11-28). The CPU reference is backend/cpu/swiglu.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::cuda_ops {

namespace {

using rowwise::kVec;
using rowwise::load16;
using rowwise::Pack;
using rowwise::store16;

// The per-element arithmetic, shared by the element and the 16-byte kernels.
__device__ __forceinline__ float silu_times(float g, float u) {
  const float sig = 1.f / (1.f + expf(-g));
  return g * sig * u;
}
__device__ __forceinline__ void swiglu_grads(float g, float u, float dy, float& dg, float& du) {
  const float sig = 1.f / (1.f + expf(-g));
  dg = dy * u * sig * (1.f + g * (1.f - sig));
  du = dy * (g * sig);
}

// out (N,F); inp (N,2F).
template <typename T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (n, j)
  if (i >= N * F) return;
  const int64_t n = i / F, j = i % F;
  out[i] = to<T>(silu_times(ld(inp[n * 2 * F + j]), ld(inp[n * 2 * F + F + j])));
}
// dinp (N,2F) overwritten: d gate = dout * up * silu'(gate), d up = dout * silu(gate), with
// silu'(x) = sig(x) (1 + x (1 - sig(x))).
template <typename T>
__global__ void swiglu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (n, j)
  if (i >= N * F) return;
  const int64_t n = i / F, j = i % F;
  float dg, du;
  swiglu_grads(ld(inp[n * 2 * F + j]), ld(inp[n * 2 * F + F + j]), ld(dout[i]), dg, du);
  dinp[n * 2 * F + j] = to<T>(dg);
  dinp[n * 2 * F + F + j] = to<T>(du);
}

// Pack p of the output: row n = p / (F / K), columns j .. j + K of the F.
template <typename T>
__global__ void swiglu_forward_vec_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  constexpr int K = kVec<T>;
  const int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, row_packs = F / K;
  if (p >= N * row_packs) return;
  const int64_t n = p / row_packs, j = (p - n * row_packs) * K;
  const Pack<T> g = load16(inp + n * 2 * F + j), u = load16(inp + n * 2 * F + F + j);
  Pack<T> o;
#pragma unroll
  for (int e = 0; e < K; ++e) o.e[e] = to<T>(silu_times(ld(g.e[e]), ld(u.e[e])));
  store16(out + p * K, o);
}
template <typename T>
__global__ void swiglu_backward_vec_kernel(T* dinp, const T* inp, const T* dout, int64_t N,
                                           int64_t F) {
  constexpr int K = kVec<T>;
  const int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, row_packs = F / K;
  if (p >= N * row_packs) return;
  const int64_t n = p / row_packs, j = (p - n * row_packs) * K;
  const Pack<T> g = load16(inp + n * 2 * F + j), u = load16(inp + n * 2 * F + F + j),
                d = load16(dout + p * K);
  Pack<T> dg, du;
#pragma unroll
  for (int e = 0; e < K; ++e) {
    float a, b;
    swiglu_grads(ld(g.e[e]), ld(u.e[e]), ld(d.e[e]), a, b);
    dg.e[e] = to<T>(a);
    du.e[e] = to<T>(b);
  }
  store16(dinp + n * 2 * F + j, dg);
  store16(dinp + n * 2 * F + F + j, du);
}

}  // namespace

void swiglu_forward(Tensor& out, const Tensor& inp, cudaStream_t s) {
  const int64_t N = rows_of(inp), F = cols_of(inp) / 2;
  if (N * F == 0) return;
  dispatch(inp.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    if (rowwise::norm_vec_ok<T>(F, {out.raw(), inp.raw()}))
      swiglu_forward_vec_kernel<T>
          <<<blocks_for(N * F / kVec<T>), kThreads, 0, s>>>(out.data<T>(), inp.data<T>(), N, F);
    else
      swiglu_forward_kernel<T>
          <<<blocks_for(N * F), kThreads, 0, s>>>(out.data<T>(), inp.data<T>(), N, F);
  });
  LAUNCH_CHECK();
}

void swiglu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout, cudaStream_t s) {
  const int64_t N = rows_of(inp), F = cols_of(inp) / 2;
  if (N * F == 0) return;
  dispatch(inp.dtype(), "swiglu backward", [&](auto tag) {
    using T = decltype(tag);
    if (rowwise::norm_vec_ok<T>(F, {dinp.raw(), inp.raw(), dout.raw()}))
      swiglu_backward_vec_kernel<T><<<blocks_for(N * F / kVec<T>), kThreads, 0, s>>>(
          dinp.data<T>(), inp.data<T>(), dout.data<T>(), N, F);
    else
      swiglu_backward_kernel<T><<<blocks_for(N * F), kThreads, 0, s>>>(
          dinp.data<T>(), inp.data<T>(), dout.data<T>(), N, F);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
