// rope.hpp: what the rotary position embedding kernels (backend/cpu/rope.hpp, backend/cuda/rope.cu)
// share: the rank's heads and the inverse frequencies, including Llama 3's frequency scaling
// (Megatron's --use-rope-scaling; Hugging Face's rope_scaling {"rope_type": "llama3"}), on the host
// and the device alike.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.hpp"

namespace tessera {

// Llama 3's scaling: wavelengths longer than original_max_positions / low_freq_factor are slowed
// by `factor`, shorter than original_max_positions / high_freq_factor kept, and those between
// blended linearly in original_max_positions / wavelength. factor <= 1: no scaling.
struct RopeScaling {
  double factor = 1, low_freq_factor = 1, high_freq_factor = 4, original_max_positions = 8192;
  // YaRN (DeepSeek's MLA, --rope-type yarn): the pairs whose wavelength fits the original context
  // fewer than beta_slow times are interpolated (divided by factor), those that fit it more than
  // beta_fast times kept, a linear ramp between (the factor and original context as above).
  bool yarn = false;
  double beta_fast = 32, beta_slow = 1;
};

// Rotary position embedding of one rank's heads (Backend::rope).
struct RopeSpec {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t rot_dim = 0;  // rotated features per head: even, <= head_dim
  double base = 10000;
  int64_t seq_len = 0;  // positions r % seq_len when no position tensor is given
  RopeScaling scaling;
  // Which features pair up: (i, i + rot_dim/2) ("rotate half", the default), or (2i, 2i+1)
  // (Megatron's --rotary-interleaved, GPT-J's and Meta's original Llama layout). Pair i has
  // inverse frequency base^(-2i/rot_dim) either way.
  bool interleaved = false;
};

// The two features of pair i of a head with rot_dim rotating features.
TESSERA_HD int64_t rope_first(int64_t i, int64_t rot_dim, bool interleaved) {
  (void)rot_dim;
  return interleaved ? 2 * i : i;
}
TESSERA_HD int64_t rope_second(int64_t i, int64_t rot_dim, bool interleaved) {
  return interleaved ? 2 * i + 1 : i + rot_dim / 2;
}

// The inverse frequency of feature pair k: base^(-2k/rot_dim) rounded to f32 as Hugging Face
// computes it (then Llama 3's scaling, in double, rounded once).
TESSERA_HD float rope_inv_freq(int64_t k, int64_t rot_dim, double base, const RopeScaling& s) {
  const float inv = static_cast<float>(
      1.0 /
      pow(base, static_cast<double>(static_cast<float>(2 * k) / static_cast<float>(rot_dim))));
  if (!(s.factor > 1)) return inv;
  if (s.yarn) {
    // The pair index at which the wavelength fits the original context n times (DeepSeek's
    // find_correction_dim), floored / ceiled and clamped; the ramp from interpolated to kept.
    const double kPi = 3.14159265358979323846;
    auto at = [&](double n) {
      return rot_dim * log(s.original_max_positions / (n * 2 * kPi)) / (2 * log(base));
    };
    double lo = floor(at(s.beta_fast)), hi = ceil(at(s.beta_slow));
    lo = lo < 0 ? 0 : lo;
    hi = hi > rot_dim - 1 ? rot_dim - 1 : hi;
    if (lo == hi) hi += 0.001;
    double ramp = (static_cast<double>(k) - lo) / (hi - lo);
    ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
    const double keep = 1 - ramp;  // 1: extrapolated (kept), 0: interpolated
    return static_cast<float>(inv / s.factor * (1 - keep) + inv * keep);
  }
  const double kPi = 3.14159265358979323846;
  const double wavelen = 2 * kPi / inv;
  const double low = s.original_max_positions / s.low_freq_factor;    // longest kept blended
  const double high = s.original_max_positions / s.high_freq_factor;  // shortest blended
  if (wavelen < high) return inv;
  if (wavelen > low) return static_cast<float>(inv / s.factor);
  const double smooth = (s.original_max_positions / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
  return static_cast<float>((1 - smooth) * inv / s.factor + smooth * inv);
}

}  // namespace tessera
