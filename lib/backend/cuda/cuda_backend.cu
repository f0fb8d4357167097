// cuda_backend.cu: fp32 CUDA kernels for every op of the Backend interface, plus cuBLAS GEMMs.
// Kernels favour determinism over speed where the two conflict: every reduction has one owner
// thread or a fixed order, so results do not change from run to run (exact resume needs this).
#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <vector>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device.hpp"

namespace tessera {

namespace {

constexpr int kThreads = 256;
inline int blocks_for(int64_t n) {
  return static_cast<int>((n + kThreads - 1) / kThreads);
}
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

int64_t rows_of(const Tensor& t) {
  return t.numel() / t.shape().back();
}
int64_t cols_of(const Tensor& t) {
  return t.shape().back();
}

void expect_device(const Tensor& t, const char* what) {
  TESSERA_CHECK(t.defined() && t.device() == Device::CUDA, what, " must be a CUDA tensor");
}

// ---- elementwise ----------------------------------------------------------------------------

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}
__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}
__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  out[i] = 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float du = 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
  dinp[i] = dout[i] * (0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * du);
}

// ---- embeddings -------------------------------------------------------------------------------

__global__ void embedding_forward_kernel(float* out, const int32_t* ids, const float* table,
                                         int64_t N, int64_t C, int64_t row_begin, int64_t rows) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t n = i / C, c = i % C;
  const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
  out[i] = (r >= 0 && r < rows) ? table[r * C + c] : 0.f;
}
// One thread per channel walks the tokens in order: each table entry has one writer
// (deterministic).
__global__ void embedding_backward_kernel(float* dtable, const float* dout, const int32_t* ids,
                                          int64_t N, int64_t C, int64_t row_begin, int64_t rows) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
    if (r >= 0 && r < rows) dtable[r * C + c] += dout[n * C + c];
  }
}
__global__ void position_forward_kernel(float* out, const float* wpe, int64_t B, int64_t T,
                                        int64_t C) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * T * C) return;
  out[i] += wpe[((i / C) % T) * C + i % C];
}
__global__ void position_backward_kernel(float* dwpe, const float* dout, int64_t B, int64_t T,
                                         int64_t C) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= T * C) return;
  float s = 0.f;
  for (int64_t b = 0; b < B; ++b) s += dout[b * T * C + i];
  dwpe[i] += s;
}

// ---- LayerNorm --------------------------------------------------------------------------------

// Block-wide sum in a fixed order (warp shuffles, then warp 0), the result in every thread.
__device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float t = 0.f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) t += shared[w];
    shared[32] = t;
  }
  __syncthreads();
  const float r = shared[32];
  __syncthreads();
  return r;
}
__device__ float block_max(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = -INFINITY;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) t = fmaxf(t, shared[w]);
    shared[32] = t;
  }
  __syncthreads();
  const float r = shared[32];
  __syncthreads();
  return r;
}

__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
                                         const float* w, const float* b, int64_t C, float eps) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) s += x[i];
  const float m = block_sum(s, sh) / C;
  float v = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) v += (x[i] - m) * (x[i] - m);
  const float r = rsqrtf(block_sum(v, sh) / C + eps);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x)
    out[n * C + i] = (x[i] - m) * r * w[i] + b[i];
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}
__global__ void layernorm_backward_input_kernel(float* dinp, const float* dout, const float* inp,
                                                const float* w, const float* mean,
                                                const float* rstd, int64_t C) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  const float m = mean[n], r = rstd[n];
  float a = 0.f, bsum = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float xhat = (inp[n * C + i] - m) * r, dn = w[i] * dout[n * C + i];
    a += dn;
    bsum += dn * xhat;
  }
  const float dmean = block_sum(a, sh) / C, dnm = block_sum(bsum, sh) / C;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float xhat = (inp[n * C + i] - m) * r, dn = w[i] * dout[n * C + i];
    dinp[n * C + i] += (dn - dmean - xhat * dnm) * r;
  }
}
__global__ void layernorm_backward_params_kernel(float* dw, float* db, const float* dout,
                                                 const float* inp, const float* mean,
                                                 const float* rstd, int64_t N, int64_t C) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= C) return;
  float sw = 0.f, sb = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    const float d = dout[n * C + i];
    sw += (inp[n * C + i] - mean[n]) * rstd[n] * d;
    sb += d;
  }
  dw[i] += sw;
  db[i] += sb;
}

