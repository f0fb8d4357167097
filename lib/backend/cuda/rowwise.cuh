// rowwise.cuh: the memory-bound reductions of the training step, as kernel bodies that both nvcc
// and the host warp emulator compile (tests/backend/test_rowwise_emu.cpp runs this exact source
// against the CPU reference):
//  - softmax cross-entropy's three passes over a (N, V) logits shard, one block per row, reading
//    16 bytes per thread per load (cross_entropy.cu);
//  - the two stages of a column sum over N rows (the bias gradient, matmul.cu; LayerNorm's and
//    RMSNorm's parameter gradients, layernorm.cu, rmsnorm.cu): stage 1 gives each thread one
//    column of a chunk of at most `chunk_rows(N)` rows (many chunks, so the grid fills the GPU and
//    each thread has few dependent loads), stage 2 sums the chunks' partials in a fixed order.
// Both are deterministic: every sum is taken in an order fixed by the shapes alone.
//
// Why (docs/performance.md, H100 2026-11-27): with one 2-byte load per thread per iteration the
// cross-entropy passes ran at ~1.2 TB/s (5.3 ms of a 49 ms GPT-2 124M step), and the old column
// sums (64 chunks of 256 rows) left LayerNorm's backward latency-bound (3.6 ms for 25 calls).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include <vector_types.h>

#include "backend/cuda/mma.cuh"

#ifdef TESSERA_WARP_EMU
#define ROWWISE_HD inline
#else
#define ROWWISE_HD __host__ __device__ __forceinline__
#endif

namespace tessera::rowwise {

constexpr int kThreads = 256;        // per block, for every kernel here (8 warps)
constexpr int kChunkRows = 32;       // rows per stage-1 chunk, at least
constexpr int64_t kMaxChunks = 512;  // chunks per column sum, at most (bounds the scratch)

// Rows per chunk and the number of chunks of an N-row column sum.
ROWWISE_HD int64_t chunk_rows(int64_t N) {
  const int64_t by_cap = (N + kMaxChunks - 1) / kMaxChunks;
  return by_cap > kChunkRows ? by_cap : kChunkRows;
}
ROWWISE_HD int64_t num_chunks(int64_t N) {
  const int64_t r = chunk_rows(N);
  return N > 0 ? (N + r - 1) / r : 0;
}

using tc::from_f32;
using tc::to_f32;

// Elements of T in one 16-byte load.
template <typename T>
constexpr int kVec = static_cast<int>(16 / sizeof(T));

template <typename T>
struct Pack {
  T e[kVec<T>];
};
template <typename T>
TC_DEV Pack<T> load16(const T* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  Pack<T> r;
  memcpy(&r, &u, 16);
  return r;
}
template <typename T>
TC_DEV void store16(T* p, const Pack<T>& v) {
  uint4 u;
  memcpy(&u, &v, 16);
  *reinterpret_cast<uint4*>(p) = u;
}
// Rows of V elements of T starting at `base` can be read 16 bytes at a time.
template <typename T>
TC_DEV bool vec_rows(const T* base, int64_t V) {
  return V % kVec<T> == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

// Sum and max over the block's kThreads threads; every thread gets the result. The warp stage is
// a butterfly (each lane adds the same two numbers as its partner, so all lanes agree), the block
// stage adds the warps in order: the result depends on the data alone. `sh`: kThreads / 32 floats.
TC_DEV float block_sum(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += tc::shfl_xor(v, o);
  const int tid = tc::thread_id();
  if (tid % 32 == 0) sh[tid / 32] = v;
  tc::sync_block();
  float t = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) t += sh[w];
  tc::sync_block();  // sh is free again
  return t;
}
TC_DEV float block_max(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, tc::shfl_xor(v, o));
  const int tid = tc::thread_id();
  if (tid % 32 == 0) sh[tid / 32] = v;
  tc::sync_block();
  float t = -INFINITY;
  for (int w = 0; w < kThreads / 32; ++w) t = fmaxf(t, sh[w]);
  tc::sync_block();
  return t;
}

// ---- cross-entropy: grid (N), block kThreads, shared kThreads / 32 floats -----------------------

// rowmax[n] = the max of row n's first `valid` logits (-inf when valid is 0).
template <typename T>
TC_DEV void xent_max(float* rowmax, const T* logits, int64_t V, int64_t valid, float* sh) {
  const int64_t n = tc::block_x();
  const int tid = tc::thread_id();
  const T* row = logits + n * V;
  float m = -INFINITY;
  int64_t j = 0;
  if (vec_rows(logits, V)) {
    const int64_t nv = valid / kVec<T>;
    for (int64_t v = tid; v < nv; v += kThreads) {
      const Pack<T> p = load16(row + v * kVec<T>);
      TC_UNROLL
      for (int e = 0; e < kVec<T>; ++e) m = fmaxf(m, to_f32(p.e[e]));
    }
    j = nv * kVec<T>;
  }
  for (j += tid; j < valid; j += kThreads) m = fmaxf(m, to_f32(row[j]));
  m = block_max(m, sh);
  if (tid == 0) rowmax[n] = m;
}

