// flash_decode.cuh: attention of new queries over a KV cache for generation, split along the cached
// positions (flash-decoding): a decode step has one query per (sequence, head), too few to fill a
// GPU one block each, so each (row, head) gets `splits` blocks, each block a chunk of the cached
// positions. A block's threads form groups of L lanes; a group takes one cached position at a
// time, each lane F = hd / L features of it (one 16-byte load when F elements make 16 bytes), so a
// warp reads 32 / L whole key rows per step, coalesced. Each group keeps an online softmax
// (running max, sum, and its lanes' slice of the weighted values); the block merges its groups in
// shared memory and writes its split's partial result; the last of a head's splits to finish (a
// count per head, atomic) merges them all by log-sum-exp, in split order (the same result
// whichever block is last). With one split the block writes the normalized output itself. One
// kernel either way: a decode step's attention is one launch a layer.
//
// Scores are kept in base 2 (scale * log2 e folded into the dot product; ALiBi's slope * (j - i)
// too), as flash_attention_tc.cuh does. The kernel bodies are plain functions over tc::thread_id /
// block_x / block_y / shfl_xor / sync_block (mma.cuh), so tests/backend/test_decode_emu.cpp runs
// this exact source on the host under the warp emulator against the CPU reference
// (backend/cpu/kv_attention.hpp).
//
// The kernels see only the rows they attend for: `rows` lists them (a prefill segment taken by the
// tensor-core training kernel is left out, kv_attention.cu), each with its row in qkv and out.
// Every listed row's own position (`last`) is read from qkv, where its key and value are, not from
// the cache: the same values, and no order between the cache's store and these kernels. With
// `store` (a decode step: one new token per sequence, no two rows of a slot), the kernel also
// writes that key and value into the cache, one block per (row, key/value head): the block of the
// group's first query head whose split holds the position. That is the decode step's KV-cache
// store without its own kernel (kv_store_kernel, one launch a layer fewer).
#pragma once

#include <algorithm>
#include <cstdint>

#include "backend/cuda/mma.cuh"
#include "core/alibi.hpp"

namespace tessera::decode {

constexpr int kThreads = 128;  // per block (4 warps)
constexpr int kMaxF = 32;      // features per lane, at most (hd <= 32 * kMaxF)

struct Params {
  const void* qkv;  // (rows, (H + 2G) hd), storage type T
  void* k_cache;    // (slots, G, Tmax, hd), T; written only with `store`
  void* v_cache;
  void* out;            // (rows, H hd), T
  float* part_o;        // (splits, rows H, hd): unnormalized partial outputs (splits > 1)
  float* part_ml;       // (splits, rows H, 2): each split's max and sum, base 2
  unsigned* counters;   // (rows H): splits finished per query head (splits > 1); zero between
                        // launches (the merging block resets its count)
  const int32_t* rows;  // (nrows, 3): each query's cache slot, position, and row in qkv and out
  int H, G, hd, Tmax, nrows;
  int splits, chunk;  // split s covers positions [s chunk, (s + 1) chunk)
  int L, F;           // lanes per cached position, features per lane (L F = hd)
  float scale_log2;   // log2(e) / sqrt(hd)
  bool store;         // write each row's key and value at its position (a decode step)
  bool alibi;
  AttentionAlibi slopes;
};

// The lane split of a head dimension for storage of `elem_bytes`-byte elements: 16-byte loads
// (vec) when hd / (16 / elem_bytes) is a power of two <= 32; else the largest power of two <= 32
// dividing hd lanes, element loads. F = 0 when no split has F <= kMaxF.
struct LaneSplit {
  int L = 0, F = 0;
  bool vec = false;
};
inline LaneSplit lane_split(int hd, int elem_bytes) {
  auto pow2 = [](int v) { return v > 0 && (v & (v - 1)) == 0; };
  const int E = 16 / elem_bytes;
  if (hd % E == 0 && pow2(hd / E) && hd / E <= 32) return {hd / E, E, true};
  int L = 1;
  while (L < 32 && hd % (2 * L) == 0) L *= 2;
  if (hd / L > kMaxF) return {};
  return {L, hd / L, false};
}

using tc::from_f32;
using tc::to_f32;

// x[0, F) = p[0, F) as f32: one 16-byte load when kVec (F elements are 16 bytes, p aligned).
template <typename T, bool kVec>
TC_DEV void load_features(float (&x)[kMaxF], const T* p, int F) {
  if constexpr (kVec) {
    constexpr int E = 16 / sizeof(T);
    T v[E];
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(static_cast<void*>(v), &raw, 16);
    TC_UNROLL
    for (int f = 0; f < E; ++f) x[f] = to_f32(v[f]);
  } else {
    for (int f = 0; f < F; ++f) x[f] = to_f32(p[f]);
  }
}

// The splits of query head rh (= i * H + h of the partials) merged by log-sum-exp, in split order,
// into its row of out; the partials are read past L1 (other blocks wrote them in this kernel).
template <typename T>
TC_DEV void combine_head(const Params& p, int64_t rh) {
  const int tid = tc::thread_id();
  const int64_t out_rh = static_cast<int64_t>(p.rows[3 * (rh / p.H) + 2]) * p.H + rh % p.H;
  const int64_t stride = static_cast<int64_t>(p.nrows) * p.H;
  float M = -INFINITY;
  for (int s = 0; s < p.splits; ++s) M = fmaxf(M, tc::load_l2(&p.part_ml[(s * stride + rh) * 2]));
  float sum = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float ms = tc::load_l2(&p.part_ml[(s * stride + rh) * 2]);
    if (ms != -INFINITY)
      sum += tc::load_l2(&p.part_ml[(s * stride + rh) * 2 + 1]) * tc::ex2(ms - M);
  }
  for (int d = tid; d < p.hd; d += kThreads) {
    float o = 0.f;
    for (int s = 0; s < p.splits; ++s) {
      const float ms = tc::load_l2(&p.part_ml[(s * stride + rh) * 2]);
      if (ms != -INFINITY)
        o += tc::load_l2(&p.part_o[(s * stride + rh) * p.hd + d]) * tc::ex2(ms - M);
    }
    static_cast<T*>(p.out)[out_rh * p.hd + d] = from_f32<T>(o / sum);
  }
}