// ---- matmul helpers -----------------------------------------------------------------------------

__global__ void fill_bias_kernel(float* out, const float* bias, int64_t N, int64_t OC) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < N * OC) out[i] = bias[i % OC];
}
__global__ void column_sum_kernel(float* dbias, const float* dout, int64_t N, int64_t OC) {
  const int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (o >= OC) return;
  float s = 0.f;
  for (int64_t n = 0; n < N; ++n) s += dout[n * OC + o];
  dbias[o] += s;
}

// ---- attention (one thread per query row; the T x T matrix is never stored) -------------------

__global__ void attention_forward_kernel(float* out, float* lse, const float* qkv, int64_t B,
                                         int64_t T, int64_t H, int64_t hd) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (b, h, t)
  if (i >= B * H * T) return;
  const int64_t t = i % T, h = (i / T) % H, b = i / (T * H);
  const int64_t C = H * hd, C3 = 3 * C;
  const float scale = rsqrtf(static_cast<float>(hd));
  const float* q = qkv + (b * T + t) * C3 + h * hd;
  float m = -INFINITY, l = 0.f;
  float* o = out + (b * T + t) * C + h * hd;
  for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
  for (int64_t s = 0; s <= t; ++s) {  // online softmax
    const float* k = qkv + (b * T + s) * C3 + C + h * hd;
    const float* v = k + C;
    float dot = 0.f;
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * k[d];
    dot *= scale;
    const float mn = fmaxf(m, dot), corr = expf(m - mn), p = expf(dot - mn);
    l = l * corr + p;
    for (int64_t d = 0; d < hd; ++d) o[d] = o[d] * corr + p * v[d];
    m = mn;
  }
  for (int64_t d = 0; d < hd; ++d) o[d] /= l;
  lse[(b * H + h) * T + t] = m + logf(l);
}
__global__ void attention_rowdot_kernel(float* D, const float* dout, const float* out, int64_t B,
                                        int64_t T, int64_t H, int64_t hd) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * H * T) return;
  const int64_t t = i % T, h = (i / T) % H, b = i / (T * H);
  const int64_t C = H * hd;
  float s = 0.f;
  for (int64_t d = 0; d < hd; ++d)
    s += dout[(b * T + t) * C + h * hd + d] * out[(b * T + t) * C + h * hd + d];
  D[i] = s;
}
// dq for query row t; dk, dv for key row s (= the same index): one writer per output row.
__global__ void attention_backward_kernel(float* dqkv, const float* dout, const float* qkv,
                                          const float* lse, const float* D, int64_t B, int64_t T,
                                          int64_t H, int64_t hd) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * H * T) return;
  const int64_t r = i % T, h = (i / T) % H, b = i / (T * H);
  const int64_t C = H * hd, C3 = 3 * C;
  const float scale = rsqrtf(static_cast<float>(hd));
  const float* L = lse + (b * H + h) * T;
  const float* Dr = D + (b * H + h) * T;
  auto q_at = [&](int64_t t) { return qkv + (b * T + t) * C3 + h * hd; };
  auto k_at = [&](int64_t s) { return qkv + (b * T + s) * C3 + C + h * hd; };
  auto v_at = [&](int64_t s) { return qkv + (b * T + s) * C3 + 2 * C + h * hd; };
  auto do_at = [&](int64_t t) { return dout + (b * T + t) * C + h * hd; };
  auto dS = [&](int64_t t, int64_t s, float& p) {
    float qk = 0.f, dp = 0.f;
    const float *q = q_at(t), *k = k_at(s), *v = v_at(s), *g = do_at(t);
    for (int64_t d = 0; d < hd; ++d) {
      qk += q[d] * k[d];
      dp += g[d] * v[d];
    }
    p = expf(qk * scale - L[t]);
    return p * (dp - Dr[t]);
  };
  float* dq = dqkv + (b * T + r) * C3 + h * hd;
  float* dk = dq + C;
  float* dv = dq + 2 * C;
  for (int64_t d = 0; d < hd; ++d) dq[d] = dk[d] = dv[d] = 0.f;
  for (int64_t s = 0; s <= r; ++s) {  // row r as a query
    float p;
    const float g = dS(r, s, p) * scale;
    const float* k = k_at(s);
    for (int64_t d = 0; d < hd; ++d) dq[d] += g * k[d];
  }
  for (int64_t t = r; t < T; ++t) {  // row r as a key / value
    float p;
    const float g = dS(t, r, p) * scale;
    const float *q = q_at(t), *go = do_at(t);
    for (int64_t d = 0; d < hd; ++d) {
      dk[d] += g * q[d];
      dv[d] += p * go[d];
    }
  }
}

