// rmsnorm.cu: RMSNorm over the last axis (Llama's normalization, y = x * rstd * w with
// rstd = 1/sqrt(mean(x^2) + eps)), one block per row, with the residual add fused in front of it
// (add_rmsnorm_forward); the weight gradient is a column sum in two deterministic stages
// (common.cuh). The CPU reference is backend/cpu/rmsnorm.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

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

// The first stage of the weight gradient: part[chunk * C + c] = the sum of xhat * dy over the
// chunk's rows, in row order. Grid (column blocks, kRowChunks).
template <typename T>
__global__ void rmsnorm_weight_partials_kernel(float* part, const T* dout, const T* inp,
                                               const float* rstd, int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t chunk = (N + kRowChunks - 1) / kRowChunks;
  const int64_t r0 = blockIdx.y * chunk, r1 = r0 + chunk < N ? r0 + chunk : N;
  float sw = 0.f;
  for (int64_t r = r0; r < r1; ++r) sw += ld(inp[r * C + c]) * rstd[r] * ld(dout[r * C + c]);
  part[blockIdx.y * C + c] = sw;
}

}  // namespace

void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& w, float eps,
                     cudaStream_t s) {
  const int64_t N = rows_of(inp);
  if (N == 0) return;
  dispatch(inp.dtype(), "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_forward_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
        out.data<T>(), rstd.f32(), inp.data<T>(), w.data<T>(), cols_of(inp), eps);
  });
  LAUNCH_CHECK();
}

void add_rmsnorm_forward(Tensor& sum, Tensor& out, Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor& w, float eps, cudaStream_t s) {
  const int64_t N = rows_of(a);
  if (N == 0) return;
  dispatch(a.dtype(), "add+rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    add_rmsnorm_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
        sum.data<T>(), out.data<T>(), rstd.f32(), a.data<T>(), b.data<T>(), w.data<T>(), cols_of(a),
        eps);
  });
  LAUNCH_CHECK();
}

void rmsnorm_backward(Tensor& dinp, Tensor& dw, const Tensor& dout, const Tensor& inp,
                      const Tensor& w, const Tensor& rstd, Workspace& ws, cudaStream_t s) {
  const int64_t N = rows_of(inp), C = cols_of(inp);
  if (N == 0) return;
  dispatch(inp.dtype(), "rmsnorm backward", [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_backward_input_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
        dinp.data<T>(), dout.data<T>(), inp.data<T>(), w.data<T>(), rstd.f32(), C);
    LAUNCH_CHECK();
    float* part = ws.get<float>(Scratch::kPartials, kRowChunks * C);
    const dim3 grid(static_cast<unsigned>(blocks_for(C)), kRowChunks);
    rmsnorm_weight_partials_kernel<T>
        <<<grid, kThreads, 0, s>>>(part, dout.data<T>(), inp.data<T>(), rstd.f32(), N, C);
    LAUNCH_CHECK();
    sum_column_partials(dw.f32(), part, C, s);
  });
}

}  // namespace tessera::cuda_ops
