// rmsnorm.cu: RMSNorm over the last axis (Llama's normalization, y = x * rstd * w with
// rstd = 1/sqrt(mean(x^2) + eps)), one warp per row with 16-byte loads
// (rowwise.cuh) where the row length allows, else one block per row, with the residual add fused in
// front of it (add_rmsnorm_forward); the weight gradient is a column sum in two deterministic
// stages (rowwise.cuh). The CPU reference is backend/cpu/rmsnorm.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::cuda_ops {

namespace {

// inp, out (N,C); rstd (N) f32; w (C). Grid N blocks of kThreads.
template <typename T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* inp, const T* w, int64_t C,
                                       float eps) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  const T* x = inp + n * C;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float v = ld(x[i]);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss, sh) / C + eps);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    out[n * C + i] = to<T>(ld(x[i]) * r * ld(w[i]));
  if (threadIdx.x == 0) rstd[n] = r;
}

// Residual add and RMSNorm in one pass over the row: sum = a + b, out = RMSNorm(sum). Each thread
// reads back only the elements of `sum` it wrote itself.
template <typename T>
__global__ void add_rmsnorm_kernel(T* sum, T* out, float* rstd, const T* a, const T* b, const T* w,
                                   int64_t C, float eps) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const T x = to<T>(ld(a[n * C + i]) + ld(b[n * C + i]));  // rounded as stored
    sum[n * C + i] = x;
    ss += ld(x) * ld(x);
  }
  const float r = rsqrtf(block_sum(ss, sh) / C + eps);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    out[n * C + i] = to<T>(ld(sum[n * C + i]) * r * ld(w[i]));
  if (threadIdx.x == 0) rstd[n] = r;
}

// dinp (N,C) += rstd * (w o dy - xhat * mean(w o dy o xhat)), xhat = x * rstd. One block per row.
template <typename T>
__global__ void rmsnorm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* w,
                                              const float* rstd, int64_t C) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  const float r = rstd[n];
  float dot = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    dot += ld(w[i]) * ld(dout[n * C + i]) * ld(inp[n * C + i]) * r;
  const float m = block_sum(dot, sh) / C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float xhat = ld(inp[n * C + i]) * r, dn = ld(w[i]) * ld(dout[n * C + i]);
    dinp[n * C + i] = to<T>(ld(dinp[n * C + i]) + (dn - xhat * m) * r);
  }
}

// The first stage of the weight gradient: per (column, chunk of rows) partials of xhat * dy, in
// row order (rowwise.cuh).
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    rmsnorm_weight_partials_kernel(float* part, const T* dout, const T* inp, const float* rstd,
                                   int64_t N, int64_t C) {
  rowwise::column_partials<1>(part, N, C, [&](int64_t r, int64_t c, float* acc) {
    acc[0] += ld(inp[r * C + c]) * rstd[r] * ld(dout[r * C + c]);
  });
}

// One warp per row, 16-byte loads (rowwise.cuh), where C and the pointers allow.
// kPacks > 0: the row held in registers (few rows; rowwise::norm_held_ok).
template <typename T, int kPacks>
__global__ void __launch_bounds__(rowwise::kThreads)
    rmsnorm_forward_warp_kernel(T* out, float* rstd, T* sum, const T* a, const T* b, const T* w,
                                int64_t N, int64_t C, float eps) {
  rowwise::norm_forward<T, true, kPacks>(out, nullptr, rstd, sum, a, b, w, nullptr, N, C, eps);
}
// The warp kernel for N rows of C: the row held in registers when there are few rows.
template <typename T>
void launch_rmsnorm_warp(T* out, float* rstd, T* sum, const T* a, const T* b, const T* w, int64_t N,
                         int64_t C, float eps, cudaStream_t s) {
  if (rowwise::norm_held_ok<T>(N, C))
    rmsnorm_forward_warp_kernel<T, rowwise::kNormHeldPacks>
        <<<rowwise::warp_blocks(N), rowwise::kThreads, 0, s>>>(out, rstd, sum, a, b, w, N, C, eps);
  else
    rmsnorm_forward_warp_kernel<T, 0>
        <<<rowwise::warp_blocks(N), rowwise::kThreads, 0, s>>>(out, rstd, sum, a, b, w, N, C, eps);
}
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    rmsnorm_backward_warp_kernel(T* dinp, const T* dout, const T* inp, const T* w,
                                 const float* rstd, int64_t N, int64_t C) {
  rowwise::norm_backward_input<T, true>(dinp, dout, inp, w, nullptr, rstd, N, C);
}

}  // namespace

