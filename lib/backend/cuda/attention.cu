// attention.cu: fused causal self-attention. bf16 and f16 at head dims 64 and 128 (every GPT
// config we ship) go to the tensor-core FlashAttention-2 kernels of flash_attention_tc.cuh; the
// rest, and f32 always (the exact reference path), to the scalar kernels of this file, tiled in
// the manner of FlashAttention (Dao et al.): the T x T matrix is never stored. One thread owns one
// query row (forward, dq) or one key row (dk, dv) and keeps it in registers; the other side streams
// through shared memory in tiles of kTile rows, with an online softmax. Head dimensions 32, 64 and
// 128 are compiled; others take the one-thread-per-row kernels below, which read the tiles straight
// from global memory. The forward keeps the log-sum-exp of every row for the backward. The CPU
// reference is backend/cpu/attention.hpp.
//
// Grouped-query attention: qkv rows hold H query heads, then G key heads, then G value heads (row
// stride C3 = (H + 2G) hd; G = H is GPT-2's [3, H, hd]); query head h reads key/value head
// h / (H/G) in place. Every key/value gradient sums its group's H/G query heads in one owner (a
// block per key/value head, or a thread per key row, that loops over the group's heads), so the
// backward needs no atomics and no per-query-head copies of dK and dV.
//
// ALiBi (core/alibi.hpp): slope_h (key - query) is added to each score once it is scaled (the
// scalar kernels scale q up front, so every score here is already in the softmax's natural-log
// units), before the row max, the exponent and the log-sum-exp; the backward adds it to the
// scores it recomputes. Every kernel takes it as a template flag (kAlibi), so those without it are
// the kernels of before, instruction for instruction.
#include "backend/cuda/common.cuh"
#include "backend/cuda/flash_attention_tc.hpp"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

constexpr int kRows = 64;  // query (or key) rows per block
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}
constexpr int kTile = 32;  // rows of the streamed side per shared-memory tile

// Keys and values of rows [k0, k0 + kTile) of key/value head g (of G) into shared memory, zeros
// past the end. C = H * HD (the query heads), rows of C + 2 G HD.
template <typename T, int HD>
__device__ void load_kv_tile(float (*Ks)[HD], float (*Vs)[HD], const T* qkv, int64_t b, int64_t g,
                             int64_t k0, int64_t Tn, int64_t C, int64_t G) {
  const int64_t C3 = C + 2 * G * HD;
  for (int i = threadIdx.x; i < kTile * HD; i += blockDim.x) {
    const int r = i / HD, d = i % HD;
    const int64_t s = k0 + r;
    const bool in = s < Tn;
    Ks[r][d] = in ? ld(qkv[(b * Tn + s) * C3 + C + g * HD + d]) : 0.f;
    Vs[r][d] = in ? ld(qkv[(b * Tn + s) * C3 + C + (G + g) * HD + d]) : 0.f;
  }
}

