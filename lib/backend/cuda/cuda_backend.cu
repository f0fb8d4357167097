// cuda_backend.cu: CUDA kernels for every op of the Backend interface, plus cuBLAS GEMMs.
// Activations and compute weights are f32, bf16 or f16 (kernels are templates over the storage
// type T and compute in f32); gradients of parameters, statistics and optimizer state are f32
// (backend.hpp). Kernels favour determinism over speed where the two conflict: every reduction
// has one owner thread or a fixed order, so results do not change from run to run (exact resume
// needs this).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstring>
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

// f32 loads and rounded stores for every storage type.
__device__ __forceinline__ float ld(float x) {
  return x;
}
__device__ __forceinline__ float ld(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float ld(__half x) {
  return __half2float(x);
}
template <typename T>
__device__ __forceinline__ T to(float v);
template <>
__device__ __forceinline__ float to<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 to<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half to<__half>(float v) {
  return __float2half_rn(v);
}

// Calls f(T{}) with T the storage type of `d` (float, __nv_bfloat16 or __half).
template <typename F>
void dispatch(DType d, const char* what, F&& f) {
  switch (d) {
    case DType::F32:
      f(float{});
      return;
    case DType::BF16:
      f(__nv_bfloat16{});
      return;
    case DType::F16:
      f(__half{});
      return;
    default:
      throw Error(std::string(what) + ": the CUDA backend computes in f32, bf16 or f16, not " +
                  dtype_name(d));
  }
}
void expect_dtype(const Tensor& t, DType d, const char* what) {
  TESSERA_CHECK(t.dtype() == d, what, " is ", dtype_name(t.dtype()), ", expected ", dtype_name(d));
}
cudaDataType_t cuda_type(DType d) {
  return d == DType::F32 ? CUDA_R_32F : d == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

// ---- elementwise ----------------------------------------------------------------------------

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
__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}
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

// ---- embeddings -------------------------------------------------------------------------------

template <typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* ids, const T* table, int64_t N,
                                         int64_t C, int64_t row_begin, int64_t rows) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t n = i / C, c = i % C;
  const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
  out[i] = (r >= 0 && r < rows) ? table[r * C + c] : to<T>(0.f);
}
// One thread per channel walks the tokens in order: each table entry has one writer
// (deterministic).
template <typename T>
__global__ void embedding_backward_kernel(float* dtable, const T* dout, const int32_t* ids,
                                          int64_t N, int64_t C, int64_t row_begin, int64_t rows) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
    if (r >= 0 && r < rows) dtable[r * C + c] += ld(dout[n * C + c]);
  }
}
template <typename S>
__global__ void position_forward_kernel(S* out, const S* wpe, int64_t B, int64_t T, int64_t C) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * T * C) return;
  out[i] = to<S>(ld(out[i]) + ld(wpe[((i / C) % T) * C + i % C]));
}
template <typename S>
__global__ void position_backward_kernel(float* dwpe, const S* dout, int64_t B, int64_t T,
                                         int64_t C) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= T * C) return;
  float s = 0.f;
  for (int64_t b = 0; b < B; ++b) s += ld(dout[b * T * C + i]);
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
// ---- matmul helpers -----------------------------------------------------------------------------

template <typename T>
__global__ void fill_bias_kernel(T* out, const T* bias, int64_t N, int64_t OC) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < N * OC) out[i] = bias[i % OC];
}
// ---- attention
// ------------------------------------------------------------------------------------ Tiled causal
// attention in the manner of FlashAttention (Dao et al.): the T x T matrix is never stored. One
// thread owns one query row (forward, dq) or one key row (dk, dv) and keeps it in registers; the
// other side streams through shared memory in tiles of kTile rows, with an online softmax. Head
// dimensions 32, 64 and 128 are compiled; others take the one-thread-per-row kernels below, which
// read the tiles straight from global memory.

constexpr int kRows = 64;  // query (or key) rows per block
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}
constexpr int kTile = 32;  // rows of the streamed side per shared-memory tile

// Keys and values of rows [k0, k0 + kTile) of head h into shared memory, zeros past the end.
template <typename T, int HD>
__device__ void load_kv_tile(float (*Ks)[HD], float (*Vs)[HD], const T* qkv, int64_t b, int64_t h,
                             int64_t k0, int64_t Tn, int64_t C) {
  for (int i = threadIdx.x; i < kTile * HD; i += blockDim.x) {
    const int r = i / HD, d = i % HD;
    const int64_t s = k0 + r;
    const bool in = s < Tn;
    Ks[r][d] = in ? ld(qkv[(b * Tn + s) * 3 * C + C + h * HD + d]) : 0.f;
    Vs[r][d] = in ? ld(qkv[(b * Tn + s) * 3 * C + 2 * C + h * HD + d]) : 0.f;
  }
}

