// cross_entropy.cu: vocab-parallel softmax cross-entropy in three passes, one block per row (row
// max, then the sum of exponentials and the target's logit, then the loss and the gradient written
// over the logits), so the row statistics can be all-reduced across tensor-parallel ranks between
// passes. The kernel bodies are in rowwise.cuh (16-byte loads; run on the host warp emulator by
// test_rowwise_emu); the CPU reference is backend/cpu/cross_entropy.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::cuda_ops {

namespace {

template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    xent_max_kernel(float* rowmax, const T* logits, int64_t V, int64_t valid) {
  __shared__ float sh[rowwise::kThreads / 32];
  rowwise::xent_max(rowmax, logits, V, valid, sh);
}
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    xent_sums_kernel(float* sumexp, float* target_logit, const T* logits, const float* rowmax,
                     const int32_t* targets, int64_t V, int64_t valid, int64_t col_begin) {
  __shared__ float sh[rowwise::kThreads / 32];
  rowwise::xent_sums(sumexp, target_logit, logits, rowmax, targets, V, valid, col_begin, sh);
}
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    xent_grad_kernel(float* losses, T* logits, const float* rowmax, const float* sumexp,
                     const float* target_logit, const int32_t* targets, int64_t V, int64_t valid,
                     int64_t col_begin, float scale) {
  rowwise::xent_loss_grad(losses, logits, rowmax, sumexp, target_logit, targets, V, valid,
                          col_begin, scale);
}

}  // namespace

void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid, cudaStream_t s) {
  if (rows_of(logits) == 0) return;
  dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
    using T = decltype(tag);
    xent_max_kernel<T><<<static_cast<unsigned>(rows_of(logits)), rowwise::kThreads, 0, s>>>(
        rowmax.f32(), logits.data<T>(), cols_of(logits), valid);
  });
  LAUNCH_CHECK();
}

void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits, const Tensor& rowmax,
                   const Tensor& targets, int64_t valid, int64_t col_begin, cudaStream_t s) {
  if (rows_of(logits) == 0) return;
  dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
    using T = decltype(tag);
    xent_sums_kernel<T><<<static_cast<unsigned>(rows_of(logits)), rowwise::kThreads, 0, s>>>(
        sumexp.f32(), target_logit.f32(), logits.data<T>(), rowmax.f32(), targets.i32(),
        cols_of(logits), valid, col_begin);
  });
  LAUNCH_CHECK();
}

void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, int64_t valid,
                        int64_t col_begin, float grad_scale, cudaStream_t s) {
  if (rows_of(logits) == 0) return;
  dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
    using T = decltype(tag);
    xent_grad_kernel<T><<<static_cast<unsigned>(rows_of(logits)), rowwise::kThreads, 0, s>>>(
        losses.f32(), logits.data<T>(), rowmax.f32(), sumexp.f32(), target_logit.f32(),
        targets.i32(), cols_of(logits), valid, col_begin, grad_scale);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
