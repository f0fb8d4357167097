// swiglu.cu: the SwiGLU activation of Llama's MLP, out = silu(gate) * up with each input row
// [gate (F) | up (F)], forward and backward, one thread per output element (of the F columns).
// The CPU reference is backend/cpu/swiglu.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

// out (N,F); inp (N,2F).
template <typename T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (n, j)
  if (i >= N * F) return;
  const int64_t n = i / F, j = i % F;
  const float g = ld(inp[n * 2 * F + j]), u = ld(inp[n * 2 * F + F + j]);
  const float sig = 1.f / (1.f + expf(-g));
  out[i] = to<T>(g * sig * u);
}
// dinp (N,2F) overwritten: d gate = dout * up * silu'(gate), d up = dout * silu(gate), with
// silu'(x) = sig(x) (1 + x (1 - sig(x))).
template <typename T>
__global__ void swiglu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (n, j)
  if (i >= N * F) return;
  const int64_t n = i / F, j = i % F;
  const float g = ld(inp[n * 2 * F + j]), u = ld(inp[n * 2 * F + F + j]), dy = ld(dout[i]);
  const float sig = 1.f / (1.f + expf(-g));
  dinp[n * 2 * F + j] = to<T>(dy * u * sig * (1.f + g * (1.f - sig)));
  dinp[n * 2 * F + F + j] = to<T>(dy * (g * sig));
}

}  // namespace

void swiglu_forward(Tensor& out, const Tensor& inp, cudaStream_t s) {
  const int64_t N = rows_of(inp), F = cols_of(inp) / 2;
  if (N * F == 0) return;
  dispatch(inp.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
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
    swiglu_backward_kernel<T><<<blocks_for(N * F), kThreads, 0, s>>>(dinp.data<T>(), inp.data<T>(),
                                                                     dout.data<T>(), N, F);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