// sumexp[n] = sum over the valid logits of exp(logit - rowmax[n]); target_logit[n] = the logit
// of targets[n] if this shard (global columns col_begin ...) holds it, else 0.
template <typename T>
TC_DEV void xent_sums(float* sumexp, float* target_logit, const T* logits, const float* rowmax,
                      const int32_t* targets, int64_t V, int64_t valid, int64_t col_begin,
                      float* sh) {
  const int64_t n = tc::block_x();
  const int tid = tc::thread_id();
  const T* row = logits + n * V;
  const float m = rowmax[n];
  float s = 0.f;
  int64_t j = 0;
  if (vec_rows(logits, V)) {
    const int64_t nv = valid / kVec<T>;
    for (int64_t v = tid; v < nv; v += kThreads) {
      const Pack<T> p = load16(row + v * kVec<T>);
      TC_UNROLL
      for (int e = 0; e < kVec<T>; ++e) s += expf(to_f32(p.e[e]) - m);
    }
    j = nv * kVec<T>;
  }
  for (j += tid; j < valid; j += kThreads) s += expf(to_f32(row[j]) - m);
  s = block_sum(s, sh);
  if (tid == 0) {
    sumexp[n] = s;
    const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
    target_logit[n] = (targets[n] >= 0 && tj >= 0 && tj < valid) ? to_f32(row[tj]) : 0.f;
  }
}

// losses[n] = log(sumexp) + rowmax - target_logit (0 for an ignored row, target < 0); row n of
// the logits is overwritten with d loss / d logit * scale (0 in padding columns and ignored rows).
template <typename T>
TC_DEV void xent_loss_grad(float* losses, T* logits, const float* rowmax, const float* sumexp,
                           const float* target_logit, const int32_t* targets, int64_t V,
                           int64_t valid, int64_t col_begin, float scale) {
  const int64_t n = tc::block_x();
  const int tid = tc::thread_id();
  T* row = logits + n * V;
  const bool ignore = targets[n] < 0;
  const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
  const float m = rowmax[n], k = scale / sumexp[n];
  auto grad = [&](int64_t j, float x) {
    if (ignore || j >= valid) return 0.f;
    return expf(x - m) * k - (j == tj ? scale : 0.f);
  };
  int64_t j = 0;
  if (vec_rows(logits, V)) {
    const int64_t nv = V / kVec<T>;
    for (int64_t v = tid; v < nv; v += kThreads) {
      Pack<T> p = load16(row + v * kVec<T>);
      TC_UNROLL
      for (int e = 0; e < kVec<T>; ++e) p.e[e] = from_f32<T>(grad(v * kVec<T> + e, to_f32(p.e[e])));
      store16(row + v * kVec<T>, p);
    }
    j = V;
  }
  for (j += tid; j < V; j += kThreads) row[j] = from_f32<T>(grad(j, to_f32(row[j])));
  if (tid == 0) losses[n] = ignore ? 0.f : logf(sumexp[n]) + m - target_logit[n];
}

// ---- column sums
// ---------------------------------------------------------------------------------

// Stage 1, grid (ceil(C / kThreads), num_chunks(N)), block kThreads: for K sums at once,
// part[(k * num_chunks + chunk) * C + c] = the sum over the chunk's rows r, in order, of the k-th
// term that acc(r, c, s) adds into s[k].
template <int K, typename Acc>
TC_DEV void column_partials(float* part, int64_t N, int64_t C, const Acc& acc) {
  const int64_t c = static_cast<int64_t>(tc::block_x()) * kThreads + tc::thread_id();
  if (c >= C) return;
  const int64_t rows = chunk_rows(N), chunks = num_chunks(N), chunk = tc::block_y();
  const int64_t r0 = chunk * rows, r1 = r0 + rows < N ? r0 + rows : N;
  float s[K];
  for (int k = 0; k < K; ++k) s[k] = 0.f;
  for (int64_t r = r0; r < r1; ++r) acc(r, c, s);
  for (int k = 0; k < K; ++k) part[(k * chunks + chunk) * C + c] = s[k];
}

