// fp8.hpp: FP8 quantization and scaling on the CPU, the reference of the FP8 GEMMs
// (docs/training.md, "FP8"): the conversion is core/fp8.hpp's (cuda_fp8.h's SATFINITE conversion
// bit for bit); a GEMM of quantized operands is the f32 GEMM of their dequantized values.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/fp8.hpp"

namespace tessera::cpu {

// max |x| over n elements; NaN counts as +inf (so that the maximum over ranks is well defined
// and the scale falls back as for an infinite amax).
inline float fp8_amax(const float* x, int64_t n) {
  float m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (std::isnan(a)) return std::numeric_limits<float>::infinity();
    m = a > m ? a : m;
  }
  return m;
}

// Current (tensorwise) scaling: fp8_max / amax in f32; 1 where amax is 0, inf or NaN; the largest
// float where the quotient overflows (an amax in the float denormals).
inline float fp8_current_scale(float amax, Fp8Format f) {
  return fp8_scale_for(amax, fp8_max(f), 0, 1.0f);
}

// Delayed scaling, Transformer Engine's update for one tensor (core/fp8.hpp).
inline void fp8_delayed_update(float* history, int64_t H, int64_t stride, float& scale,
                               float step_amax, float fmax, bool most_recent, int margin) {
  fp8_delayed_update_one(history, H, stride, scale, step_amax, fmax, most_recent, margin);
}

// out = fp8(in * scale) / scale for n elements (scale_inv = 1 / scale in f32, as Transformer
// Engine keeps it).
inline void fp8_quantize_dequantize(float* out, const float* in, int64_t n, float scale,
                                    Fp8Format f) {
  const float inv = 1.0f / scale;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = fp8_quantize_dequantize(in[i], scale, inv, f);
}

}  // namespace tessera::cpu
