// layernorm.cu: LayerNorm over the last axis, one warp per row with 16-byte loads (rowwise.cuh)
// where the row length allows (the row held in registers when there are few rows: decode), else one
// block per row, with the residual add fused in front of it (add_layernorm_forward); the weight and
// bias gradients are column sums in two deterministic stages (rowwise.cuh). The CPU reference is
// backend/cpu/layernorm.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::cuda_ops {

namespace {

template <typename T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* w,
                                         const T* b, int64_t C, float eps) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  const T* x = inp + n * C;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) s += ld(x[i]);
  const float m = block_sum(s, sh) / C;
  float v = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) v += (ld(x[i]) - m) * (ld(x[i]) - m);
  const float r = rsqrtf(block_sum(v, sh) / C + eps);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    out[n * C + i] = to<T>((ld(x[i]) - m) * r * ld(w[i]) + ld(b[i]));
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}
template <typename T>
__global__ void layernorm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* w,
                                                const float* mean, const float* rstd, int64_t C) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  const float m = mean[n], r = rstd[n];
  float a = 0.f, bsum = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float xhat = (ld(inp[n * C + i]) - m) * r, dn = ld(w[i]) * ld(dout[n * C + i]);
    a += dn;
    bsum += dn * xhat;
  }
  const float dmean = block_sum(a, sh) / C, dnm = block_sum(bsum, sh) / C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float xhat = (ld(inp[n * C + i]) - m) * r, dn = ld(w[i]) * ld(dout[n * C + i]);
    dinp[n * C + i] = to<T>(ld(dinp[n * C + i]) + (dn - dmean - xhat * dnm) * r);
  }
}

// Residual add and LayerNorm in one pass over the row: sum = a + b, out = LN(sum).
template <typename T>
__global__ void add_layernorm_kernel(T* sum, T* out, float* mean, float* rstd, const T* a,
                                     const T* b, const T* w, const T* bias, int64_t C, float eps) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const T x = to<T>(ld(a[n * C + i]) + ld(b[n * C + i]));  // rounded as stored
    sum[n * C + i] = x;
    s += ld(x);
  }
  const float m = block_sum(s, sh) / C;
  float v = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float d = ld(sum[n * C + i]) - m;
    v += d * d;
  }
  const float r = rsqrtf(block_sum(v, sh) / C + eps);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    out[n * C + i] = to<T>((ld(sum[n * C + i]) - m) * r * ld(w[i]) + ld(bias[i]));
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

// The first stage of the weight and bias gradients: per (column, chunk of rows) partials of
// xhat * dy and dy (rowwise.cuh).
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    layernorm_param_partials_kernel(float* part, const T* dout, const T* inp, const float* mean,
                                    const float* rstd, int64_t N, int64_t C) {
  rowwise::column_partials<2>(part, N, C, [&](int64_t r, int64_t c, float* acc) {
    const float d = ld(dout[r * C + c]);
    acc[0] += (ld(inp[r * C + c]) - mean[r]) * rstd[r] * d;
    acc[1] += d;
  });
}

// One warp per row, 16-byte loads (rowwise.cuh), where C and the pointers allow.
// kPacks > 0: the row held in registers (few rows; rowwise::norm_held_ok).
template <typename T, int kPacks>
__global__ void __launch_bounds__(rowwise::kThreads)
    layernorm_forward_warp_kernel(T* out, float* mean, float* rstd, T* sum, const T* a, const T* b,
                                  const T* w, const T* bias, int64_t N, int64_t C, float eps) {
  rowwise::norm_forward<T, false, kPacks>(out, mean, rstd, sum, a, b, w, bias, N, C, eps);
}
// The warp kernel for N rows of C: the row held in registers when there are few rows.
template <typename T>
void launch_layernorm_warp(T* out, float* mean, float* rstd, T* sum, const T* a, const T* b,
                           const T* w, const T* bias, int64_t N, int64_t C, float eps,
                           cudaStream_t s) {
  if (rowwise::norm_held_ok<T>(N, C))
    layernorm_forward_warp_kernel<T, rowwise::kNormHeldPacks>
        <<<rowwise::warp_blocks(N), rowwise::kThreads, 0, s>>>(out, mean, rstd, sum, a, b, w, bias,
                                                               N, C, eps);
  else
    layernorm_forward_warp_kernel<T, 0><<<rowwise::warp_blocks(N), rowwise::kThreads, 0, s>>>(
        out, mean, rstd, sum, a, b, w, bias, N, C, eps);
}
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    layernorm_backward_warp_kernel(T* dinp, const T* dout, const T* inp, const T* w,
                                   const float* mean, const float* rstd, int64_t N, int64_t C) {
  rowwise::norm_backward_input<T, false>(dinp, dout, inp, w, mean, rstd, N, C);
}

}  // namespace