template <typename T, int HD>
__global__ void __launch_bounds__(kRows)
    flash_forward_kernel(T* out, float* lse, const T* qkv, int64_t Tn, int64_t H) {
  __shared__ float Ks[kTile][HD], Vs[kTile][HD];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H, C = H * HD, C3 = 3 * C;
  const int64_t t = int64_t(blockIdx.x) * kRows + threadIdx.x;
  const bool active = t < Tn;
  const float scale = rsqrtf(static_cast<float>(HD));
  float q[HD], o[HD];
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    q[d] = active ? ld(qkv[(b * Tn + t) * C3 + h * HD + d]) * scale : 0.f;
    o[d] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int64_t last = imin(Tn - 1, int64_t(blockIdx.x) * kRows + kRows - 1);
  for (int64_t k0 = 0; k0 <= last; k0 += kTile) {
    load_kv_tile<T, HD>(Ks, Vs, qkv, b, h, k0, Tn, C);
    __syncthreads();
    const int64_t n = active ? imin(kTile, t - k0 + 1) : 0;  // causal: keys s <= t
    if (n > 0) {
      float sc[kTile];
      float tmax = -INFINITY;
#pragma unroll
      for (int r = 0; r < kTile; ++r) {
        float dot = 0.f;
        if (r < n) {
#pragma unroll
          for (int d = 0; d < HD; ++d) dot += q[d] * Ks[r][d];
          tmax = fmaxf(tmax, dot);
        }
        sc[r] = dot;
      }
      const float mn = fmaxf(m, tmax), corr = expf(m - mn);
      l *= corr;
#pragma unroll
      for (int d = 0; d < HD; ++d) o[d] *= corr;
#pragma unroll
      for (int r = 0; r < kTile; ++r) {
        if (r < n) {
          const float p = expf(sc[r] - mn);
          l += p;
#pragma unroll
          for (int d = 0; d < HD; ++d) o[d] += p * Vs[r][d];
        }
      }
      m = mn;
    }
    __syncthreads();
  }
  if (!active) return;
  const float inv = 1.f / l;
#pragma unroll
  for (int d = 0; d < HD; ++d) out[(b * Tn + t) * C + h * HD + d] = to<T>(o[d] * inv);
  lse[(b * H + h) * Tn + t] = m + logf(l);
}

// D[b,h,t] = dout[t] . out[t] (the softmax backward's row term).
template <typename T>
__global__ void attention_rowdot_kernel(float* D, const T* dout, const T* out, int64_t B,
                                        int64_t Tn, int64_t H, int64_t hd) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * H * Tn) return;
  const int64_t t = i % Tn, h = (i / Tn) % H, b = i / (Tn * H);
  const int64_t C = H * hd;
  float s = 0.f;
  for (int64_t d = 0; d < hd; ++d)
    s += ld(dout[(b * Tn + t) * C + h * hd + d]) * ld(out[(b * Tn + t) * C + h * hd + d]);
  D[i] = s;
}

// dq for the query rows of this block, streaming keys and values.
template <typename T, int HD>
__global__ void __launch_bounds__(kRows)
    flash_backward_dq_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse, const float* D,
                             int64_t Tn, int64_t H) {
  __shared__ float Ks[kTile][HD], Vs[kTile][HD];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H, C = H * HD, C3 = 3 * C;
  const int64_t t = int64_t(blockIdx.x) * kRows + threadIdx.x;
  const bool active = t < Tn;
  const float scale = rsqrtf(static_cast<float>(HD));
  float q[HD], g[HD], dq[HD];
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    q[d] = active ? ld(qkv[(b * Tn + t) * C3 + h * HD + d]) * scale : 0.f;
    g[d] = active ? ld(dout[(b * Tn + t) * C + h * HD + d]) : 0.f;
    dq[d] = 0.f;
  }
  const float L = active ? lse[(b * H + h) * Tn + t] : 0.f;
  const float Dt = active ? D[(b * H + h) * Tn + t] : 0.f;
  const int64_t last = imin(Tn - 1, int64_t(blockIdx.x) * kRows + kRows - 1);
  for (int64_t k0 = 0; k0 <= last; k0 += kTile) {
    load_kv_tile<T, HD>(Ks, Vs, qkv, b, h, k0, Tn, C);
    __syncthreads();
    const int64_t n = active ? imin(kTile, t - k0 + 1) : 0;
    for (int r = 0; r < n; ++r) {
      float qk = 0.f, dp = 0.f;
#pragma unroll
      for (int d = 0; d < HD; ++d) {
        qk += q[d] * Ks[r][d];
        dp += g[d] * Vs[r][d];
      }
      const float ds = expf(qk - L) * (dp - Dt) * scale;
#pragma unroll
      for (int d = 0; d < HD; ++d) dq[d] += ds * Ks[r][d];
    }
    __syncthreads();
  }
  if (!active) return;