void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& w, float eps,
                     cudaStream_t s) {
  const int64_t N = rows_of(inp);
  if (N == 0) return;
  dispatch(inp.dtype(), "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    const int64_t C = cols_of(inp);
    if (rowwise::norm_vec_ok<T>(C, {out.raw(), inp.raw(), w.raw()}))
      launch_rmsnorm_warp<T>(out.data<T>(), rstd.f32(), nullptr, inp.data<T>(), nullptr,
                             w.data<T>(), N, C, eps, s);
    else
      rmsnorm_forward_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
          out.data<T>(), rstd.f32(), inp.data<T>(), w.data<T>(), C, eps);
  });
  LAUNCH_CHECK();
}

void add_rmsnorm_forward(Tensor& sum, Tensor& out, Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor& w, float eps, cudaStream_t s) {
  const int64_t N = rows_of(a);
  if (N == 0) return;
  dispatch(a.dtype(), "add+rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    const int64_t C = cols_of(a);
    if (rowwise::norm_vec_ok<T>(C, {sum.raw(), out.raw(), a.raw(), b.raw(), w.raw()}))
      launch_rmsnorm_warp<T>(out.data<T>(), rstd.f32(), sum.data<T>(), a.data<T>(), b.data<T>(),
                             w.data<T>(), N, C, eps, s);
    else
      add_rmsnorm_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
          sum.data<T>(), out.data<T>(), rstd.f32(), a.data<T>(), b.data<T>(), w.data<T>(), C, eps);
  });
  LAUNCH_CHECK();
}

void rmsnorm_backward(Tensor& dinp, Tensor& dw, const Tensor& dout, const Tensor& inp,
                      const Tensor& w, const Tensor& rstd, Workspace& ws, cudaStream_t s) {
  const int64_t N = rows_of(inp), C = cols_of(inp);
  if (N == 0) return;
  dispatch(inp.dtype(), "rmsnorm backward", [&](auto tag) {
    using T = decltype(tag);
    if (rowwise::norm_vec_ok<T>(C, {dinp.raw(), dout.raw(), inp.raw(), w.raw()}))
      rmsnorm_backward_warp_kernel<T><<<rowwise::warp_blocks(N), rowwise::kThreads, 0, s>>>(
          dinp.data<T>(), dout.data<T>(), inp.data<T>(), w.data<T>(), rstd.f32(), N, C);
    else
      rmsnorm_backward_input_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
          dinp.data<T>(), dout.data<T>(), inp.data<T>(), w.data<T>(), rstd.f32(), C);
    LAUNCH_CHECK();
    const int64_t R = rowwise::num_chunks(N);
    float* part = ws.get<float>(Scratch::kPartials, R * C);
    const dim3 grid(static_cast<unsigned>((C + rowwise::kThreads - 1) / rowwise::kThreads),
                    static_cast<unsigned>(R));
    rmsnorm_weight_partials_kernel<T>
        <<<grid, rowwise::kThreads, 0, s>>>(part, dout.data<T>(), inp.data<T>(), rstd.f32(), N, C);
    LAUNCH_CHECK();
    sum_column_partials(dw.f32(), part, R, C, s);
  });
}

}  // namespace tessera::cuda_ops