void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& w,
                       const Tensor& b, float eps, cudaStream_t s) {
  dispatch(inp.dtype(), "layernorm", [&](auto tag) {
    using T = decltype(tag);
    const int64_t N = rows_of(inp), C = cols_of(inp);
    if (N == 0) return;
    if (rowwise::norm_vec_ok<T>(C, {out.raw(), inp.raw(), w.raw(), b.raw()}))
      launch_layernorm_warp<T>(out.data<T>(), mean.f32(), rstd.f32(), nullptr, inp.data<T>(),
                               nullptr, w.data<T>(), b.data<T>(), N, C, eps, s);
    else
      layernorm_forward_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
          out.data<T>(), mean.f32(), rstd.f32(), inp.data<T>(), w.data<T>(), b.data<T>(), C, eps);
  });
  LAUNCH_CHECK();
}

void layernorm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout, const Tensor& inp,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, Workspace& ws,
                        cudaStream_t s) {
  const int64_t N = rows_of(inp), C = cols_of(inp);
  if (N == 0) return;
  dispatch(inp.dtype(), "layernorm backward", [&](auto tag) {
    using T = decltype(tag);
    if (rowwise::norm_vec_ok<T>(C, {dinp.raw(), dout.raw(), inp.raw(), w.raw()}))
      layernorm_backward_warp_kernel<T><<<rowwise::warp_blocks(N), rowwise::kThreads, 0, s>>>(
          dinp.data<T>(), dout.data<T>(), inp.data<T>(), w.data<T>(), mean.f32(), rstd.f32(), N, C);
    else
      layernorm_backward_input_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
          dinp.data<T>(), dout.data<T>(), inp.data<T>(), w.data<T>(), mean.f32(), rstd.f32(), C);
    LAUNCH_CHECK();
    const int64_t R = rowwise::num_chunks(N);
    float* part = ws.get<float>(Scratch::kPartials, 2 * R * C);
    const dim3 grid(static_cast<unsigned>((C + rowwise::kThreads - 1) / rowwise::kThreads),
                    static_cast<unsigned>(R));
    layernorm_param_partials_kernel<T><<<grid, rowwise::kThreads, 0, s>>>(
        part, dout.data<T>(), inp.data<T>(), mean.f32(), rstd.f32(), N, C);
    LAUNCH_CHECK();
    sum_column_partials(dw.f32(), part, R, C, s);
    sum_column_partials(db.f32(), part + R * C, R, C, s);
  });
}

void add_layernorm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                           const Tensor& b, const Tensor& w, const Tensor& bias, float eps,
                           cudaStream_t s) {
  dispatch(a.dtype(), "add+layernorm", [&](auto tag) {
    using T = decltype(tag);
    const int64_t N = rows_of(a), C = cols_of(a);
    if (N == 0) return;
    if (rowwise::norm_vec_ok<T>(C, {sum.raw(), out.raw(), a.raw(), b.raw(), w.raw(), bias.raw()}))
      launch_layernorm_warp<T>(out.data<T>(), mean.f32(), rstd.f32(), sum.data<T>(), a.data<T>(),
                               b.data<T>(), w.data<T>(), bias.data<T>(), N, C, eps, s);
    else
      add_layernorm_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
          sum.data<T>(), out.data<T>(), mean.f32(), rstd.f32(), a.data<T>(), b.data<T>(),
          w.data<T>(), bias.data<T>(), C, eps);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
