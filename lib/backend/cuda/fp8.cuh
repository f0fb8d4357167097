// fp8.cuh: FP8's memory-bound kernels as bodies that both nvcc and the host warp emulator compile
// (tests/backend/test_fp8_emu.cpp runs this exact source against the CPU reference, bit for bit):
//  - the amax of a tensor in two deterministic stages (per-block maxima, then one block), NaN
//    counted as +inf as on the CPU;
//  - quantize-and-transpose: 64 x 64 tiles, each element fp8(x * scale) with core/fp8.hpp's
//    conversion (cuda_fp8.h's SATFINITE one, bit for bit), written row-major and/or transposed
//    through shared memory, which is what the TN-only FP8 GEMMs of cuBLASLt need (fp8.cu); a
//    thread moves 8 elements at a time (16-byte loads of bf16, 8-byte stores of FP8) where the
//    widths and pointers allow, one at a time at ragged edges; block (0, 0) writes 1 / scale for
//    the GEMM's scale pointer.
#pragma once

#include <cstdint>
#include <cstring>

#include "backend/cuda/mma.cuh"
#include "core/fp8.hpp"

namespace tessera::fp8k {

constexpr int kThreads = 256;                   // per block, every kernel here
constexpr int kTile = 64;                       // quantize-and-transpose tile edge
constexpr int kVec = 8;                         // elements a thread moves at once
constexpr int kTilePitch = kTile + 4;           // shared-memory row pitch (bytes; 2-way at most)
constexpr int kTileBytes = kTile * kTilePitch;  // shared memory per block
constexpr int64_t kMaxAmaxBlocks = 1024;        // stage-1 blocks at most

// Elements per stage-1 block of an n-element amax (a multiple of 8 kThreads: each thread reads
// 8-element groups), and the blocks.
inline int64_t amax_chunk(int64_t n) {
  int64_t per = (n + kMaxAmaxBlocks - 1) / kMaxAmaxBlocks;
  constexpr int64_t kStride = int64_t(kThreads) * 8;  // a block's 8-element groups (kVec)
  per = (per + kStride - 1) / kStride * kStride;
  return per > kStride ? per : kStride;
}
inline int64_t amax_blocks(int64_t n) {
  return n > 0 ? (n + amax_chunk(n) - 1) / amax_chunk(n) : 1;
}

// n bytes (16 or 8) between suitably aligned addresses, as one access on the device.
TC_DEV void copy16(void* to, const void* from) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
#else
  std::memcpy(to, from, 16);
#endif
}
TC_DEV void copy8(void* to, const void* from) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint2*>(to) = *reinterpret_cast<const uint2*>(from);
#else
  std::memcpy(to, from, 8);
#endif
}
TC_DEV bool aligned_to(const void* p, uintptr_t n) {
  return reinterpret_cast<uintptr_t>(p) % n == 0;
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
  if (aligned_to(x, 16)) {  // 8 elements a thread at a time (16 or 32 bytes), the last group cut
    for (int64_t i = begin + int64_t(tc::thread_id()) * kVec; i < end;
         i += int64_t(kThreads) * kVec) {
      T in[kVec];
      if (i + kVec <= end) {
        for (int k = 0; k < int(sizeof(in) / 16); ++k)
          copy16(reinterpret_cast<char*>(in) + 16 * k,
                 reinterpret_cast<const char*>(x + i) + 16 * k);
      } else {
        for (int j = 0; j < kVec; ++j) in[j] = i + j < end ? x[i + j] : x[i];
      }
      for (int j = 0; j < kVec; ++j) {
        const float a = abs_or_inf(tc::to_f32(in[j]));
        m = a > m ? a : m;
      }
    }
  } else {
    for (int64_t i = begin + tc::thread_id(); i < end; i += kThreads) {
      const float a = abs_or_inf(tc::to_f32(x[i]));
      m = a > m ? a : m;
    }
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

// One 64 x 64 tile (tile_row, tile_col) of a (rows, cols) row-major x: q (rows, cols) and / or
// qt (cols, ldt) = fp8(x * scale[0]) (either may be null); ldt in [rows, rows rounded up to 64]:
// qt's columns from rows on are zeros (a GEMM's reduction over rows padded to a multiple of 16).
// Thread t moves row t / 8 (and + 32) of the tile, columns 8 (t % 8) to 8 (t % 8) + 7; for qt,
// qt-row t / 8 (and + 32) of the tile, qt-columns 8 (t % 8) on. sh: kTileBytes bytes.
template <typename T>
TC_DEV void quantize_tile(const T* x, int64_t rows, int64_t cols, const float* scale, Fp8Format f,
                          uint8_t* q, uint8_t* qt, int64_t ldt, float* scale_inv, int64_t tile_row,
                          int64_t tile_col, uint8_t* sh) {
  constexpr int kLanes = kTile / kVec, kRowsPerPass = kThreads / kLanes;
  const int t = tc::thread_id(), c0 = (t % kLanes) * kVec, r0 = t / kLanes;
  const float s = scale[0];
  if (scale_inv && tile_row == 0 && tile_col == 0 && t == 0) scale_inv[0] = 1.0f / s;
  // Whole 8-element groups as single accesses: widths multiples of 8, pointers aligned.
  const bool vec_in = cols % kVec == 0 && aligned_to(x, 16) && (sizeof(T) * kVec) % 16 == 0 &&
                      (q == nullptr || aligned_to(q, 8));
  const bool vec_t = ldt % kVec == 0 && qt != nullptr && aligned_to(qt, 8);
  for (int k = 0; k < kTile / kRowsPerPass; ++k) {
    const int r = r0 + k * kRowsPerPass;
    const int64_t gr = tile_row * kTile + r, gc = tile_col * kTile + c0;
    uint8_t v[kVec] = {};
    if (gr < rows && vec_in && gc + kVec <= cols) {
      T in[kVec];
      for (int i = 0; i < int(sizeof(in) / 16); ++i)
        copy16(reinterpret_cast<char*>(in) + 16 * i,
               reinterpret_cast<const char*>(x + gr * cols + gc) + 16 * i);
      for (int j = 0; j < kVec; ++j) v[j] = fp8_from_float(tc::to_f32(in[j]) * s, f);
      if (q) copy8(q + gr * cols + gc, v);
    } else if (gr < rows) {
      for (int j = 0; j < kVec && gc + j < cols; ++j) {
        v[j] = fp8_from_float(tc::to_f32(x[gr * cols + gc + j]) * s, f);
        if (q) q[gr * cols + gc + j] = v[j];
      }
    }
    for (int j = 0; j < kVec; ++j) sh[r * kTilePitch + c0 + j] = v[j];  // 0 outside x
  }
  if (!qt) return;  // uniform over the block
  tc::sync_block();
  for (int k = 0; k < kTile / kRowsPerPass; ++k) {
    const int r = r0 + k * kRowsPerPass;  // the tile's column: qt's row
    const int64_t gr = tile_col * kTile + r, gc = tile_row * kTile + c0;
    if (gr < cols) {
      uint8_t v[kVec];
      for (int j = 0; j < kVec; ++j) v[j] = sh[(c0 + j) * kTilePitch + r];
      if (vec_t && gc + kVec <= ldt) {
        copy8(qt + gr * ldt + gc, v);
      } else {
        for (int j = 0; j < kVec && gc + j < ldt; ++j) qt[gr * ldt + gc + j] = v[j];  // 0 past rows
      }
    }
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