// Grid (query tiles, B * H).
template <typename T, int HD, bool kAlibi>
__global__ void __launch_bounds__(kRows)
    flash_forward_kernel(T* out, float* lse, const T* qkv, int64_t Tn, int64_t H, int64_t G,
                         AttentionAlibi alibi) {
  __shared__ float Ks[kTile][HD], Vs[kTile][HD];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H, kvh = h / (H / G), C = H * HD,
                C3 = C + 2 * G * HD;
  const int64_t t = int64_t(blockIdx.x) * kRows + threadIdx.x;
  const bool active = t < Tn;
  const float scale = rsqrtf(static_cast<float>(HD));
  const float slope = kAlibi ? alibi.slope(h) : 0.f;
  float q[HD], o[HD];
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    q[d] = active ? ld(qkv[(b * Tn + t) * C3 + h * HD + d]) * scale : 0.f;
    o[d] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int64_t last = imin(Tn - 1, int64_t(blockIdx.x) * kRows + kRows - 1);
  for (int64_t k0 = 0; k0 <= last; k0 += kTile) {
    load_kv_tile<T, HD>(Ks, Vs, qkv, b, kvh, k0, Tn, C, G);
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
          if constexpr (kAlibi) dot += slope * static_cast<float>(static_cast<int>(k0 + r - t));
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

// dq for the query rows of this block, streaming keys and values. Grid (query tiles, B * H).
template <typename T, int HD, bool kAlibi>
__global__ void __launch_bounds__(kRows)
    flash_backward_dq_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse, const float* D,
                             int64_t Tn, int64_t H, int64_t G, AttentionAlibi alibi) {
  __shared__ float Ks[kTile][HD], Vs[kTile][HD];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H, kvh = h / (H / G), C = H * HD,
                C3 = C + 2 * G * HD;
  const int64_t t = int64_t(blockIdx.x) * kRows + threadIdx.x;
  const bool active = t < Tn;
  const float scale = rsqrtf(static_cast<float>(HD));
  const float slope = kAlibi ? alibi.slope(h) : 0.f;
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
    load_kv_tile<T, HD>(Ks, Vs, qkv, b, kvh, k0, Tn, C, G);
    __syncthreads();
    const int64_t n = active ? imin(kTile, t - k0 + 1) : 0;
    for (int r = 0; r < n; ++r) {
      float qk = 0.f, dp = 0.f;
#pragma unroll
      for (int d = 0; d < HD; ++d) {
        qk += q[d] * Ks[r][d];
        dp += g[d] * Vs[r][d];
      }
      if constexpr (kAlibi) qk += slope * static_cast<float>(static_cast<int>(k0 + r - t));
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

// dk and dv for the key rows of this block of key/value head g, streaming the queries at or
// after them, for each query head of g's group in turn (the sums over the group stay in registers).
// Grid (key tiles, B * G).
template <typename T, int HD, bool kAlibi>
__global__ void __launch_bounds__(kRows)
    flash_backward_dkv_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse,
                              const float* D, int64_t Tn, int64_t H, int64_t G,
                              AttentionAlibi alibi) {
  __shared__ float Qs[kTile][HD], Gs[kTile][HD], Ls[kTile], Ds[kTile];
  const int64_t b = blockIdx.y / G, kvh = blockIdx.y % G, C = H * HD, C3 = C + 2 * G * HD;
  const int64_t s = int64_t(blockIdx.x) * kRows + threadIdx.x;  // this thread's key row
  const bool active = s < Tn;
  const float scale = rsqrtf(static_cast<float>(HD));
  float k[HD], v[HD], dk[HD], dv[HD];
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    k[d] = active ? ld(qkv[(b * Tn + s) * C3 + C + kvh * HD + d]) : 0.f;
    v[d] = active ? ld(qkv[(b * Tn + s) * C3 + C + (G + kvh) * HD + d]) : 0.f;
    dk[d] = dv[d] = 0.f;
  }
  const int64_t first = int64_t(blockIdx.x) * kRows;  // queries before the block see no key here
  for (int64_t h = kvh * (H / G); h < (kvh + 1) * (H / G); ++h) {
    const float slope = kAlibi ? alibi.slope(h) : 0.f;
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
          if constexpr (kAlibi) qk += slope * static_cast<float>(static_cast<int>(s - t));
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
  }
  if (!active) return;
#pragma unroll
  for (int d = 0; d < HD; ++d) {
    dqkv[(b * Tn + s) * C3 + C + kvh * HD + d] = to<T>(dk[d]);
    dqkv[(b * Tn + s) * C3 + C + (G + kvh) * HD + d] = to<T>(dv[d]);
  }
}

// `alibi` null: the kernels without ALiBi.
template <typename T, int HD>
void flash_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t B, int64_t Tn, int64_t H,
                   int64_t G, const AttentionAlibi* alibi, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((Tn + kRows - 1) / kRows), static_cast<unsigned>(B * H));
  if (alibi)
    flash_forward_kernel<T, HD, true>
        <<<grid, kRows, 0, s>>>(out.data<T>(), lse.f32(), qkv.data<T>(), Tn, H, G, *alibi);
  else
    flash_forward_kernel<T, HD, false>
        <<<grid, kRows, 0, s>>>(out.data<T>(), lse.f32(), qkv.data<T>(), Tn, H, G, {});
}
template <typename T, int HD, bool kAlibi>
void flash_backward_kernels(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, int64_t B,
                            int64_t Tn, int64_t H, int64_t G, const Tensor& lse,
                            const float* rowdot, const AttentionAlibi& alibi, cudaStream_t s) {
  const unsigned tiles = static_cast<unsigned>((Tn + kRows - 1) / kRows);
  flash_backward_dq_kernel<T, HD, kAlibi>
      <<<dim3(tiles, static_cast<unsigned>(B * H)), kRows, 0, s>>>(
          dqkv.data<T>(), dout.data<T>(), qkv.data<T>(), lse.f32(), rowdot, Tn, H, G, alibi);
  LAUNCH_CHECK();
  flash_backward_dkv_kernel<T, HD, kAlibi>
      <<<dim3(tiles, static_cast<unsigned>(B * G)), kRows, 0, s>>>(
          dqkv.data<T>(), dout.data<T>(), qkv.data<T>(), lse.f32(), rowdot, Tn, H, G, alibi);
}
template <typename T, int HD>
void flash_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, int64_t B, int64_t Tn,
                    int64_t H, int64_t G, const Tensor& lse, const float* rowdot,
                    const AttentionAlibi* alibi, cudaStream_t s) {
  if (alibi)
    flash_backward_kernels<T, HD, true>(dqkv, dout, qkv, B, Tn, H, G, lse, rowdot, *alibi, s);
  else
    flash_backward_kernels<T, HD, false>(dqkv, dout, qkv, B, Tn, H, G, lse, rowdot, {}, s);
}

