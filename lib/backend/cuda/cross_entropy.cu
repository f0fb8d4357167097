// cross_entropy.cu: vocab-parallel softmax cross-entropy in three passes, one block per row (row
// max, then the sum of exponentials and the target's logit, then the loss and the gradient written
// over the logits), so the row statistics can be all-reduced across tensor-parallel ranks between
// passes; the CPU reference is backend/cpu/cross_entropy.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

// ---- cross-entropy (one block per row) --------------------------------------------------------

template <typename T>
__global__ void xent_max_kernel(float* rowmax, const T* logits, int64_t V, int64_t valid) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, ld(logits[n * V + j]));
  m = block_max(m, sh);
  if (threadIdx.x == 0) rowmax[n] = m;
}
template <typename T>
__global__ void xent_sums_kernel(float* sumexp, float* target_logit, const T* logits,
                                 const float* rowmax, const int32_t* targets, int64_t V,
                                 int64_t valid, int64_t col_begin) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x)
    s += expf(ld(logits[n * V + j]) - rowmax[n]);
  s = block_sum(s, sh);
  if (threadIdx.x == 0) {
    sumexp[n] = s;
    const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
    target_logit[n] = (targets[n] >= 0 && tj >= 0 && tj < valid) ? ld(logits[n * V + tj]) : 0.f;
  }
}
template <typename T>
__global__ void xent_grad_kernel(float* losses, T* logits, const float* rowmax, const float* sumexp,
                                 const float* target_logit, const int32_t* targets, int64_t V,
                                 int64_t valid, int64_t col_begin, float scale) {
  const int64_t n = blockIdx.x;
  T* l = logits + n * V;
  const bool ignore = targets[n] < 0;
  const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
  const float inv = 1.f / sumexp[n];
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    float g = 0.f;
    if (!ignore && j < valid)
      g = expf(ld(l[j]) - rowmax[n]) * inv * scale - (j == tj ? scale : 0.f);
    l[j] = to<T>(g);
  }
  if (threadIdx.x == 0) losses[n] = ignore ? 0.f : logf(sumexp[n]) + rowmax[n] - target_logit[n];
}

}  // namespace

void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid, cudaStream_t s) {
  dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
    using T = decltype(tag);
    xent_max_kernel<T><<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, s>>>(
        rowmax.f32(), logits.data<T>(), cols_of(logits), valid);
  });
  LAUNCH_CHECK();
}

void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits, const Tensor& rowmax,
                   const Tensor& targets, int64_t valid, int64_t col_begin, cudaStream_t s) {
  dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
    using T = decltype(tag);
    xent_sums_kernel<T><<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, s>>>(
        sumexp.f32(), target_logit.f32(), logits.data<T>(), rowmax.f32(), targets.i32(),
        cols_of(logits), valid, col_begin);
  });
  LAUNCH_CHECK();
}

void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, int64_t valid,
                        int64_t col_begin, float grad_scale, cudaStream_t s) {
  dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
    using T = decltype(tag);
    xent_grad_kernel<T><<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, s>>>(
        losses.f32(), logits.data<T>(), rowmax.f32(), sumexp.f32(), target_logit.f32(),
        targets.i32(), cols_of(logits), valid, col_begin, grad_scale);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