// Block (block_x = i * H + h, block_y = split): this split's positions of query head h of the
// i-th listed row. smem: (kThreads / L) groups x (hd + 2) floats.
template <typename T, bool kVec>
TC_DEV void partial_body(const Params& p, char* smem_raw) {
  constexpr int F_ = kVec ? 16 / static_cast<int>(sizeof(T)) : kMaxF;
  const int tid = tc::thread_id();
  const int bx = tc::block_x(), split = tc::block_y();
  const int i = bx / p.H, h = bx % p.H, g = h / (p.H / p.G);
  const int L = p.L, F = kVec ? F_ : p.F, hd = p.hd;
  const int group = tid / L, sub = tid % L, groups = kThreads / L;
  const int slot = p.rows[3 * i], last = p.rows[3 * i + 1], row = p.rows[3 * i + 2];
  const T* qrow = static_cast<const T*>(p.qkv) + static_cast<int64_t>(row) * (p.H + 2 * p.G) * hd;
  const T* q = qrow + static_cast<int64_t>(h) * hd + sub * F;
  // The row's own key and value (position `last`), in qkv.
  const T* k_new = qrow + static_cast<int64_t>(p.H + g) * hd;
  const T* v_new = qrow + static_cast<int64_t>(p.H + p.G + g) * hd;
  const int64_t cache_off = (static_cast<int64_t>(slot) * p.G + g) * p.Tmax * hd;
  const T* K = static_cast<const T*>(p.k_cache) + cache_off + sub * F;
  const T* V = static_cast<const T*>(p.v_cache) + cache_off + sub * F;
  const int store_split = last / p.chunk < p.splits ? last / p.chunk : p.splits - 1;
  if (p.store && h % (p.H / p.G) == 0 && split == store_split) {
    T* kc = static_cast<T*>(p.k_cache) + cache_off + static_cast<int64_t>(last) * hd;
    T* vc = static_cast<T*>(p.v_cache) + cache_off + static_cast<int64_t>(last) * hd;
    for (int d = tid; d < hd; d += kThreads) {
      kc[d] = k_new[d];
      vc[d] = v_new[d];
    }
  }
  float qf[kMaxF], acc[kMaxF], x[kMaxF];
  load_features<T, kVec>(qf, q, F);
  for (int f = 0; f < F; ++f) {
    qf[f] *= p.scale_log2;
    acc[f] = 0.f;
  }
  const float slope = p.alibi ? p.slopes.slope(h) * 1.4426950408889634f : 0.f;
  const int begin = split * p.chunk;
  const int end = begin + p.chunk < last + 1 ? begin + p.chunk : last + 1;  // may be <= begin
  float m = -INFINITY, l = 0.f;
  // Every lane runs the same number of steps (the shuffles need the whole warp).
  const int steps = end > begin ? (end - begin + groups - 1) / groups : 0;
  for (int it = 0; it < steps; ++it) {
    const int j = begin + it * groups + group;
    const bool live = j < end;
    float dot = 0.f;
    if (live) {
      load_features<T, kVec>(x, j == last ? k_new + sub * F : K + static_cast<int64_t>(j) * hd, F);
      for (int f = 0; f < F; ++f) dot += qf[f] * x[f];
    }
    for (int o = 1; o < L; o *= 2) dot += tc::shfl_xor(dot, o);
    if (!live) continue;
    const float s = dot + slope * static_cast<float>(j - last);
    if (s == -INFINITY) continue;  // weight 0 (a non-finite dot product), as on the CPU
    const float mn = fmaxf(m, s);
    const float corr = tc::ex2(m - mn), pj = tc::ex2(s - mn);  // m = -inf: corr = 0
    l = l * corr + pj;
    load_features<T, kVec>(x, j == last ? v_new + sub * F : V + static_cast<int64_t>(j) * hd, F);
    for (int f = 0; f < F; ++f) acc[f] = acc[f] * corr + pj * x[f];
    m = mn;
  }
  // Merge the groups: each publishes its max, sum and slice of the values.
  float* sm = reinterpret_cast<float*>(smem_raw);
  float* gm = sm + static_cast<int64_t>(groups) * hd;  // (groups, 2)
  for (int f = 0; f < F; ++f) sm[group * hd + sub * F + f] = acc[f];
  if (sub == 0) {
    gm[2 * group] = m;
    gm[2 * group + 1] = l;
  }
  tc::sync_block();
  float M = -INFINITY;
  for (int k = 0; k < groups; ++k) M = fmaxf(M, gm[2 * k]);
  float sum = 0.f;
  for (int k = 0; k < groups; ++k)
    if (gm[2 * k] != -INFINITY) sum += gm[2 * k + 1] * tc::ex2(gm[2 * k] - M);
  const int64_t ih = static_cast<int64_t>(i) * p.H + h;    // in the partials
  const int64_t rh = static_cast<int64_t>(row) * p.H + h;  // in out
  for (int d = tid; d < hd; d += kThreads) {
    float o = 0.f;
    for (int k = 0; k < groups; ++k)
      if (gm[2 * k] != -INFINITY) o += sm[k * hd + d] * tc::ex2(gm[2 * k] - M);
    if (p.splits == 1)
      static_cast<T*>(p.out)[rh * hd + d] = from_f32<T>(o / sum);
    else
      p.part_o[(static_cast<int64_t>(split) * p.nrows * p.H + ih) * hd + d] = o;
  }
  if (p.splits == 1) return;
  if (tid == 0) {
    float* ml = p.part_ml + (static_cast<int64_t>(split) * p.nrows * p.H + ih) * 2;
    ml[0] = M;
    ml[1] = sum;
  }
  // Every thread's partials out to the device before the count (threadFenceReduction's order);
  // the block that brings the count to `splits` merges the head and resets the count.
  tc::fence_device();
  unsigned* merges = reinterpret_cast<unsigned*>(gm + 2 * groups);
  tc::sync_block();  // also: every thread is done reading sm and gm
  if (tid == 0)
    *merges = tc::atomic_add_device(p.counters + ih, 1u) == static_cast<unsigned>(p.splits - 1);
  tc::sync_block();
  if (*merges == 0) return;  // block-uniform
  tc::fence_device();
  combine_head<T>(p, ih);
  if (tid == 0) p.counters[ih] = 0;
}

inline int smem_bytes(const Params& p) {  // + the merging flag
  return static_cast<int>(sizeof(float)) * (kThreads / p.L) * (p.hd + 2) + 16;
}

// How many splits for `nrows` queries of `H` heads whose longest context is `max_len`: enough
// blocks to fill the GPU (`target_blocks`, about two per SM), none shorter than 32 positions.
inline void plan_splits(Params& p, int max_len, int target_blocks) {
  const int64_t heads = static_cast<int64_t>(p.nrows) * p.H;
  int splits = static_cast<int>((target_blocks + heads - 1) / heads);
  splits = std::max(1, std::min(splits, (max_len + 31) / 32));
  p.chunk = (max_len + splits - 1) / splits;
  p.splits = (max_len + p.chunk - 1) / p.chunk;
}

}  // namespace tessera::decode