// Any head dimension, and attention dropout outside the tensor-core kernels: one thread per query
// row, keys and values read from global memory. `drop` applies when drop.spec.active(), `alibi`
// with kAlibi.
template <typename T, bool kAlibi>
__global__ void attention_forward_kernel(T* out, float* lse, const T* qkv, int64_t B, int64_t Tn,
                                         int64_t H, int64_t G, int64_t hd, AttentionDropout drop,
                                         AttentionAlibi alibi) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (b, h, t)
  if (i >= B * H * Tn) return;
  const int64_t t = i % Tn, h = (i / Tn) % H, b = i / (Tn * H), kvh = h / (H / G);
  const int64_t C = H * hd, C3 = C + 2 * G * hd, GD = G * hd;  // GD: from a key to its value
  const float scale = rsqrtf(static_cast<float>(hd));
  const float slope = kAlibi ? alibi.slope(h) : 0.f;
  const T* q = qkv + (b * Tn + t) * C3 + h * hd;
  T* o = out + (b * Tn + t) * C + h * hd;
  // Two passes (max and sum, then the weighted values) so nothing is rescaled in T.
  float m = -INFINITY, l = 0.f;
  for (int64_t s = 0; s <= t; ++s) {
    const T* k = qkv + (b * Tn + s) * C3 + C + kvh * hd;
    float dot = 0.f;
    for (int64_t d = 0; d < hd; ++d) dot += ld(q[d]) * ld(k[d]);
    dot *= scale;
    if constexpr (kAlibi) dot += slope * static_cast<float>(s - t);
    const float mn = fmaxf(m, dot);
    l = l * expf(m - mn) + expf(dot - mn);
    m = mn;
  }
  for (int64_t d = 0; d < hd; ++d) {
    float acc = 0.f;
    for (int64_t s = 0; s <= t; ++s) {
      const T* k = qkv + (b * Tn + s) * C3 + C + kvh * hd;
      float dot = 0.f;
      for (int64_t e = 0; e < hd; ++e) dot += ld(q[e]) * ld(k[e]);
      float x;
      if constexpr (kAlibi)
        x = dot * scale + slope * static_cast<float>(s - t) - m;
      else
        x = dot * scale - m;
      const float mul = drop.spec.active() ? drop.multiplier(b, h, t, s, Tn) : 1.f;
      acc += expf(x) * mul * ld(k[GD + d]);
    }
    o[d] = to<T>(acc / l);
  }
  lse[(b * H + h) * Tn + t] = m + logf(l);
}
// One thread per (b, key/value head g, row r): dq of row r for each query head of g's group, and
// dk, dv of key row r summed over the group's heads: one writer per output row.
template <typename T, bool kAlibi>
__global__ void attention_backward_kernel(T* dqkv, const T* dout, const T* qkv, const float* lse,
                                          const float* D, int64_t B, int64_t Tn, int64_t H,
                                          int64_t G, int64_t hd, AttentionDropout drop,
                                          AttentionAlibi alibi) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * G * Tn) return;
  const int64_t r = i % Tn, kvh = (i / Tn) % G, b = i / (Tn * G), R = H / G;
  const int64_t C = H * hd, C3 = C + 2 * G * hd;
  const float scale = rsqrtf(static_cast<float>(hd));
  auto q_at = [&](int64_t h, int64_t t) { return qkv + (b * Tn + t) * C3 + h * hd; };
  auto k_at = [&](int64_t s) { return qkv + (b * Tn + s) * C3 + C + kvh * hd; };
  auto v_at = [&](int64_t s) { return qkv + (b * Tn + s) * C3 + C + (G + kvh) * hd; };
  auto do_at = [&](int64_t h, int64_t t) { return dout + (b * Tn + t) * C + h * hd; };
  // dS of (query head h, query t, key s) and P into p; `slope` is ALiBi's of head h.
  auto dS = [&](int64_t h, float slope, int64_t t, int64_t s, float& p) {
    float qk = 0.f, dp = 0.f;
    const T *q = q_at(h, t), *k = k_at(s), *v = v_at(s), *g = do_at(h, t);
    for (int64_t d = 0; d < hd; ++d) {
      qk += ld(q[d]) * ld(k[d]);
      dp += ld(g[d]) * ld(v[d]);
    }
    const float L = lse[(b * H + h) * Tn + t], Dt = D[(b * H + h) * Tn + t];
    if constexpr (kAlibi)
      p = expf(qk * scale + slope * static_cast<float>(s - t) - L);
    else
      p = expf(qk * scale - L);
    if (!drop.spec.active()) return p * (dp - Dt);
    const float mul = drop.multiplier(b, h, t, s, Tn);
    const float ds = p * (dp * mul - Dt);
    p *= mul;  // the dropped probability that weighed the values
    return ds;
  };
  T* dk = dqkv + (b * Tn + r) * C3 + C + kvh * hd;
  T* dv = dqkv + (b * Tn + r) * C3 + C + (G + kvh) * hd;
  for (int64_t d = 0; d < hd; ++d) {  // one output element at a time: f32 sums, one rounding
    float ak = 0.f, av = 0.f, p;
    for (int64_t h = kvh * R; h < (kvh + 1) * R; ++h) {
      const float slope = kAlibi ? alibi.slope(h) : 0.f;
      float aq = 0.f;
      for (int64_t s = 0; s <= r; ++s) aq += dS(h, slope, r, s, p) * scale * ld(k_at(s)[d]);
      for (int64_t t = r; t < Tn; ++t) {
        const float g = dS(h, slope, t, r, p) * scale;
        ak += g * ld(q_at(h, t)[d]);
        av += p * ld(do_at(h, t)[d]);
      }
      dqkv[(b * Tn + r) * C3 + h * hd + d] = to<T>(aq);
    }
    dk[d] = to<T>(ak);
    dv[d] = to<T>(av);
  }
}

}  // namespace

