// mma.cuh: the warp-level primitives the tensor-core attention (flash_attention_tc.cuh) is written
// against: mma.sync m16n8k16 with f32 accumulation, ldmatrix (plain and transposed), cp.async with
// zero fill, quad shuffles and the block/warp barriers.
//
// Each primitive has two implementations. Compiled by nvcc for the device, it is the PTX
// instruction. Compiled with TESSERA_WARP_EMU defined (host C++, tests/backend/warp_emu.hpp), it
// is a literal transcription of the PTX ISA's definition of the instruction (which lane holds which
// matrix element), executed by one host thread per CUDA thread with barriers standing in for the
// warp's lock-step: that lets a machine without a GPU run the kernels' exact source against the
// CPU reference (test_flash_emu). The fragment layouts, from the PTX ISA ("Matrix Fragments for
// mma.m16n8k16 with floating point type"; groupID g = lane / 4, t = lane % 4):
//   A (16x16, row-major), 4 registers of 2 elements: a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..),
//     a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16x8, k x n), 2 registers: b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
//   C/D (16x8 f32): c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i of lane l then
// holds row l/4, columns 2(l%4)..+1 of matrix i (.trans: rows 2(l%4)..+1 of column l/4).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#ifdef TESSERA_WARP_EMU
// The including test (tests/backend/warp_emu.hpp) has defined tessera::tc::emu: thread identity,
// barriers and the warp's exchange slots.
#include <cmath>
#include <cstring>
#include <type_traits>
#define TC_DEV inline
#define TC_UNROLL
#else
#include <type_traits>
#define TC_DEV __device__ __forceinline__
#define TC_UNROLL _Pragma("unroll")
#endif

namespace tessera::tc {

// ---- thread identity and barriers ---------------------------------------------------------------

#ifdef TESSERA_WARP_EMU
TC_DEV int thread_id() {
  return emu::self().tid;
}
TC_DEV int block_x() {
  return emu::self().bx;
}
TC_DEV int block_y() {
  return emu::self().by;
}
TC_DEV void sync_block() {
  emu::self().block->bar.wait();
}
TC_DEV void sync_warp() {
  emu::warp().bar.wait();
}
// Blocks run one after another here: the device-wide fence has nothing to order, and the count
// is a plain read-modify-write under the emulator's lock.
TC_DEV void fence_device() {}
TC_DEV unsigned atomic_add_device(unsigned* p, unsigned v) {
  return emu::atomic_add(p, v);
}
template <typename T>
TC_DEV T load_l2(const T* p) {
  return *p;
}
#else
TC_DEV int thread_id() {
  return static_cast<int>(threadIdx.x);
}
TC_DEV int block_x() {
  return static_cast<int>(blockIdx.x);
}
TC_DEV int block_y() {
  return static_cast<int>(blockIdx.y);
}
TC_DEV void sync_block() {
  __syncthreads();
}
TC_DEV void sync_warp() {
  __syncwarp();
}
// __threadfence: this thread's writes are seen device-wide before its later ones.
TC_DEV void fence_device() {
  __threadfence();
}
TC_DEV unsigned atomic_add_device(unsigned* p, unsigned v) {
  return atomicAdd(p, v);
}
// A load that bypasses L1 (what other blocks wrote during this kernel).
template <typename T>
TC_DEV T load_l2(const T* p) {
  return __ldcg(p);
}
#endif

// ---- element packing
// ------------------------------------------------------------------------------

// Two f32 values rounded to T and packed into one 32-bit register, the first in the low half (the
// lower column index of a fragment pair).
template <typename T>
TC_DEV uint32_t pack2(float lo, float hi);
template <>
TC_DEV uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}
template <>
TC_DEV uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}

#ifdef TESSERA_WARP_EMU
template <typename T>
inline float unpack(uint32_t r, int half) {
  const uint16_t bits = static_cast<uint16_t>(half ? r >> 16 : r & 0xffffu);
  T v;
  std::memcpy(static_cast<void*>(&v), &bits, 2);
  return static_cast<float>(v);
}
#endif

#ifdef TESSERA_WARP_EMU
inline float rsqrtf(float x) {
  return 1.f / std::sqrt(x);
}
#endif