#pragma unroll
  for (int d = 0; d < HD; ++d) dqkv[(b * Tn + t) * C3 + h * HD + d] = to<T>(dq[d]);
}

// dk and dv for the key rows of this block, streaming the queries at or after them.
template <typename T, int HD>
__global__ void __launch_bounds__(kRows)
    flash_backward_dkv_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse,
                              const float* D, int64_t Tn, int64_t H) {
  __shared__ float Qs[kTile][HD], Gs[kTile][HD], Ls[kTile], Ds[kTile];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H, C = H * HD, C3 = 3 * C;
  const int64_t s = int64_t(blockIdx.x) * kRows + threadIdx.x;  // this thread's key row
  const bool active = s < Tn;
  const float scale = rsqrtf(static_cast<float>(HD));
  float k[HD], v[HD], dk[HD], dv[HD];
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    k[d] = active ? ld(qkv[(b * Tn + s) * C3 + C + h * HD + d]) : 0.f;
    v[d] = active ? ld(qkv[(b * Tn + s) * C3 + 2 * C + h * HD + d]) : 0.f;
    dk[d] = dv[d] = 0.f;
  }
  const int64_t first = int64_t(blockIdx.x) * kRows;  // queries before the block see no key here
  for (int64_t q0 = first; q0 < Tn; q0 += kTile) {
    for (int i = threadIdx.x; i < kTile * HD; i += blockDim.x) {
      const int r = i / HD, d = i % HD;
      const int64_t t = q0 + r;
      const bool in = t < Tn;
      Qs[r][d] = in ? ld(qkv[(b * Tn + t) * C3 + h * HD + d]) * scale : 0.f;
      Gs[r][d] = in ? ld(dout[(b * Tn + t) * C + h * HD + d]) : 0.f;
    }
    for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
      const int64_t t = q0 + r;
      Ls[r] = t < Tn ? lse[(b * H + h) * Tn + t] : 0.f;
      Ds[r] = t < Tn ? D[(b * H + h) * Tn + t] : 0.f;
    }
    __syncthreads();
    if (active) {
      for (int r = 0; r < kTile; ++r) {
        const int64_t t = q0 + r;
        if (t < s || t >= Tn) continue;  // causal: query t sees key s when s <= t
        float qk = 0.f, dp = 0.f;
#pragma unroll
        for (int d = 0; d < HD; ++d) {
          qk += Qs[r][d] * k[d];
          dp += Gs[r][d] * v[d];
        }
        const float p = expf(qk - Ls[r]);
        const float ds = p * (dp - Ds[r]);
#pragma unroll
        for (int d = 0; d < HD; ++d) {
          dv[d] += p * Gs[r][d];
          dk[d] += ds * Qs[r][d];  // Qs holds q * scale: dS/dk carries the scale
        }
      }
    }
    __syncthreads();
  }
  if (!active) return;
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    dqkv[(b * Tn + s) * C3 + C + h * HD + d] = to<T>(dk[d]);
    dqkv[(b * Tn + s) * C3 + 2 * C + h * HD + d] = to<T>(dv[d]);
  }
}