struct DevSegment {
  int64_t slot, pos0, count, row0;
};
__global__ void kv_store_kernel(float* kc, float* vc, const float* qkv, const DevSegment* segs,
                                int nseg, int64_t H, int64_t hd, int64_t Tmax, int64_t rows) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (row, h, d)
  if (i >= rows * H * hd) return;
  const int64_t d = i % hd, h = (i / hd) % H, row = i / (H * hd);
  for (int k = 0; k < nseg; ++k) {
    const DevSegment s = segs[k];
    if (row < s.row0 || row >= s.row0 + s.count) continue;
    const int64_t pos = s.pos0 + row - s.row0, C = H * hd;
    kc[((s.slot * H + h) * Tmax + pos) * hd + d] = qkv[row * 3 * C + C + h * hd + d];
    vc[((s.slot * H + h) * Tmax + pos) * hd + d] = qkv[row * 3 * C + 2 * C + h * hd + d];
  }
}
__global__ void kv_attend_kernel(float* out, const float* qkv, const float* kc, const float* vc,
                                 const DevSegment* segs, int nseg, int64_t H, int64_t hd,
                                 int64_t Tmax, int64_t rows) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (row, h)
  if (i >= rows * H) return;
  const int64_t h = i % H, row = i / H, C = H * hd;
  for (int k = 0; k < nseg; ++k) {
    const DevSegment s = segs[k];
    if (row < s.row0 || row >= s.row0 + s.count) continue;
    const int64_t last = s.pos0 + row - s.row0;
    const float* q = qkv + row * 3 * C + h * hd;
    const float* K = kc + ((s.slot * H + h) * Tmax) * hd;
    const float* V = vc + ((s.slot * H + h) * Tmax) * hd;
    const float scale = rsqrtf(static_cast<float>(hd));
    float m = -INFINITY, l = 0.f;
    float* o = out + row * C + h * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
    for (int64_t j = 0; j <= last; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < hd; ++d) dot += q[d] * K[j * hd + d];
      dot *= scale;
      const float mn = fmaxf(m, dot), corr = expf(m - mn), p = expf(dot - mn);
      l = l * corr + p;
      for (int64_t d = 0; d < hd; ++d) o[d] = o[d] * corr + p * V[j * hd + d];
      m = mn;
    }
    for (int64_t d = 0; d < hd; ++d) o[d] /= l;
  }
}

// ---- cross-entropy (one block per row) --------------------------------------------------------

__global__ void xent_max_kernel(float* rowmax, const float* logits, int64_t V, int64_t valid) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, logits[n * V + j]);
  m = block_max(m, sh);
  if (threadIdx.x == 0) rowmax[n] = m;
}
__global__ void xent_sums_kernel(float* sumexp, float* target_logit, const float* logits,
                                 const float* rowmax, const int32_t* targets, int64_t V,
                                 int64_t valid, int64_t col_begin) {
  __shared__ float sh[33];
  const int64_t n = blockIdx.x;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x)
    s += expf(logits[n * V + j] - rowmax[n]);
  s = block_sum(s, sh);
  if (threadIdx.x == 0) {
    sumexp[n] = s;
    const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
    target_logit[n] = (targets[n] >= 0 && tj >= 0 && tj < valid) ? logits[n * V + tj] : 0.f;
  }
}
__global__ void xent_grad_kernel(float* losses, float* logits, const float* rowmax,
                                 const float* sumexp, const float* target_logit,
                                 const int32_t* targets, int64_t V, int64_t valid,
                                 int64_t col_begin, float scale) {
  const int64_t n = blockIdx.x;
  float* l = logits + n * V;
  const bool ignore = targets[n] < 0;
  const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
  const float inv = 1.f / sumexp[n];
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    float g = 0.f;
    if (!ignore && j < valid) g = expf(l[j] - rowmax[n]) * inv * scale - (j == tj ? scale : 0.f);
    l[j] = g;
  }
  if (threadIdx.x == 0) losses[n] = ignore ? 0.f : logf(sumexp[n]) + rowmax[n] - target_logit[n];
}

