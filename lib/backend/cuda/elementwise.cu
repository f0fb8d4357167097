// elementwise.cu: the residual add and dtype casts, one thread per element (CPU: add in
// backend/cpu/optim.hpp, cast in cpu_backend.cpp).
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

template <typename T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = to<T>(ld(a[i]) + ld(b[i]));
}
template <typename TO, typename TI>
__global__ void cast_kernel(TO* out, const TI* in, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = to<TO>(ld(in[i]));
}

}  // namespace

void cast(Tensor& dst, const Tensor& src, cudaStream_t s) {
  dispatch(dst.dtype(), "cast", [&](auto to_tag) {
    using TO = decltype(to_tag);
    dispatch(src.dtype(), "cast", [&](auto from_tag) {
      using TI = decltype(from_tag);
      cast_kernel<TO, TI><<<blocks_for(src.numel()), kThreads, 0, s>>>(dst.data<TO>(),
                                                                       src.data<TI>(), src.numel());
    });
  });
  LAUNCH_CHECK();
}

void add(Tensor& out, const Tensor& a, const Tensor& b, cudaStream_t s) {
  dispatch(a.dtype(), "add", [&](auto tag) {
    using T = decltype(tag);
    add_kernel<T><<<blocks_for(a.numel()), kThreads, 0, s>>>(out.data<T>(), a.data<T>(),
                                                             b.data<T>(), a.numel());
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