void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads, int64_t kv_heads,
                       const AttentionDropout* drop, const AttentionAlibi* alibi,
                       [[maybe_unused]] Workspace& ws, cudaStream_t s, bool tensor_cores,
                       const int32_t* key_begin) {
  const int64_t G = kv_heads, B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (heads + 2 * G);
  const AttentionDropout dr = drop && drop->spec.active() ? *drop : AttentionDropout{};
  if (tensor_cores && tc::flash_supported(qkv.dtype(), hd, B * heads, {out.raw(), qkv.raw()})) {
    tc::flash_forward(qkv.dtype(), out.raw(), lse.f32(), qkv.raw(), B, T, heads, G, hd, dr, alibi,
                      s, key_begin);
    return;
  }
  TESSERA_CHECK(!key_begin, "attention with documents: only the tensor-core kernels mask them");
  dispatch(qkv.dtype(), "attention", [&](auto tag) {
    using S = decltype(tag);
    auto generic = [&] {
      if (alibi)
        attention_forward_kernel<S, true><<<blocks_for(B * heads * T), kThreads, 0, s>>>(
            out.data<S>(), lse.f32(), qkv.data<S>(), B, T, heads, G, hd, dr, *alibi);
      else
        attention_forward_kernel<S, false><<<blocks_for(B * heads * T), kThreads, 0, s>>>(
            out.data<S>(), lse.f32(), qkv.data<S>(), B, T, heads, G, hd, dr, {});
    };
    // The tiled kernels put B * heads on grid.y (at most 65535): beyond, the generic ones.
    if (dr.spec.active() || B * heads > 65535)
      generic();
    else if (hd == 32)
      flash_forward<S, 32>(out, lse, qkv, B, T, heads, G, alibi, s);
    else if (hd == 64)
      flash_forward<S, 64>(out, lse, qkv, B, T, heads, G, alibi, s);
    else if (hd == 128)
      flash_forward<S, 128>(out, lse, qkv, B, T, heads, G, alibi, s);
    else
      generic();
  });
  LAUNCH_CHECK();
}

