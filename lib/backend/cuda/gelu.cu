// gelu.cu: the MLP's pointwise activations, forward and backward, one thread per element: GELU
// with the tanh approximation (GPT-2's "gelu_new") and squared ReLU (--squared-relu); the CPU
// reference is backend/cpu/gelu.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = ld(inp[i]);
  out[i] = to<T>(0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))));
}
template <typename T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = ld(inp[i]);
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float du = 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
  dinp[i] = to<T>(ld(dout[i]) * (0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * du));
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
  dispatch(inp.dtype(), "gelu", [&](auto tag) {
    using T = decltype(tag);
    gelu_forward_kernel<T>
        <<<blocks_for(inp.numel()), kThreads, 0, s>>>(out.data<T>(), inp.data<T>(), inp.numel());
  });
  LAUNCH_CHECK();
}

void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout, cudaStream_t s) {
  dispatch(inp.dtype(), "gelu backward", [&](auto tag) {
    using T = decltype(tag);
    gelu_backward_kernel<T><<<blocks_for(inp.numel()), kThreads, 0, s>>>(
        dinp.data<T>(), inp.data<T>(), dout.data<T>(), inp.numel());
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
