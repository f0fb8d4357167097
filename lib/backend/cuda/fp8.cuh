// fp8.cuh: FP8's memory-bound kernels as bodies that both nvcc and the host warp emulator compile
// (tests/backend/test_fp8_emu.cpp runs this exact source against the CPU reference, bit for bit):
//  - the amax of a tensor in two deterministic stages (per-block maxima, then one block), NaN
//    counted as +inf as on the CPU;
//  - quantize-and-transpose: one 32 x 32 tile per block, each element fp8(x * scale) with
//    core/fp8.hpp's conversion (cuda_fp8.h's SATFINITE one, bit for bit), written row-major
//    and/or transposed through shared memory, which is what the TN-only FP8 GEMMs of cuBLASLt
//    need (fp8.cu); block (0, 0) writes 1 / scale for the GEMM's scale pointer.
#pragma once

#include <cstdint>

#include "backend/cuda/mma.cuh"
#include "core/fp8.hpp"

namespace tessera::fp8k {

constexpr int kThreads = 256;                   // per block, every kernel here
constexpr int kTile = 32;                       // quantize-and-transpose tile edge
constexpr int kTilePitch = kTile + 4;           // shared-memory row pitch (bytes)
constexpr int kTileBytes = kTile * kTilePitch;  // shared memory per block
constexpr int64_t kMaxAmaxBlocks = 1024;        // stage-1 blocks at most

// Elements per stage-1 block of an n-element amax (a multiple of kThreads), and the blocks.
inline int64_t amax_chunk(int64_t n) {
  int64_t per = (n + kMaxAmaxBlocks - 1) / kMaxAmaxBlocks;
  per = (per + kThreads - 1) / kThreads * kThreads;
  return per > kThreads ? per : kThreads;
}
inline int64_t amax_blocks(int64_t n) {
  return n > 0 ? (n + amax_chunk(n) - 1) / amax_chunk(n) : 1;
}

TC_DEV float abs_or_inf(float v) {
  const float a = v < 0 ? -v : v;
  return a != a ? fp8_bits_float(0x7F800000u) : a;  // NaN -> +inf
}

// The maximum over the block's threads of m (every thread returns it; sh: kThreads / 32 floats).
TC_DEV float block_max(float m, float* sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = tc::shfl_xor(m, o);
    m = v > m ? v : m;
  }
  const int t = tc::thread_id();
  if (t % 32 == 0) sh[t / 32] = m;
  tc::sync_block();
  float r = 0;
  for (int w = 0; w < kThreads / 32; ++w) r = sh[w] > r ? sh[w] : r;
  tc::sync_block();
  return r;
}

// Stage 1: block b's maximum of |x| over elements [b * chunk, (b + 1) * chunk) into partial[b].
template <typename T>
TC_DEV void amax_partial(float* partial, const T* x, int64_t n, int64_t chunk, float* sh) {
  const int64_t begin = int64_t(tc::block_x()) * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  float m = 0;
  for (int64_t i = begin + tc::thread_id(); i < end; i += kThreads) {
    const float a = abs_or_inf(tc::to_f32(x[i]));
    m = a > m ? a : m;
  }
  m = block_max(m, sh);
  if (tc::thread_id() == 0) partial[tc::block_x()] = m;
}

// Stage 2 (one block): amax[0] = the maximum of the partials (and of amax[0] with accumulate).
TC_DEV void amax_final(float* amax, const float* partial, int64_t blocks, bool accumulate,
                       float* sh) {
  float m = 0;
  for (int64_t i = tc::thread_id(); i < blocks; i += kThreads) m = partial[i] > m ? partial[i] : m;
  m = block_max(m, sh);
  if (tc::thread_id() == 0) amax[0] = accumulate && amax[0] > m ? amax[0] : m;
}

// One 32 x 32 tile (tile_row, tile_col) of a (rows, cols) row-major x: q (rows, cols) and / or
// qt (cols, ldt) = fp8(x * scale[0]) (either may be null); ldt in [rows, rows rounded up to 32]:
// qt's columns from rows on are zeros (a GEMM's reduction over rows padded to a multiple of 16).
// sh: kTileBytes bytes.
template <typename T>
TC_DEV void quantize_tile(const T* x, int64_t rows, int64_t cols, const float* scale, Fp8Format f,
                          uint8_t* q, uint8_t* qt, int64_t ldt, float* scale_inv, int64_t tile_row,
                          int64_t tile_col, uint8_t* sh) {
  const int t = tc::thread_id(), c = t % kTile, r0 = t / kTile;
  const float s = scale[0];
  if (scale_inv && tile_row == 0 && tile_col == 0 && t == 0) scale_inv[0] = 1.0f / s;
  for (int k = 0; k < kTile / (kThreads / kTile); ++k) {
    const int r = r0 + k * (kThreads / kTile);
    const int64_t gr = tile_row * kTile + r, gc = tile_col * kTile + c;
    uint8_t v = 0;
    if (gr < rows && gc < cols) {
      v = fp8_from_float(tc::to_f32(x[gr * cols + gc]) * s, f);
      if (q) q[gr * cols + gc] = v;
    }
    sh[r * kTilePitch + c] = v;
  }
  if (!qt) return;  // uniform over the block
  tc::sync_block();
  for (int k = 0; k < kTile / (kThreads / kTile); ++k) {
    const int r = r0 + k * (kThreads / kTile);  // the tile's column: qt's row
    const int64_t gr = tile_col * kTile + r, gc = tile_row * kTile + c;
    if (gr < cols && gc < ldt) qt[gr * ldt + gc] = sh[c * kTilePitch + r];  // 0 past rows
  }
  tc::sync_block();  // the tile's buffer is reused by the next tile of this block
}

// Every tile of column block tile_col, rows from tile row `first` in steps of `step` (a grid
// of at most 65,535 rows of tiles).
template <typename T>
TC_DEV void quantize_tiles(const T* x, int64_t rows, int64_t cols, const float* scale, Fp8Format f,
                           uint8_t* q, uint8_t* qt, int64_t ldt, float* scale_inv, int64_t first,
                           int64_t step, uint8_t* sh) {
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  for (int64_t tr = first; tr < row_tiles; tr += step)
    quantize_tile(x, rows, cols, scale, f, q, qt, ldt, scale_inv, tr, int64_t(tc::block_x()), sh);
}

}  // namespace tessera::fp8k