void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, int64_t heads, int64_t kv_heads,
                        const AttentionDropout* drop, const AttentionAlibi* alibi, Workspace& ws,
                        cudaStream_t s, bool tensor_cores, const int32_t* key_begin) {
  const int64_t G = kv_heads, B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (heads + 2 * G);
  const AttentionDropout dr = drop && drop->spec.active() ? *drop : AttentionDropout{};
  float* rowdot = ws.get<float>(Scratch::kAttentionRowdot, B * heads * T);
  if (tensor_cores && tc::flash_supported(qkv.dtype(), hd, B * heads,
                                          {dqkv.raw(), dout.raw(), qkv.raw(), out.raw()})) {
    tc::flash_backward(qkv.dtype(), dqkv.raw(), dout.raw(), qkv.raw(), out.raw(), lse.f32(), rowdot,
                       B, T, heads, G, hd, dr, alibi, s, key_begin);
    return;
  }
  TESSERA_CHECK(!key_begin, "attention with documents: only the tensor-core kernels mask them");
  dispatch(qkv.dtype(), "attention backward", [&](auto tag) {
    using S = decltype(tag);
    attention_rowdot_kernel<S><<<blocks_for(B * heads * T), kThreads, 0, s>>>(
        rowdot, dout.data<S>(), out.data<S>(), B, T, heads, hd);
    LAUNCH_CHECK();
    auto generic = [&] {
      if (alibi)
        attention_backward_kernel<S, true><<<blocks_for(B * G * T), kThreads, 0, s>>>(
            dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), lse.f32(), rowdot, B, T, heads, G, hd,
            dr, *alibi);
      else
        attention_backward_kernel<S, false><<<blocks_for(B * G * T), kThreads, 0, s>>>(
            dqkv.data<S>(), dout.data<S>(), qkv.data<S>(), lse.f32(), rowdot, B, T, heads, G, hd,
            dr, {});
    };
    if (dr.spec.active() || B * heads > 65535)  // grid.y of the tiled kernels, as above
      generic();
    else if (hd == 32)
      flash_backward<S, 32>(dqkv, dout, qkv, B, T, heads, G, lse, rowdot, alibi, s);
    else if (hd == 64)
      flash_backward<S, 64>(dqkv, dout, qkv, B, T, heads, G, lse, rowdot, alibi, s);
    else if (hd == 128)
      flash_backward<S, 128>(dqkv, dout, qkv, B, T, heads, G, lse, rowdot, alibi, s);
    else
      generic();
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