// One element of storage type T (f32, bf16, f16) as f32, and an f32 rounded to T (nearest even).
template <typename T>
TC_DEV float to_f32(T v) {
  if constexpr (std::is_same<T, float>::value)
    return v;
  else if constexpr (std::is_same<T, __nv_bfloat16>::value)
    return __bfloat162float(v);
  else
    return __half2float(v);
}
template <typename T>
TC_DEV T from_f32(float v) {
  if constexpr (std::is_same<T, float>::value)
    return v;
  else if constexpr (std::is_same<T, __nv_bfloat16>::value)
    return __float2bfloat16_rn(v);
  else
    return __float2half_rn(v);
}

// 2^x. On the device the MUFU approximation with flush-to-zero (2 ulp; exp2(-inf) = +0), one
// instruction where exp2f without --use_fast_math adds a range fix-up.
TC_DEV float ex2(float x) {
#ifdef TESSERA_WARP_EMU
  return std::exp2(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// ---- shuffles within a quad (the 4 lanes that share a row of an accumulator)
// ----------------------

TC_DEV float shfl_xor(float v, int mask) {
#ifdef TESSERA_WARP_EMU
  emu::Warp& w = emu::warp();
  const int lane = emu::self().tid % 32;
  w.f[lane] = v;
  w.bar.wait();
  const float r = w.f[lane ^ mask];
  w.bar.wait();
  return r;
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}
TC_DEV float quad_max(float v) {
  v = fmaxf(v, shfl_xor(v, 1));
  return fmaxf(v, shfl_xor(v, 2));
}
TC_DEV float quad_sum(float v) {
  v += shfl_xor(v, 1);
  return v + shfl_xor(v, 2);
}

// ---- ldmatrix
// ------------------------------------------------------------------------------------

// r[i] = this lane's fragment of the 8x8 matrix whose rows lanes 8i..8i+7 point at (16-byte
// aligned shared-memory addresses of 8 consecutive 16-bit elements).
template <bool kTrans>
TC_DEV void ldsm_x4(uint32_t (&r)[4], const void* row) {
#ifdef TESSERA_WARP_EMU
  emu::Warp& w = emu::warp();
  const int lane = emu::self().tid % 32;
  emu::require_aligned16(row, "ldmatrix row address");
  w.p[lane] = row;
  w.bar.wait();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!kTrans) {
      const uint16_t* src = static_cast<const uint16_t*>(w.p[8 * i + lane / 4]) + 2 * (lane % 4);
      lo = src[0];
      hi = src[1];
    } else {
      lo = static_cast<const uint16_t*>(w.p[8 * i + 2 * (lane % 4)])[lane / 4];
      hi = static_cast<const uint16_t*>(w.p[8 * i + 2 * (lane % 4) + 1])[lane / 4];
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  w.bar.wait();
#else
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

// ---- mma.sync m16n8k16, f32 accumulate
// ------------------------------------------------------------

// d += A (16x16) * B (16x8); A and B in T (bf16 or f16), d in f32.
template <typename T>
TC_DEV void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef TESSERA_WARP_EMU
  emu::Warp& w = emu::warp();
  const int lane = emu::self().tid % 32;
  for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.bar.wait();
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    float s = 0.f;
    for (int k = 0; k < 16; ++k) {
      // A(row, k): lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k & 1.
      const float av =
          unpack<T>(w.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k & 1);
      // B(k, col): lane col * 4 + (k % 8) / 2, register k >= 8, half k & 1.
      const float bv = unpack<T>(w.b[col * 4 + (k % 8) / 2][k >= 8], k & 1);
      s += av * bv;
    }
    d[e] += s;
  }
  w.bar.wait();
#else
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ---- cp.async (global -> shared, 16 bytes, zero-filled when !valid)
// -------------------------------

TC_DEV void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef TESSERA_WARP_EMU
  emu::require_aligned16(smem, "cp.async shared address");
  emu::require_aligned16(gmem, "cp.async global address");
  if (valid)
    std::memcpy(smem, gmem, 16);
  else
    std::memset(smem, 0, 16);
#else
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
#endif
}
TC_DEV void cp_async_commit() {
#ifndef TESSERA_WARP_EMU
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
TC_DEV void cp_async_wait() {
#ifndef TESSERA_WARP_EMU
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace tessera::tc