// ---- optimizer and norms ------------------------------------------------------------------------

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float b1,
                             float b2, float eps, float step_size, float bc2_sqrt, float decay) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gi = g[i];
  const float mi = b1 * m[i] + (1.f - b1) * gi;
  const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
}
constexpr int kSumBlocks = 256;
// Fixed grid and fixed per-thread order: the same partial sums on every run.
// partial[block] (+)= the block's sum of squares; accumulate chains several tensors in a fixed
// order (deterministic).
__global__ void sum_squares_kernel(double* partial, const float* x, int64_t n, bool accumulate) {
  __shared__ double sh[kThreads];
  double s = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    s += static_cast<double>(x[i]) * x[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0;
    for (int k = 0; k < blockDim.x; ++k) t += sh[k];
    partial[blockIdx.x] = accumulate ? partial[blockIdx.x] + t : t;
  }
}

// ---- RAII for the handles ---------------------------------------------------------------------

class CublasHandle {
 public:
  explicit CublasHandle(cudaStream_t s) {
    CUBLAS_CHECK(cublasCreate(&h_));
    CUBLAS_CHECK(cublasSetStream(h_, s));
  }
  ~CublasHandle() { cublasDestroy(h_); }
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    if (cuda::device_count() == 0)
      throw Error(
          "--device cuda: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)");
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    blas_ = std::make_unique<CublasHandle>(stream_);
    CUDA_CHECK(cudaMalloc(&partials_, sizeof(double) * kSumBlocks));
  }
  ~CudaBackend() override {  // reverse order of creation
    cudaFree(segs_);
    cudaFree(partials_);
    blas_.reset();
    cudaStreamDestroy(stream_);
  }
  Device device() const override { return Device::CUDA; }
  const char* name() const override { return "cuda"; }
  Allocator& allocator() override { return cuda::device_allocator(); }

  void zero(Tensor& t) override {
    expect_device(t, "zero");
    CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.nbytes(), stream_));
  }
  void copy_from_host(Tensor& dst, const void* src) override {
    expect_device(dst, "copy_from_host destination");
    // Pageable source: cudaMemcpyAsync stages it before returning, so src may be reused.
    CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src, dst.nbytes(), cudaMemcpyHostToDevice, stream_));
  }
  void copy_to_host(void* dst, const Tensor& src) override {
    expect_device(src, "copy_to_host source");
    CUDA_CHECK(cudaMemcpyAsync(dst, src.raw(), src.nbytes(), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void synchronize() override { CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  void* stream() override { return stream_; }
  void profiler_start() override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaProfilerStart());
  }
  void profiler_stop() override {
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaProfilerStop());
  }
  void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                         int64_t row_begin) override {
    const int64_t N = ids.numel(), C = cols_of(out);
    embedding_forward_kernel<<<blocks_for(N * C), kThreads, 0, stream_>>>(
        out.f32(), ids.i32(), table.f32(), N, C, row_begin, rows_of(table));
    LAUNCH_CHECK();
  }
  void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                          int64_t row_begin) override {
    const int64_t N = ids.numel(), C = cols_of(dout);
    embedding_backward_kernel<<<blocks_for(C), kThreads, 0, stream_>>>(
        dtable.f32(), dout.f32(), ids.i32(), N, C, row_begin, rows_of(dtable));
    LAUNCH_CHECK();
  }
  void position_embedding_forward(Tensor& out, const Tensor& wpe) override {
    position_forward_kernel<<<blocks_for(out.numel()), kThreads, 0, stream_>>>(
        out.f32(), wpe.f32(), out.dim(0), out.dim(1), out.dim(2));
    LAUNCH_CHECK();
  }
  void position_embedding_backward(Tensor& dwpe, const Tensor& dout) override {
    position_backward_kernel<<<blocks_for(dout.dim(1) * dout.dim(2)), kThreads, 0, stream_>>>(
        dwpe.f32(), dout.f32(), dout.dim(0), dout.dim(1), dout.dim(2));
    LAUNCH_CHECK();
  }
  void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                         const Tensor& w, const Tensor& b, double eps) override {
    layernorm_forward_kernel<<<static_cast<unsigned>(rows_of(inp)), kThreads, 0, stream_>>>(
        out.f32(), mean.f32(), rstd.f32(), inp.f32(), w.f32(), b.f32(), cols_of(inp),
        static_cast<float>(eps));
    LAUNCH_CHECK();
  }
  void layernorm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout,
                          const Tensor& inp, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    layernorm_backward_input_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
        dinp.f32(), dout.f32(), inp.f32(), w.f32(), mean.f32(), rstd.f32(), C);
    LAUNCH_CHECK();
    layernorm_backward_params_kernel<<<blocks_for(C), kThreads, 0, stream_>>>(
        dw.f32(), db.f32(), dout.f32(), inp.f32(), mean.f32(), rstd.f32(), N, C);
    LAUNCH_CHECK();
  }
  void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                      const Tensor* bias) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    TESSERA_CHECK(cols_of(weight) == IC && out.numel() == N * OC, "matmul shapes");
    if (bias) {
      fill_bias_kernel<<<blocks_for(N * OC), kThreads, 0, stream_>>>(out.f32(), bias->f32(), N, OC);
      LAUNCH_CHECK();
    }
    const float one = 1.f, beta = bias ? 1.f : 0.f;
    // Row-major out (N,OC) = inp (N,IC) * W^T is column-major out^T = W^T(col) ... see docs.
    CUBLAS_CHECK(cublasSgemm(blas_->get(), CUBLAS_OP_T, CUBLAS_OP_N, (int)OC, (int)N, (int)IC, &one,
                             weight.f32(), (int)IC, inp.f32(), (int)IC, &beta, out.f32(), (int)OC));
  }
  void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    const float one = 1.f, zero = 0.f;
    if (dinp)
      CUBLAS_CHECK(cublasSgemm(blas_->get(), CUBLAS_OP_N, CUBLAS_OP_N, (int)IC, (int)N, (int)OC,
                               &one, weight.f32(), (int)IC, dout.f32(), (int)OC, &zero, dinp->f32(),
                               (int)IC));
    CUBLAS_CHECK(cublasSgemm(blas_->get(), CUBLAS_OP_N, CUBLAS_OP_T, (int)IC, (int)OC, (int)N, &one,
                             inp.f32(), (int)IC, dout.f32(), (int)OC, &one, dweight.f32(),
                             (int)IC));
    if (dbias) {
      column_sum_kernel<<<blocks_for(OC), kThreads, 0, stream_>>>(dbias->f32(), dout.f32(), N, OC);
      LAUNCH_CHECK();
    }
  }
  void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads) override {
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (3 * heads);
    attention_forward_kernel<<<blocks_for(B * heads * T), kThreads, 0, stream_>>>(
        out.f32(), lse.f32(), qkv.f32(), B, T, heads, hd);
    LAUNCH_CHECK();
  }
  void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int64_t heads) override {
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (3 * heads);
    if (rowdot_.numel() < B * heads * T) rowdot_ = Tensor({B * heads * T}, DType::F32, allocator());
    attention_rowdot_kernel<<<blocks_for(B * heads * T), kThreads, 0, stream_>>>(
        rowdot_.f32(), dout.f32(), out.f32(), B, T, heads, hd);
    LAUNCH_CHECK();
    attention_backward_kernel<<<blocks_for(B * heads * T), kThreads, 0, stream_>>>(
        dqkv.f32(), dout.f32(), qkv.f32(), lse.f32(), rowdot_.f32(), B, T, heads, hd);
    LAUNCH_CHECK();
  }
  void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                    const std::vector<KvSegment>& segments, int64_t heads) override {
    const int64_t hd = k_cache.dim(3), Tmax = k_cache.dim(2), rows = rows_of(qkv);
    std::vector<DevSegment> h(segments.size());
    for (size_t i = 0; i < segments.size(); ++i)
      h[i] = {segments[i].slot, segments[i].pos0, segments[i].count, segments[i].row0};
    if (h.size() > seg_capacity_) {
      cudaFree(segs_);
      CUDA_CHECK(cudaMalloc(&segs_, sizeof(DevSegment) * h.size()));
      seg_capacity_ = h.size();
    }
    CUDA_CHECK(cudaMemcpyAsync(segs_, h.data(), sizeof(DevSegment) * h.size(),
                               cudaMemcpyHostToDevice, stream_));
    const int n = static_cast<int>(h.size());
    kv_store_kernel<<<blocks_for(rows * heads * hd), kThreads, 0, stream_>>>(
        k_cache.f32(), v_cache.f32(), qkv.f32(), segs_, n, heads, hd, Tmax, rows);
    LAUNCH_CHECK();
    kv_attend_kernel<<<blocks_for(rows * heads), kThreads, 0, stream_>>>(
        out.f32(), qkv.f32(), k_cache.f32(), v_cache.f32(), segs_, n, heads, hd, Tmax, rows);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // h is released when this returns
  }
  void gelu_forward(Tensor& out, const Tensor& inp) override {
    gelu_forward_kernel<<<blocks_for(inp.numel()), kThreads, 0, stream_>>>(out.f32(), inp.f32(),
                                                                           inp.numel());
    LAUNCH_CHECK();
  }
  void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    gelu_backward_kernel<<<blocks_for(inp.numel()), kThreads, 0, stream_>>>(
        dinp.f32(), inp.f32(), dout.f32(), inp.numel());
    LAUNCH_CHECK();
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override {
    add_kernel<<<blocks_for(a.numel()), kThreads, 0, stream_>>>(out.f32(), a.f32(), b.f32(),
                                                                a.numel());
    LAUNCH_CHECK();
  }
  void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid) override {
    xent_max_kernel<<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, stream_>>>(
        rowmax.f32(), logits.f32(), cols_of(logits), valid);
    LAUNCH_CHECK();
  }
  void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits,
                     const Tensor& rowmax, const Tensor& targets, int64_t valid,
                     int64_t col_begin) override {
    xent_sums_kernel<<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, stream_>>>(
        sumexp.f32(), target_logit.f32(), logits.f32(), rowmax.f32(), targets.i32(),
        cols_of(logits), valid, col_begin);
    LAUNCH_CHECK();
  }
  void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax,
                          const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets,
                          int64_t valid, int64_t col_begin, float grad_scale) override {
    xent_grad_kernel<<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, stream_>>>(
        losses.f32(), logits.f32(), rowmax.f32(), sumexp.f32(), target_logit.f32(), targets.i32(),
        cols_of(logits), valid, col_begin, grad_scale);
    LAUNCH_CHECK();
  }
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                  double weight_decay, int64_t step) override {
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
    adamw_kernel<<<blocks_for(param.numel()), kThreads, 0, stream_>>>(
        param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), (float)h.beta1, (float)h.beta2,
        (float)h.eps, (float)(h.lr / bc1), (float)std::sqrt(bc2),
        (float)(1.0 - h.lr * weight_decay));
    LAUNCH_CHECK();
  }
  double sum_squares(const Tensor& x) override { return sum_squares_all({x}); }
  double sum_squares_all(const std::vector<Tensor>& xs) override {
    bool first = true;
    for (const Tensor& x : xs) {
      expect_device(x, "sum_squares input");
      sum_squares_kernel<<<kSumBlocks, kThreads, 0, stream_>>>(partials_, x.f32(), x.numel(),
                                                               !first);
      LAUNCH_CHECK();
      first = false;
    }
    if (first) return 0.0;
    double host[kSumBlocks];
    CUDA_CHECK(cudaMemcpyAsync(host, partials_, sizeof host, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    double s = 0;
    for (double p : host) s += p;
    return s;
  }
  void scale(Tensor& x, float s) override {
    scale_kernel<<<blocks_for(x.numel()), kThreads, 0, stream_>>>(x.f32(), x.numel(), s);
    LAUNCH_CHECK();
  }

 private:
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CublasHandle> blas_;
  double* partials_ = nullptr;
  DevSegment* segs_ = nullptr;
  size_t seg_capacity_ = 0;
  Tensor rowdot_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  return std::make_unique<CudaBackend>();
}

}  // namespace tessera
