// layernorm.cu: LayerNorm over the last axis, one block per row, with the residual add fused in
// front of it (add_layernorm_forward); the weight and bias gradients are column sums in two
// deterministic stages (common.cuh). The CPU reference is backend/cpu/layernorm.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

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

// The first stage of the weight and bias gradients: per (column, chunk of rows) partials.
template <typename T>
__global__ void layernorm_param_partials_kernel(float* part_w, float* part_b, const T* dout,
                                                const T* inp, const float* mean, const float* rstd,
                                                int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t chunk = (N + kRowChunks - 1) / kRowChunks;
  const int64_t r0 = blockIdx.y * chunk, r1 = r0 + chunk < N ? r0 + chunk : N;
  float sw = 0.f, sb = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = ld(dout[r * C + c]);
    sw += (ld(inp[r * C + c]) - mean[r]) * rstd[r] * d;
    sb += d;
  }
  part_w[blockIdx.y * C + c] = sw;
  part_b[blockIdx.y * C + c] = sb;
}

}  // namespace

void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& w,
                       const Tensor& b, float eps, cudaStream_t s) {
  dispatch(inp.dtype(), "layernorm", [&](auto tag) {
    using T = decltype(tag);
    layernorm_forward_kernel<T><<<static_cast<unsigned>(rows_of(inp)), kThreads, 0, s>>>(
        out.data<T>(), mean.f32(), rstd.f32(), inp.data<T>(), w.data<T>(), b.data<T>(),
        cols_of(inp), eps);
  });
  LAUNCH_CHECK();
}

void layernorm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout, const Tensor& inp,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, Workspace& ws,
                        cudaStream_t s) {
  const int64_t N = rows_of(inp), C = cols_of(inp);
  dispatch(inp.dtype(), "layernorm backward", [&](auto tag) {
    using T = decltype(tag);
    layernorm_backward_input_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
        dinp.data<T>(), dout.data<T>(), inp.data<T>(), w.data<T>(), mean.f32(), rstd.f32(), C);
    LAUNCH_CHECK();
    float* part = ws.get<float>(Scratch::kPartials, 2 * kRowChunks * C);
    const dim3 grid(static_cast<unsigned>(blocks_for(C)), kRowChunks);
    layernorm_param_partials_kernel<T><<<grid, kThreads, 0, s>>>(
        part, part + kRowChunks * C, dout.data<T>(), inp.data<T>(), mean.f32(), rstd.f32(), N, C);
    LAUNCH_CHECK();
    sum_column_partials(dw.f32(), part, C, s);
    sum_column_partials(db.f32(), part + kRowChunks * C, C, s);
  });
}

void add_layernorm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                           const Tensor& b, const Tensor& w, const Tensor& bias, float eps,
                           cudaStream_t s) {
  dispatch(a.dtype(), "add+layernorm", [&](auto tag) {
    using T = decltype(tag);
    add_layernorm_kernel<T><<<static_cast<unsigned>(rows_of(a)), kThreads, 0, s>>>(
        sum.data<T>(), out.data<T>(), mean.f32(), rstd.f32(), a.data<T>(), b.data<T>(), w.data<T>(),
        bias.data<T>(), cols_of(a), eps);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
