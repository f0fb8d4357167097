// optim.cu: AdamW (decoupled weight decay, PyTorch's update order) per tensor and over the whole
// flat parameter buffer, and the gradient-norm helpers: a deterministic sum of squares (fixed grid,
// fixed order) and an in-place scale. All operands are f32. The CPU reference is
// backend/cpu/optim.hpp.
#include <cmath>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

// ---- optimizer and norms ------------------------------------------------------------------------

// gs multiplies each gradient as it is read (gradient clipping's coefficient; AdamWHyper).
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float b1,
                             float b2, float eps, float step_size, float bc2_sqrt, float decay,
                             float gs) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gi = g[i] * gs;
  const float mi = b1 * m[i] + (1.f - b1) * gi;
  const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
}
struct DevAdamSegment {
  int64_t begin, end;
  float decay;  // 1 - lr * weight_decay
};
// AdamW over the whole flat buffer: each element finds its segment (binary search over the
// segment starts) for its weight decay. TC (bf16/f16; float: none) receives the updated
// parameter rounded as cast_kernel rounds it, when `compute` is not null.
template <typename TC>
__global__ void adamw_flat_kernel(float* p, const float* g, float* m, float* v, TC* compute,
                                  int64_t n, const DevAdamSegment* segs, int nseg, float b1,
                                  float b2, float eps, float step_size, float bc2_sqrt, float gs) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segs[mid].begin <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (i < segs[lo].begin || i >= segs[lo].end) return;  // not a parameter of any segment
  const float gi = g[i] * gs;
  const float mi = b1 * m[i] + (1.f - b1) * gi;
  const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  const float pi = p[i] * segs[lo].decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
  p[i] = pi;
  if (compute) compute[i] = to<TC>(pi);
}

// Fixed grid and fixed per-thread order: the same partial sums on every run. 1,024 blocks of
// 256 threads and 16-byte loads keep enough bytes in flight for HBM's bandwidth (with 256 blocks
// of scalar loads, the grad-norm phase took 0.9 ms over 124M's 0.5 GB of gradients on the H200,
// 2026-11-28).
constexpr int kSumBlocks = 1024;
// partial[block] (+)= the block's sum of squares; accumulate chains several tensors in a fixed
// order (deterministic). x 16-byte aligned: float4 loads, then the n % 4 tail element by element;
// else element by element throughout.
__global__ void sum_squares_kernel(double* partial, const float* x, int64_t n, bool accumulate) {
  __shared__ double sh[kThreads];
  double s = 0;
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t n4 = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? n / 4 : 0;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t i = t; i < n4; i += stride) {
    const float4 q = x4[i];
    s += static_cast<double>(q.x) * q.x;
    s += static_cast<double>(q.y) * q.y;
    s += static_cast<double>(q.z) * q.z;
    s += static_cast<double>(q.w) * q.w;
  }
  for (int64_t i = 4 * n4 + t; i < n; i += stride) s += static_cast<double>(x[i]) * x[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0;
    for (int k = 0; k < blockDim.x; ++k) t += sh[k];
    partial[blockIdx.x] = accumulate ? partial[blockIdx.x] + t : t;
  }
}
__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                double weight_decay, int64_t step, cudaStream_t s) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  adamw_kernel<<<blocks_for(param.numel()), kThreads, 0, s>>>(
      param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), (float)h.beta1, (float)h.beta2,
      (float)h.eps, (float)(h.lr / bc1), (float)std::sqrt(bc2), (float)(1.0 - h.lr * weight_decay),
      (float)h.grad_scale);
  LAUNCH_CHECK();
}

void adamw_step_flat(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                     const std::vector<AdamWSegment>& segments, const AdamWHyper& h, int64_t step,
                     Tensor* compute, Workspace& ws, cudaStream_t s) {
  if (segments.empty()) return;
  // The segment table changes only with the learning rate's decay factor: rebuilt on the host,
  // copied with the step (a few KB).
  std::vector<DevAdamSegment> table(segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    TESSERA_CHECK(i == 0 || segments[i].begin >= segments[i - 1].end,
                  "AdamW segments must be sorted and disjoint");
    table[i] = {segments[i].begin, segments[i].end,
                static_cast<float>(1.0 - h.lr * segments[i].weight_decay)};
  }
  const auto* segs = static_cast<const DevAdamSegment*>(
      ws.upload(Scratch::kAdamSegments, table.data(), sizeof(DevAdamSegment) * table.size(), s));
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  const int64_t n = segments.back().end;
  auto launch = [&](auto* c) {
    using TC = std::remove_pointer_t<decltype(c)>;
    adamw_flat_kernel<TC><<<blocks_for(n), kThreads, 0, s>>>(
        params.f32(), grads.f32(), m.f32(), v.f32(), c, n, segs, static_cast<int>(table.size()),
        (float)h.beta1, (float)h.beta2, (float)h.eps, (float)(h.lr / bc1), (float)std::sqrt(bc2),
        (float)h.grad_scale);
  };
  TESSERA_CHECK(!compute || compute->dtype() == DType::BF16 || compute->dtype() == DType::F16,
                "AdamW compute copy: bf16 or f16, not ", dtype_name(compute->dtype()));
  if (!compute)
    launch(static_cast<float*>(nullptr));
  else if (compute->dtype() == DType::BF16)
    launch(compute->data<__nv_bfloat16>());
  else
    launch(compute->data<__half>());
  LAUNCH_CHECK();
}

// The per-block partial sums, read back and added in a fixed order (one round trip).
static double sum_partials(const double* partials, cudaStream_t s) {
  double host[kSumBlocks];
  CUDA_CHECK(cudaMemcpyAsync(host, partials, sizeof host, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  double sum = 0;
  for (double p : host) sum += p;
  return sum;
}

double sum_squares_all(const std::vector<Tensor>& xs, Workspace& ws, cudaStream_t s) {
  if (xs.empty()) return 0.0;
  double* partials = ws.get<double>(Scratch::kSumSquares, kSumBlocks);
  bool first = true;
  for (const Tensor& x : xs) {
    sum_squares_kernel<<<kSumBlocks, kThreads, 0, s>>>(partials, x.f32(), x.numel(), !first);
    LAUNCH_CHECK();
    first = false;
  }
  return sum_partials(partials, s);
}

void collect_sum_squares(const Tensor& x, bool restart, Workspace& ws, cudaStream_t s) {
  double* partials = ws.get<double>(Scratch::kCollectedSquares, kSumBlocks);
  sum_squares_kernel<<<kSumBlocks, kThreads, 0, s>>>(partials, x.f32(), x.numel(), !restart);
  LAUNCH_CHECK();
}

double collected_sum_squares(Workspace& ws, cudaStream_t s) {
  const double* partials = ws.get<double>(Scratch::kCollectedSquares, kSumBlocks);
  return sum_partials(partials, s);
}

void scale(Tensor& x, float factor, cudaStream_t s) {
  scale_kernel<<<blocks_for(x.numel()), kThreads, 0, s>>>(x.f32(), x.numel(), factor);
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
