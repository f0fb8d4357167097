// gelu.cu: the MLP's pointwise activations, forward and backward: GELU with the tanh
// approximation (GPT-2's "gelu_new") and squared ReLU (--squared-relu); the CPU reference is
// backend/cpu/gelu.hpp. GELU reads and writes 16 bytes per thread where every operand is 16-byte
// aligned and the count a multiple of the pack (one element per thread otherwise): the same
// arithmetic per element either way, so the results are bitwise the same. Why: at one 2-byte
// element per thread the GPT-2 124M forward moved ~1.3 TB/s (1.8 ms of a 34.5 ms H200 step,
// docs/performance.md).
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::cuda_ops {

namespace {

using rowwise::kVec;
using rowwise::load16;
using rowwise::Pack;
using rowwise::store16;

__device__ __forceinline__ float gelu_of(float x) {
  return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x, float dout) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float du = 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
  return dout * (0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * du);
}

template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = to<T>(gelu_of(ld(inp[i])));
}
template <typename T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  dinp[i] = to<T>(gelu_grad(ld(inp[i]), ld(dout[i])));
}
// `packs` packs of kVec<T> elements, one per thread.
template <typename T>
__global__ void gelu_forward_vec_kernel(T* out, const T* inp, int64_t packs) {
  const int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (p >= packs) return;
  Pack<T> v = load16(inp + p * kVec<T>);
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) v.e[e] = to<T>(gelu_of(ld(v.e[e])));
  store16(out + p * kVec<T>, v);
}
template <typename T>
__global__ void gelu_backward_vec_kernel(T* dinp, const T* inp, const T* dout, int64_t packs) {
  const int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (p >= packs) return;
  const Pack<T> x = load16(inp + p * kVec<T>);
  Pack<T> d = load16(dout + p * kVec<T>);
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) d.e[e] = to<T>(gelu_grad(ld(x.e[e]), ld(d.e[e])));
  store16(dinp + p * kVec<T>, d);
}

// n elements of T at these addresses go 16 bytes at a time.
template <typename T>
bool packed(int64_t n, std::initializer_list<const void*> ptrs) {
  if (n % kVec<T> != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <typename T>
__global__ void squared_relu_forward_kernel(T* out, const T* inp, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float r = fmaxf(ld(inp[i]), 0.f);
  out[i] = to<T>(r * r);
}
template <typename T>
__global__ void squared_relu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float r = fmaxf(ld(inp[i]), 0.f);
  dinp[i] = to<T>(ld(dout[i]) * (2.f * r));
}

}  // namespace

void squared_relu_forward(Tensor& out, const Tensor& inp, cudaStream_t s) {
  if (inp.numel() == 0) return;
  dispatch(inp.dtype(), "squared relu", [&](auto tag) {
    using T = decltype(tag);
    squared_relu_forward_kernel<T>
        <<<blocks_for(inp.numel()), kThreads, 0, s>>>(out.data<T>(), inp.data<T>(), inp.numel());
  });
  LAUNCH_CHECK();
}

void squared_relu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout, cudaStream_t s) {
  if (inp.numel() == 0) return;
  dispatch(inp.dtype(), "squared relu backward", [&](auto tag) {
    using T = decltype(tag);
    squared_relu_backward_kernel<T><<<blocks_for(inp.numel()), kThreads, 0, s>>>(
        dinp.data<T>(), inp.data<T>(), dout.data<T>(), inp.numel());
  });
  LAUNCH_CHECK();
}

void gelu_forward(Tensor& out, const Tensor& inp, cudaStream_t s) {
  const int64_t n = inp.numel();
  if (n == 0) return;
  dispatch(inp.dtype(), "gelu", [&](auto tag) {
    using T = decltype(tag);
    if (packed<T>(n, {out.raw(), inp.raw()}))
      gelu_forward_vec_kernel<T>
          <<<blocks_for(n / kVec<T>), kThreads, 0, s>>>(out.data<T>(), inp.data<T>(), n / kVec<T>);
    else
      gelu_forward_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(out.data<T>(), inp.data<T>(), n);
  });
  LAUNCH_CHECK();
}

void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout, cudaStream_t s) {
  const int64_t n = inp.numel();
  if (n == 0) return;
  dispatch(inp.dtype(), "gelu backward", [&](auto tag) {
    using T = decltype(tag);
    if (packed<T>(n, {dinp.raw(), inp.raw(), dout.raw()}))
      gelu_backward_vec_kernel<T><<<blocks_for(n / kVec<T>), kThreads, 0, s>>>(
          dinp.data<T>(), inp.data<T>(), dout.data<T>(), n / kVec<T>);
    else
      gelu_backward_kernel<T>
          <<<blocks_for(n), kThreads, 0, s>>>(dinp.data<T>(), inp.data<T>(), dout.data<T>(), n);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