// Any head dimension: one thread per query row, keys and values read from global memory.
template <typename T>
__global__ void attention_forward_kernel(T* out, float* lse, const T* qkv, int64_t B, int64_t Tn,
                                         int64_t H, int64_t hd) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (b, h, t)
  if (i >= B * H * Tn) return;
  const int64_t t = i % Tn, h = (i / Tn) % H, b = i / (Tn * H);
  const int64_t C = H * hd, C3 = 3 * C;
  const float scale = rsqrtf(static_cast<float>(hd));
  const T* q = qkv + (b * Tn + t) * C3 + h * hd;
  T* o = out + (b * Tn + t) * C + h * hd;
  // Two passes (max and sum, then the weighted values) so nothing is rescaled in T.
  float m = -INFINITY, l = 0.f;
  for (int64_t s = 0; s <= t; ++s) {
    const T* k = qkv + (b * Tn + s) * C3 + C + h * hd;
    float dot = 0.f;
    for (int64_t d = 0; d < hd; ++d) dot += ld(q[d]) * ld(k[d]);
    dot *= scale;
    const float mn = fmaxf(m, dot);
    l = l * expf(m - mn) + expf(dot - mn);
    m = mn;
  }
  for (int64_t d = 0; d < hd; ++d) {
    float acc = 0.f;
    for (int64_t s = 0; s <= t; ++s) {
      const T* k = qkv + (b * Tn + s) * C3 + C + h * hd;
      float dot = 0.f;
      for (int64_t e = 0; e < hd; ++e) dot += ld(q[e]) * ld(k[e]);
      acc += expf(dot * scale - m) * ld(k[C + d]);
    }
    o[d] = to<T>(acc / l);
  }
  lse[(b * H + h) * Tn + t] = m + logf(l);
}
// dq for query row t; dk, dv for key row s (= the same index): one writer per output row.
template <typename T>
__global__ void attention_backward_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse,
                                          const float* D, int64_t B, int64_t Tn, int64_t H,
                                          int64_t hd) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * H * Tn) return;
  const int64_t r = i % Tn, h = (i / Tn) % H, b = i / (Tn * H);
  const int64_t C = H * hd, C3 = 3 * C;
  const float scale = rsqrtf(static_cast<float>(hd));
  const float* L = lse + (b * H + h) * Tn;
  const float* Dr = D + (b * H + h) * Tn;
  auto q_at = [&](int64_t t) { return qkv + (b * Tn + t) * C3 + h * hd; };
  auto k_at = [&](int64_t s) { return qkv + (b * Tn + s) * C3 + C + h * hd; };
  auto v_at = [&](int64_t s) { return qkv + (b * Tn + s) * C3 + 2 * C + h * hd; };
  auto do_at = [&](int64_t t) { return dout + (b * Tn + t) * C + h * hd; };
  auto dS = [&](int64_t t, int64_t s, float& p) {
    float qk = 0.f, dp = 0.f;
    const T *q = q_at(t), *k = k_at(s), *v = v_at(s), *g = do_at(t);
    for (int64_t d = 0; d < hd; ++d) {
      qk += ld(q[d]) * ld(k[d]);
      dp += ld(g[d]) * ld(v[d]);
    }
    p = expf(qk * scale - L[t]);
    return p * (dp - Dr[t]);
  };
  T* dq = dqkv + (b * Tn + r) * C3 + h * hd;
  T* dk = dq + C;
  T* dv = dq + 2 * C;
  for (int64_t d = 0; d < hd; ++d) {  // one output element at a time: f32 sums, one rounding
    float aq = 0.f, ak = 0.f, av = 0.f, p;
    for (int64_t s = 0; s <= r; ++s) aq += dS(r, s, p) * scale * ld(k_at(s)[d]);
    for (int64_t t = r; t < Tn; ++t) {
      const float g = dS(t, r, p) * scale;
      ak += g * ld(q_at(t)[d]);
      av += p * ld(do_at(t)[d]);
    }
    dq[d] = to<T>(aq);
    dk[d] = to<T>(ak);
    dv[d] = to<T>(av);
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
struct DevAdamSegment {
  int64_t begin, end;
  float decay;  // 1 - lr * weight_decay
};
// AdamW over the whole flat buffer: each element finds its segment (binary search over the
// segment starts) for its weight decay.
__global__ void adamw_flat_kernel(float* p, const float* g, float* m, float* v, int64_t n,
                                  const DevAdamSegment* segs, int nseg, float b1, float b2,
                                  float eps, float step_size, float bc2_sqrt) {
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
  const float gi = g[i];
  const float mi = b1 * m[i] + (1.f - b1) * gi;
  const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  p[i] = p[i] * segs[lo].decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
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

// Column sums over many rows in two deterministic stages: each (column, chunk of rows) partial
// in a fixed order, then each column's partials in chunk order.
constexpr int kRowChunks = 64;
template <typename T>
__global__ void column_partials_kernel(float* part, const T* x, int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t chunk = (N + kRowChunks - 1) / kRowChunks;
  const int64_t r0 = blockIdx.y * chunk, r1 = r0 + chunk < N ? r0 + chunk : N;
  float s = 0.f;
  for (int64_t r = r0; r < r1; ++r) s += ld(x[r * C + c]);
  part[blockIdx.y * C + c] = s;
}
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
__global__ void sum_partials_kernel(float* out, const float* part, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.f;
  for (int k = 0; k < kRowChunks; ++k) s += part[k * C + c];
  out[c] += s;
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
    for (Stage& st : stages_) {
      CUDA_CHECK(cudaHostAlloc(&st.host, kStageBytes, cudaHostAllocDefault));
      CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventRecord(st.done, stream_));
    }
  }
  ~CudaBackend() override {  // reverse order of creation
    cudaStreamSynchronize(stream_);
    for (Stage& st : stages_) {
      if (st.done) cudaEventDestroy(st.done);
      if (st.host) cudaFreeHost(st.host);
    }
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
    const size_t n = dst.nbytes();
    if (n > kStageBytes) {
      // Large copies (checkpoint loads): pageable, staged by the driver before the call returns.
      CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src, n, cudaMemcpyHostToDevice, stream_));
      return;
    }
    // Small per-step copies (token ids, targets): through a ring of pinned buffers, so the copy
    // is a real asynchronous DMA and the caller's buffer is free at once. A buffer is reused once
    // the copy that last read it has finished (its event).
    Stage& st = stages_[next_stage_];
    next_stage_ = (next_stage_ + 1) % kStages;
    CUDA_CHECK(cudaEventSynchronize(st.done));
    std::memcpy(st.host, src, n);
    CUDA_CHECK(cudaMemcpyAsync(dst.raw(), st.host, n, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(st.done, stream_));
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
  void cast(Tensor& dst, const Tensor& src) override {
    expect_device(dst, "cast destination");
    expect_device(src, "cast source");
    TESSERA_CHECK(dst.numel() == src.numel(), "cast shapes");
    if (dst.numel() == 0) return;
    dispatch(dst.dtype(), "cast", [&](auto to_tag) {
      using TO = decltype(to_tag);
      dispatch(src.dtype(), "cast", [&](auto from_tag) {
        using TI = decltype(from_tag);
        cast_kernel<TO, TI><<<blocks_for(src.numel()), kThreads, 0, stream_>>>(
            dst.data<TO>(), src.data<TI>(), src.numel());
      });
    });
    LAUNCH_CHECK();
  }
  void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                         int64_t row_begin) override {
    const int64_t N = ids.numel(), C = cols_of(out);
    TESSERA_CHECK(rows_of(out) == N && cols_of(table) == C, "embedding shapes");
    expect_dtype(table, out.dtype(), "embedding table");
    dispatch(out.dtype(), "embedding", [&](auto tag) {
      using T = decltype(tag);
      embedding_forward_kernel<T><<<blocks_for(N * C), kThreads, 0, stream_>>>(
          out.data<T>(), ids.i32(), table.data<T>(), N, C, row_begin, rows_of(table));
    });
    LAUNCH_CHECK();
  }
  void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                          int64_t row_begin) override {
    const int64_t N = ids.numel(), C = cols_of(dout);
    expect_dtype(dtable, DType::F32, "embedding gradient");
    dispatch(dout.dtype(), "embedding backward", [&](auto tag) {
      using T = decltype(tag);
      embedding_backward_kernel<T><<<blocks_for(C), kThreads, 0, stream_>>>(
          dtable.f32(), dout.data<T>(), ids.i32(), N, C, row_begin, rows_of(dtable));
    });
    LAUNCH_CHECK();
  }
  void position_embedding_forward(Tensor& out, const Tensor& wpe) override {
    expect_dtype(wpe, out.dtype(), "position embedding");
    dispatch(out.dtype(), "position embedding", [&](auto tag) {
      using T = decltype(tag);
      position_forward_kernel<T><<<blocks_for(out.numel()), kThreads, 0, stream_>>>(
          out.data<T>(), wpe.data<T>(), out.dim(0), out.dim(1), out.dim(2));
    });
    LAUNCH_CHECK();
  }
  void position_embedding_backward(Tensor& dwpe, const Tensor& dout) override {
    expect_dtype(dwpe, DType::F32, "position embedding gradient");
    dispatch(dout.dtype(), "position embedding backward", [&](auto tag) {
      using T = decltype(tag);
      position_backward_kernel<T><<<blocks_for(dout.dim(1) * dout.dim(2)), kThreads, 0, stream_>>>(
          dwpe.f32(), dout.data<T>(), dout.dim(0), dout.dim(1), dout.dim(2));
    });
    LAUNCH_CHECK();
  }
  void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                         const Tensor& w, const Tensor& b, double eps) override {
    expect_dtype(mean, DType::F32, "layernorm mean");
    expect_dtype(rstd, DType::F32, "layernorm rstd");
    dispatch(inp.dtype(), "layernorm", [&](auto tag) {
      using T = decltype(tag);
      layernorm_forward_kernel<T><<<static_cast<unsigned>(rows_of(inp)), kThreads, 0, stream_>>>(
          out.data<T>(), mean.f32(), rstd.f32(), inp.data<T>(), w.data<T>(), b.data<T>(),
          cols_of(inp), static_cast<float>(eps));
    });
    LAUNCH_CHECK();
  }
  void layernorm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout,
                          const Tensor& inp, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    expect_dtype(dw, DType::F32, "layernorm weight gradient");
    expect_dtype(db, DType::F32, "layernorm bias gradient");
    dispatch(inp.dtype(), "layernorm backward", [&](auto tag) {
      using T = decltype(tag);
      layernorm_backward_input_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
          dinp.data<T>(), dout.data<T>(), inp.data<T>(), w.data<T>(), mean.f32(), rstd.f32(), C);
      LAUNCH_CHECK();
      float* part = partials(2 * kRowChunks * C);
      const dim3 grid(static_cast<unsigned>(blocks_for(C)), kRowChunks);
      layernorm_param_partials_kernel<T><<<grid, kThreads, 0, stream_>>>(
          part, part + kRowChunks * C, dout.data<T>(), inp.data<T>(), mean.f32(), rstd.f32(), N, C);
      LAUNCH_CHECK();
      sum_partials_kernel<<<blocks_for(C), kThreads, 0, stream_>>>(dw.f32(), part, C);
      LAUNCH_CHECK();
      sum_partials_kernel<<<blocks_for(C), kThreads, 0, stream_>>>(db.f32(), part + kRowChunks * C,
                                                                   C);
    });
    LAUNCH_CHECK();
  }
  void add_layernorm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                             const Tensor& b, const Tensor& w, const Tensor& bias,
                             double eps) override {
    expect_dtype(mean, DType::F32, "layernorm mean");
    expect_dtype(rstd, DType::F32, "layernorm rstd");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&sum, &out, &b, &w, &bias})
      expect_dtype(*t, a.dtype(), "add+layernorm operand");
    dispatch(a.dtype(), "add+layernorm", [&](auto tag) {
      using T = decltype(tag);
      add_layernorm_kernel<T><<<static_cast<unsigned>(rows_of(a)), kThreads, 0, stream_>>>(
          sum.data<T>(), out.data<T>(), mean.f32(), rstd.f32(), a.data<T>(), b.data<T>(),
          w.data<T>(), bias.data<T>(), cols_of(a), static_cast<float>(eps));
    });
    LAUNCH_CHECK();
  }
  // Row-major Y (N,OC) = X (N,IC) W^T is, in cuBLAS's column-major terms, Y^T = W X^T with W read
  // transposed: (OC,IC)row = (IC,OC)col. All GEMMs accumulate in f32 (CUBLAS_COMPUTE_32F; bf16 and
  // f16 inputs run on tensor cores).
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
            const Tensor& A, int64_t lda, const Tensor& B, int64_t ldb, float beta, Tensor& Cm,
            int64_t ldc) {
    const float alpha = 1.f;
    CUBLAS_CHECK(cublasGemmEx(blas_->get(), ta, tb, (int)m, (int)n, (int)k, &alpha, A.raw(),
                              cuda_type(A.dtype()), (int)lda, B.raw(), cuda_type(B.dtype()),
                              (int)ldb, &beta, Cm.raw(), cuda_type(Cm.dtype()), (int)ldc,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                      const Tensor* bias) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    TESSERA_CHECK(cols_of(weight) == IC && out.numel() == N * OC, "matmul shapes");
    expect_dtype(weight, inp.dtype(), "matmul weight");
    expect_dtype(out, inp.dtype(), "matmul output");
    if (bias) {
      expect_dtype(*bias, inp.dtype(), "matmul bias");
      dispatch(out.dtype(), "bias", [&](auto tag) {
        using T = decltype(tag);
        fill_bias_kernel<T>
            <<<blocks_for(N * OC), kThreads, 0, stream_>>>(out.data<T>(), bias->data<T>(), N, OC);
      });
      LAUNCH_CHECK();
    }
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, weight, IC, inp, IC, bias ? 1.f : 0.f, out, OC);
  }
  void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    expect_dtype(dweight, DType::F32, "matmul weight gradient");
    if (dinp) gemm(CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, weight, IC, dout, OC, 0.f, *dinp, IC);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, inp, IC, dout, OC, 1.f, dweight, IC);
    if (dbias) {
      expect_dtype(*dbias, DType::F32, "matmul bias gradient");
      float* part = partials(kRowChunks * OC);
      dispatch(dout.dtype(), "bias gradient", [&](auto tag) {
        using T = decltype(tag);
        const dim3 grid(static_cast<unsigned>(blocks_for(OC)), kRowChunks);
        column_partials_kernel<T><<<grid, kThreads, 0, stream_>>>(part, dout.data<T>(), N, OC);
      });
      LAUNCH_CHECK();
      sum_partials_kernel<<<blocks_for(OC), kThreads, 0, stream_>>>(dbias->f32(), part, OC);
      LAUNCH_CHECK();
    }
  }
  template <typename T, int HD>
  void flash_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t B, int64_t Tn,
                     int64_t H) {
    const dim3 grid(static_cast<unsigned>((Tn + kRows - 1) / kRows), static_cast<unsigned>(B * H));
    flash_forward_kernel<T, HD>
        <<<grid, kRows, 0, stream_>>>(out.data<T>(), lse.f32(), qkv.data<T>(), Tn, H);
  }
  template <typename T, int HD>
  void flash_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, int64_t B, int64_t Tn,
                      int64_t H, const Tensor& lse) {
    const dim3 grid(static_cast<unsigned>((Tn + kRows - 1) / kRows), static_cast<unsigned>(B * H));
    flash_backward_dq_kernel<T, HD><<<grid, kRows, 0, stream_>>>(
        dqkv.data<T>(), dout.data<T>(), qkv.data<T>(), lse.f32(), rowdot_.f32(), Tn, H);
    LAUNCH_CHECK();
    flash_backward_dkv_kernel<T, HD><<<grid, kRows, 0, stream_>>>(
        dqkv.data<T>(), dout.data<T>(), qkv.data<T>(), lse.f32(), rowdot_.f32(), Tn, H);
  }
  void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads) override {
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (3 * heads);
    expect_dtype(lse, DType::F32, "attention lse");
    expect_dtype(out, qkv.dtype(), "attention output");
    dispatch(qkv.dtype(), "attention", [&](auto tag) {
      using S = decltype(tag);
      if (hd == 32)
        flash_forward<S, 32>(out, lse, qkv, B, T, heads);
      else if (hd == 64)
        flash_forward<S, 64>(out, lse, qkv, B, T, heads);
      else if (hd == 128)
        flash_forward<S, 128>(out, lse, qkv, B, T, heads);
      else
        attention_forward_kernel<S><<<blocks_for(B * heads * T), kThreads, 0, stream_>>>(
            out.data<S>(), lse.f32(), qkv.data<S>(), B, T, heads, hd);
    });
    LAUNCH_CHECK();
  }
  void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int64_t heads) override {
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (3 * heads);
    if (rowdot_.numel() < B * heads * T) {
      AllocationLabel label("attention backward workspace");
      retire(rowdot_);
      rowdot_ = Tensor({B * heads * T}, DType::F32, allocator());
    }
    dispatch(qkv.dtype(), "attention backward", [&](auto tag) {
      using S = decltype(tag);
      attention_rowdot_kernel<S><<<blocks_for(B * heads * T), kThreads, 0, stream_>>>(
          rowdot_.f32(), dout.data<S>(), out.data<S>(), B, T, heads, hd);
      LAUNCH_CHECK();
      if (hd == 32)
        flash_backward<S, 32>(dqkv, dout, qkv, B, T, heads, lse);
      else if (hd == 64)
        flash_backward<S, 64>(dqkv, dout, qkv, B, T, heads, lse);
      else if (hd == 128)
        flash_backward<S, 128>(dqkv, dout, qkv, B, T, heads, lse);
      else
        attention_backward_kernel<S><<<blocks_for(B * heads * T), kThreads, 0, stream_>>>(
            dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), lse.f32(), rowdot_.f32(), B, T, heads,
            hd);
    });
    LAUNCH_CHECK();
  }
  void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                    const std::vector<KvSegment>& segments, int64_t heads) override {
    for (const Tensor* t : std::initializer_list<const Tensor*>{&out, &qkv, &k_cache, &v_cache})
      expect_dtype(*t, DType::F32, "generation (KV attention)");
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
    expect_dtype(out, inp.dtype(), "gelu output");
    dispatch(inp.dtype(), "gelu", [&](auto tag) {
      using T = decltype(tag);
      gelu_forward_kernel<T><<<blocks_for(inp.numel()), kThreads, 0, stream_>>>(
          out.data<T>(), inp.data<T>(), inp.numel());
    });
    LAUNCH_CHECK();
  }
  void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    dispatch(inp.dtype(), "gelu backward", [&](auto tag) {
      using T = decltype(tag);
      gelu_backward_kernel<T><<<blocks_for(inp.numel()), kThreads, 0, stream_>>>(
          dinp.data<T>(), inp.data<T>(), dout.data<T>(), inp.numel());
    });
    LAUNCH_CHECK();
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override {
    expect_dtype(out, a.dtype(), "add output");
    expect_dtype(b, a.dtype(), "add input");
    dispatch(a.dtype(), "add", [&](auto tag) {
      using T = decltype(tag);
      add_kernel<T><<<blocks_for(a.numel()), kThreads, 0, stream_>>>(out.data<T>(), a.data<T>(),
                                                                     b.data<T>(), a.numel());
    });
    LAUNCH_CHECK();
  }
  void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid) override {
    dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
      using T = decltype(tag);
      xent_max_kernel<T><<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, stream_>>>(
          rowmax.f32(), logits.data<T>(), cols_of(logits), valid);
    });
    LAUNCH_CHECK();
  }
  void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits,
                     const Tensor& rowmax, const Tensor& targets, int64_t valid,
                     int64_t col_begin) override {
    dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
      using T = decltype(tag);
      xent_sums_kernel<T><<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, stream_>>>(
          sumexp.f32(), target_logit.f32(), logits.data<T>(), rowmax.f32(), targets.i32(),
          cols_of(logits), valid, col_begin);
    });
    LAUNCH_CHECK();
  }
  void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax,
                          const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets,
                          int64_t valid, int64_t col_begin, float grad_scale) override {
    dispatch(logits.dtype(), "cross-entropy", [&](auto tag) {
      using T = decltype(tag);
      xent_grad_kernel<T><<<static_cast<unsigned>(rows_of(logits)), kThreads, 0, stream_>>>(
          losses.f32(), logits.data<T>(), rowmax.f32(), sumexp.f32(), target_logit.f32(),
          targets.i32(), cols_of(logits), valid, col_begin, grad_scale);
    });
    LAUNCH_CHECK();
  }
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                  double weight_decay, int64_t step) override {
    for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v})
      expect_dtype(*t, DType::F32, "AdamW operand (f32 master weights, gradients, moments)");
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
    adamw_kernel<<<blocks_for(param.numel()), kThreads, 0, stream_>>>(
        param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), (float)h.beta1, (float)h.beta2,
        (float)h.eps, (float)(h.lr / bc1), (float)std::sqrt(bc2),
        (float)(1.0 - h.lr * weight_decay));
    LAUNCH_CHECK();
  }
  void adamw_step_flat(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                       const std::vector<AdamWSegment>& segments, const AdamWHyper& h,
                       int64_t step) override {
    for (const Tensor* t : std::initializer_list<const Tensor*>{&params, &grads, &m, &v})
      expect_dtype(*t, DType::F32, "AdamW operand (f32 master weights, gradients, moments)");
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
    if (table.size() > adam_capacity_) {
      AllocationLabel label("the AdamW segment table");
      const int64_t words = static_cast<int64_t>((sizeof(DevAdamSegment) * table.size() + 3) / 4);
      retire(adam_segs_);
      adam_segs_ = Tensor({words}, DType::F32, allocator());  // raw storage for the table
      adam_capacity_ = table.size();
    }
    adam_host_ = table;  // kept alive until the copy has been staged
    CUDA_CHECK(cudaMemcpyAsync(adam_segs_.raw(), adam_host_.data(),
                               sizeof(DevAdamSegment) * adam_host_.size(), cudaMemcpyHostToDevice,
                               stream_));
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
    const int64_t n = segments.back().end;
    adamw_flat_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(
        params.f32(), grads.f32(), m.f32(), v.f32(), n,
        static_cast<const DevAdamSegment*>(adam_segs_.raw()), static_cast<int>(table.size()),
        (float)h.beta1, (float)h.beta2, (float)h.eps, (float)(h.lr / bc1), (float)std::sqrt(bc2));
    LAUNCH_CHECK();
  }
  double sum_squares(const Tensor& x) override { return sum_squares_all({x}); }
  double sum_squares_all(const std::vector<Tensor>& xs) override {
    bool first = true;
    for (const Tensor& x : xs) {
      expect_device(x, "sum_squares input");
      expect_dtype(x, DType::F32, "sum_squares input (gradients)");
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
    expect_dtype(x, DType::F32, "scale operand (gradients)");
    scale_kernel<<<blocks_for(x.numel()), kThreads, 0, stream_>>>(x.f32(), x.numel(), s);
    LAUNCH_CHECK();
  }

 private:
  static constexpr int kStages = 8;
  static constexpr size_t kStageBytes = size_t(4) << 20;
  struct Stage {
    void* host = nullptr;  // pinned
    cudaEvent_t done = nullptr;
  };
  Stage stages_[kStages];
  int next_stage_ = 0;

  // Grow-only f32 scratch for two-stage reductions (allocated in the first step only).
  float* partials(int64_t n) {
    if (scratch_.numel() < n) {
      AllocationLabel label("reduction scratch");
      retire(scratch_);
      scratch_ = Tensor({n}, DType::F32, allocator());
    }
    return scratch_.f32();
  }
  // A workspace outgrown in the first step is kept, not freed: cudaFree waits for the whole
  // device, which can stall against NCCL work in flight on other streams.
  void retire(Tensor& t) {
    if (t.defined()) retired_.push_back(t);
  }
  std::vector<Tensor> retired_;

  cudaStream_t stream_ = nullptr;
  Tensor scratch_, adam_segs_;
  size_t adam_capacity_ = 0;
  std::vector<DevAdamSegment> adam_host_;
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