// Stage 2, grid (ceil(C / 32)), block kThreads (32 columns x 8 row groups), shared 8 * 33
// floats: out[c] += the sum of part[r * C + c] over r < R; thread (x, y) adds rows y, y + 8, ...
// and the 8 groups are added in order.
TC_DEV void sum_partials(float* out, const float* part, int64_t R, int64_t C, float* sh) {
  const int tid = tc::thread_id(), x = tid % 32, y = tid / 32;
  const int64_t c = static_cast<int64_t>(tc::block_x()) * 32 + x;
  float s = 0.f;
  if (c < C)
    for (int64_t r = y; r < R; r += kThreads / 32) s += part[r * C + c];
  sh[y * 33 + x] = s;
  tc::sync_block();
  if (y == 0 && c < C) {
    float t = 0.f;
    for (int g = 0; g < kThreads / 32; ++g) t += sh[g * 33 + x];
    out[c] += t;
  }
}
constexpr int kSumPartialsShared = (kThreads / 32) * 33;  // floats

// ---- LayerNorm and RMSNorm, one warp per row
// ------------------------------------------------------ Grid ceil(N / kRowsPerBlock), block
// kThreads; each warp takes one row of C elements, 16 bytes per lane per load (the launcher checks
// norm_vec_ok), reduces with shuffles only (no block barrier), and re-reads the row from L1/L2 for
// each pass instead of holding it in registers, so any C works. kRms: RMSNorm (y = x rstd w; no
// mean, no bias) instead of LayerNorm (y = (x - mean) rstd w + b). The CPU references are
// backend/cpu/layernorm.hpp and rmsnorm.hpp.
constexpr int kRowsPerBlock = kThreads / 32;

// Rows of C elements of T at these bases (null: an empty tensor, ignored) can be read 16 bytes at
// a time: the launchers' choice between the vector kernels and the element ones.
template <typename T>
inline bool norm_vec_ok(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % kVec<T> != 0) return false;
  for (const void* p : ptrs)
    if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}
// Blocks of kThreads for one warp per item (row, token or slot).
inline unsigned warp_blocks(int64_t items) {
  return static_cast<unsigned>((items + kRowsPerBlock - 1) / kRowsPerBlock);
}

TC_DEV float rsqrt(float x) {
#ifdef TESSERA_WARP_EMU
  return 1.f / std::sqrt(x);
#else
  return rsqrtf(x);
#endif
}

TC_DEV float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += tc::shfl_xor(v, o);
  return v;
}

// Few rows (generation's decode step: one row a sequence) leave the GPU waiting on each pass's
// loads in turn; there the launchers take the kernel that holds the row in registers after one
// read (kPacks > 0: up to kPacks 16-byte packs a lane, nv <= 32 kPacks), every load of it in flight
// at once. The arithmetic and its order are the streaming kernel's: the results are bitwise the
// same.
constexpr int kNormHeldPacks = 8;           // C <= 2,048 in bf16/f16, 1,024 in f32
constexpr int64_t kNormHeldMaxRows = 1024;  // training's row counts keep the streaming kernel
template <typename T>
inline bool norm_held_ok(int64_t N, int64_t C) {
  return N <= kNormHeldMaxRows && C / kVec<T> <= 32 * kNormHeldPacks;
}

// f(i, v) for this lane's packs v = lane + 32 i of a row of nv packs, in order of v; with
// kPacks > 0, i a compile-time index (the loop unrolled) so that held packs stay in registers.
template <int kPacks, typename F>
TC_DEV void each_pack(int lane, int64_t nv, F&& f) {
  if constexpr (kPacks > 0) {
    TC_UNROLL
    for (int i = 0; i < kPacks; ++i) {
      const int64_t v = lane + 32 * static_cast<int64_t>(i);
      if (v < nv) f(i, v);
    }
  } else {
    for (int64_t v = lane; v < nv; v += 32) f(0, v);
  }
}

