// fp8.hpp: the two FP8 formats of Hopper's tensor cores and the one conversion Tessera uses for
// them, shared by the CPU emulation and the CUDA kernels (docs/training.md, "FP8").
//
//   E4M3 (OCP "fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; largest 448, smallest
//                    subnormal 2^-9; no infinities, one NaN pattern (S.1111.111).
//   E5M2:            1 sign, 5 exponent (bias 15), 2 mantissa bits; largest 57,344, smallest
//                    subnormal 2^-16; infinities and NaNs as IEEE.
//
// fp8_from_float is cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, format) bit for bit
// (tests/core/test_fp8.cpp compares them over a sweep of every float exponent): round to nearest
// even, finite values beyond the largest and infinities saturate to the largest of their sign,
// NaN of either sign becomes 0x7F.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/host_device.hpp"

namespace tessera {

enum class Fp8Format : uint8_t { E4M3, E5M2 };

TESSERA_HD float fp8_max(Fp8Format f) {
  return f == Fp8Format::E4M3 ? 448.0f : 57344.0f;
}

TESSERA_HD uint32_t fp8_float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
TESSERA_HD float fp8_bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

// x -> FP8 bits: round to nearest even, saturating (see the top of the file).
TESSERA_HD uint8_t fp8_from_float(float x, Fp8Format f) {
  const int mbits = f == Fp8Format::E4M3 ? 3 : 2;
  const int bias = f == Fp8Format::E4M3 ? 7 : 15;
  const uint8_t max_code = f == Fp8Format::E4M3 ? 0x7E : 0x7B;
  const uint32_t u = fp8_float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;  // NaN
  if (fp8_bits_float(a) > fp8_max(f)) return static_cast<uint8_t>(sign | max_code);
  const int32_t e = static_cast<int32_t>(a >> 23) - 127;  // unbiased exponent (-127: zero/denormal)
  uint32_t code;
  if (e >= 1 - bias) {
    // Normal in FP8: round the float's 23 mantissa bits to mbits (ties to even) on the whole
    // exponent-and-mantissa field, so a carry moves into the exponent; then rebias.
    const int shift = 23 - mbits;
    const uint32_t r = (a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u)) >> shift;
    code = r - (static_cast<uint32_t>(127 - bias) << mbits);
  } else {
    // Subnormal in FP8 (or zero): the value in units of the smallest subnormal 2^(1-bias-mbits),
    // rounded to an integer, ties to even. 2^(1-bias-mbits) > the largest float denormal, so the
    // float's own denormals round to 0. m may reach 2^mbits: the smallest normal, encoded right.
    const int drop = (1 - bias - mbits) - e;  // bits of the significand below the unit
    if (drop > 24) return sign;               // below half the smallest subnormal
    const uint32_t sig = (a & 0x7FFFFFu) | (e > -127 ? 0x800000u : 0u);  // 1.m as 24 bits
    const int s = 23 + drop;                                             // sig / 2^s in units
    if (s >= 32) return sign;
    const uint32_t half = 1u << (s - 1), rest = sig & ((1u << s) - 1u);
    uint32_t m = sig >> s;
    if (rest > half || (rest == half && (m & 1u))) ++m;
    code = m;
  }
  return static_cast<uint8_t>(sign | code);
}

// FP8 bits -> float (exact: every FP8 value is a float).
TESSERA_HD float fp8_to_float(uint8_t v, Fp8Format f) {
  const int mbits = f == Fp8Format::E4M3 ? 3 : 2;
  const int bias = f == Fp8Format::E4M3 ? 7 : 15;
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t e = (v & 0x7F) >> mbits, m = v & ((1u << mbits) - 1u);
  if (f == Fp8Format::E4M3 && (v & 0x7F) == 0x7F) return fp8_bits_float(0x7FC00000u);
  if (f == Fp8Format::E5M2 && e == 31)
    return fp8_bits_float(m == 0 ? (sign | 0x7F800000u) : 0x7FC00000u);
  if (e == 0) {  // subnormal: m * 2^(1-bias-mbits), exact in float
    float x = static_cast<float>(m);
    for (int i = 0; i < bias - 1 + mbits; ++i) x *= 0.5f;
    return sign ? -x : x;
  }
  return fp8_bits_float(sign | ((e - bias + 127) << 23) | (m << (23 - mbits)));
}

// The value a tensor element stands for after FP8 quantization with `scale`:
// fp8(x * scale) * scale_inv, scale_inv = 1 / scale (as Transformer Engine keeps it).
TESSERA_HD float fp8_quantize_dequantize(float x, float scale, float scale_inv, Fp8Format f) {
  return fp8_to_float(fp8_from_float(x * scale, f), f) * scale_inv;
}

// The scale for an amax: (fp8_max / amax) / 2^margin in f32; `fallback` where amax is 0, inf or
// NaN; the largest float where the quotient overflows (an amax in the float denormals). Current
// scaling: margin 0, fallback 1. Delayed scaling: the previous scale as fallback.
TESSERA_HD float fp8_scale_for(float amax, float fmax, int margin, float fallback) {
  const float kLargest = 3.402823466e38f;
  if (!(amax > 0) || !(amax <= kLargest)) return fallback;
  float divisor = 1.0f;
  for (int i = 0; i < margin && i < 127; ++i) divisor *= 2.0f;
  const float s = (fmax / amax) / divisor;
  return s <= kLargest ? s : kLargest;
}

// Delayed scaling's update of one tensor, Transformer Engine's (history of H rows, row h at
// history[h * stride]): row 0 takes the step's amax; the amax used is the history's maximum
// (max) or row 0 (most_recent); the rows rotate up by one (row 0 to the end) and row 0 is cleared
// for the next step; the scale becomes fp8_scale_for(amax, fmax, margin, scale).
TESSERA_HD void fp8_delayed_update_one(float* history, int64_t H, int64_t stride, float& scale,
                                       float step_amax, float fmax, bool most_recent, int margin) {
  history[0] = step_amax;
  float amax = history[0];
  if (!most_recent)
    for (int64_t h = 1; h < H; ++h) amax = history[h * stride] > amax ? history[h * stride] : amax;
  const float first = history[0];
  for (int64_t h = 0; h + 1 < H; ++h) history[h * stride] = history[(h + 1) * stride];
  history[(H - 1) * stride] = first;
  history[0] = 0;
  scale = fp8_scale_for(amax, fmax, margin, scale);
}

}  // namespace tessera
