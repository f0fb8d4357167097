// ring.cuh: the kernels of context parallelism's ring attention (Backend::attention_merge and
// Backend::copy_columns), as bodies that nvcc and the host warp emulator both compile
// (tests/backend/test_ring_emu.cpp runs this source against backend/cpu/ring_attention.hpp):
//  - merge: one warp per (sample, query row, head) of a block's partial result; the lanes read
//    the two log-sum-exps, rescale the head's hd features (f32 arithmetic, rounded once to the
//    storage type) and lane 0 writes the merged log-sum-exp after the warp has read the old one;
//  - copy_columns: one warp per row, a column range from one row-major tensor to another (the K/V
//    heads out of qkv for the ring, dK/dV back into dqkv).
// Launch: block kThreads (8 warps), grid rowwise::warp_blocks(items).
#pragma once

#include <cmath>
#include <cstdint>

#include "backend/cuda/rowwise.cuh"

namespace tessera::ring_kernels {

constexpr int kThreads = rowwise::kThreads;
constexpr int kWarps = kThreads / 32;

// out (B,Tn,H*hd), lse (B,H,Tn) at rows [q0, q0 + nq) with part_out (B,nq,H*hd), part_lse (B,H,nq).
template <typename T>
TC_DEV void merge(T* out, float* lse, const T* part_out, const float* part_lse, int64_t B,
                  int64_t Tn, int64_t H, int64_t hd, int64_t q0, int64_t nq) {
  const int lane = tc::thread_id() % 32;
  const int64_t item = static_cast<int64_t>(tc::block_x()) * kWarps + tc::thread_id() / 32;
  if (item >= B * nq * H) return;  // warp-uniform
  const int64_t h = item % H, i = (item / H) % nq, bb = item / (H * nq);
  float* L = lse + (bb * H + h) * Tn + q0 + i;
  const float a = *L, b = part_lse[(bb * H + h) * nq + i];
  const float ninf = -INFINITY;
  if (b == ninf) return;  // warp-uniform: the block saw no key for this row
  const float hi = a > b ? a : b, lo = a > b ? b : a;
  const float merged = lo == ninf ? hi : hi + log1pf(expf(lo - hi));
  const float wa = a == ninf ? 0.f : expf(a - merged), wb = expf(b - merged);
  T* o = out + ((bb * Tn + q0 + i) * H + h) * hd;
  const T* p = part_out + ((bb * nq + i) * H + h) * hd;
  for (int64_t d = lane; d < hd; d += 32)
    o[d] = tc::from_f32<T>(tc::to_f32(o[d]) * wa + tc::to_f32(p[d]) * wb);
  tc::sync_warp();  // every lane has read *L
  if (lane == 0) *L = merged;
}

// dst[r, dst_col + c] = src[r, src_col + c] for c < cols, rows r < rows (one warp per row).
template <typename T>
TC_DEV void copy_columns(T* dst, int64_t dst_width, int64_t dst_col, const T* src,
                         int64_t src_width, int64_t src_col, int64_t rows, int64_t cols) {
  const int lane = tc::thread_id() % 32;
  const int64_t r = static_cast<int64_t>(tc::block_x()) * kWarps + tc::thread_id() / 32;
  if (r >= rows) return;
  T* d = dst + r * dst_width + dst_col;
  const T* s = src + r * src_width + src_col;
  for (int64_t c = lane; c < cols; c += 32) d[c] = s[c];
}

// `blocks` such copies of `cols` columns in one launch (Backend::copy_column_blocks: MLA's
// per-head assembly), one warp per row: block b from src column src_col + b * src_stride to dst
// column dst_col + b * dst_stride (src_stride 0 repeats one block).
template <typename T>
TC_DEV void copy_column_blocks(T* dst, int64_t dst_width, int64_t dst_col, int64_t dst_stride,
                               const T* src, int64_t src_width, int64_t src_col, int64_t src_stride,
                               int64_t rows, int64_t cols, int64_t blocks) {
  const int lane = tc::thread_id() % 32;
  const int64_t r = static_cast<int64_t>(tc::block_x()) * kWarps + tc::thread_id() / 32;
  if (r >= rows) return;
  for (int64_t b = 0; b < blocks; ++b) {
    T* d = dst + r * dst_width + dst_col + b * dst_stride;
    const T* s = src + r * src_width + src_col + b * src_stride;
    for (int64_t c = lane; c < cols; c += 32) d[c] = s[c];
  }
}

}  // namespace tessera::ring_kernels