// out = norm(x) w (+ bias), x = a, or x = a + b rounded to T and stored in `sum` when b is given
// (the residual add fused in front); mean (LayerNorm) and rstd per row. kPacks: above.
template <typename T, bool kRms, int kPacks = 0>
TC_DEV void norm_forward(T* out, float* mean, float* rstd, T* sum, const T* a, const T* b,
                         const T* w, const T* bias, int64_t N, int64_t C, float eps) {
  const int lane = tc::thread_id() % 32;
  const int64_t n = static_cast<int64_t>(tc::block_x()) * kRowsPerBlock + tc::thread_id() / 32;
  if (n >= N) return;  // the whole warp: no barrier follows
  constexpr int K = kVec<T>;
  const int64_t nv = C / K;
  const T* x = b ? sum + n * C : a + n * C;
  Pack<T> held[kPacks > 0 ? kPacks : 1];
  if constexpr (kPacks > 0) {  // every load of the row (and of b) issued before any use
    each_pack<kPacks>(lane, nv, [&](int i, int64_t v) { held[i] = load16(a + n * C + v * K); });
    if (b) {
      Pack<T> q[kPacks];
      each_pack<kPacks>(lane, nv, [&](int i, int64_t v) { q[i] = load16(b + n * C + v * K); });
      each_pack<kPacks>(lane, nv, [&](int i, int64_t v) {
        TC_UNROLL
        for (int e = 0; e < K; ++e)
          held[i].e[e] = from_f32<T>(to_f32(held[i].e[e]) + to_f32(q[i].e[e]));
        store16(sum + n * C + v * K, held[i]);
      });
    }
  }
  // This lane's pack i (at v) of x: held, or read again (from L1/L2 after the first pass).
  auto row = [&](int i, int64_t v) {
    if constexpr (kPacks > 0)
      return held[i];
    else
      return load16(x + v * K);
  };
  float s = 0.f;
  each_pack<kPacks>(lane, nv, [&](int i, int64_t v) {
    Pack<T> p;
    if constexpr (kPacks > 0) {
      p = held[i];
    } else {
      p = load16(a + n * C + v * K);
      if (b) {
        const Pack<T> q = load16(b + n * C + v * K);
        TC_UNROLL
        for (int e = 0; e < K; ++e) p.e[e] = from_f32<T>(to_f32(p.e[e]) + to_f32(q.e[e]));
        store16(sum + n * C + v * K, p);
      }
    }
    TC_UNROLL
    for (int e = 0; e < K; ++e) s += kRms ? to_f32(p.e[e]) * to_f32(p.e[e]) : to_f32(p.e[e]);
  });
  s = warp_sum(s);
  float m = 0.f, r;
  if (kRms) {
    r = rsqrt(s / C + eps);
  } else {
    m = s / C;
    float var = 0.f;
    each_pack<kPacks>(lane, nv, [&](int i, int64_t v) {
      const Pack<T> p = row(i, v);
      TC_UNROLL
      for (int e = 0; e < K; ++e) {
        const float d = to_f32(p.e[e]) - m;
        var += d * d;
      }
    });
    r = rsqrt(warp_sum(var) / C + eps);
  }
  each_pack<kPacks>(lane, nv, [&](int i, int64_t v) {
    const Pack<T> p = row(i, v), pw = load16(w + v * K);
    Pack<T> o;
    if (kRms) {
      TC_UNROLL
      for (int e = 0; e < K; ++e) o.e[e] = from_f32<T>(to_f32(p.e[e]) * r * to_f32(pw.e[e]));
    } else {
      const Pack<T> pb = load16(bias + v * K);
      TC_UNROLL
      for (int e = 0; e < K; ++e)
        o.e[e] = from_f32<T>((to_f32(p.e[e]) - m) * r * to_f32(pw.e[e]) + to_f32(pb.e[e]));
    }
    store16(out + n * C + v * K, o);
  });
  if (lane == 0) {
    if (!kRms) mean[n] = m;
    rstd[n] = r;
  }
}

// dinp += the input gradient of the norm: LayerNorm (dn - mean(dn) - xhat mean(dn xhat)) rstd,
// RMSNorm (dn - xhat mean(dn xhat)) rstd, with dn = w dy and xhat the normalized input.
template <typename T, bool kRms>
TC_DEV void norm_backward_input(T* dinp, const T* dout, const T* inp, const T* w, const float* mean,
                                const float* rstd, int64_t N, int64_t C) {
  const int lane = tc::thread_id() % 32;
  const int64_t n = static_cast<int64_t>(tc::block_x()) * kRowsPerBlock + tc::thread_id() / 32;
  if (n >= N) return;
  constexpr int K = kVec<T>;
  const int64_t nv = C / K;
  const T* x = inp + n * C;
  const T* dy = dout + n * C;
  const float m = kRms ? 0.f : mean[n], r = rstd[n];
  float sa = 0.f, sb = 0.f;
  for (int64_t v = lane; v < nv; v += 32) {
    const Pack<T> px = load16(x + v * K), pd = load16(dy + v * K), pw = load16(w + v * K);
    TC_UNROLL
    for (int e = 0; e < K; ++e) {
      const float dn = to_f32(pw.e[e]) * to_f32(pd.e[e]), xhat = (to_f32(px.e[e]) - m) * r;
      sa += dn;
      sb += dn * xhat;
    }
  }
  const float dmean = kRms ? 0.f : warp_sum(sa) / C, dnm = warp_sum(sb) / C;
  for (int64_t v = lane; v < nv; v += 32) {
    const Pack<T> px = load16(x + v * K), pd = load16(dy + v * K), pw = load16(w + v * K);
    Pack<T> g = load16(dinp + n * C + v * K);
    TC_UNROLL
    for (int e = 0; e < K; ++e) {
      const float dn = to_f32(pw.e[e]) * to_f32(pd.e[e]), xhat = (to_f32(px.e[e]) - m) * r;
      g.e[e] = from_f32<T>(to_f32(g.e[e]) + (dn - dmean - xhat * dnm) * r);
    }
    store16(dinp + n * C + v * K, g);
  }
}

}  // namespace tessera::rowwise
