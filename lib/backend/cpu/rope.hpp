// rope.hpp: rotary position embedding (RoPE) in place on the query and key heads of a fused qkv
// activation (Backend::rope). The angle of pair i at position p is p * inv_freq[i] with
// inv_freq[i] = base^(-2i/rot_dim) (core/rope.hpp, with Llama 3's scaling when asked), both in
// f32 as Hugging Face computes them; cos and sin of that f32 angle are taken in double and rounded
// once, as the CUDA kernel does.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/rope.hpp"

namespace tessera::cpu {

// qkv (N, (H+2G)*hd): the first H + G heads of each row rotate. positions (N) or null: row r at
// r % seq_len. inverse: rotate by -angle. interleaved: pairs (2i, 2i+1) instead of (i, i+half).
template <typename T>
void rope(T* qkv, int64_t N, int64_t H, int64_t G, int64_t hd, int64_t rot_dim, double base,
          const int32_t* positions, int64_t seq_len, bool inverse, const RopeScaling& scaling = {},
          bool interleaved = false) {
  const int64_t half = rot_dim / 2, heads = H + G, C3 = (H + 2 * G) * hd;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv[i] = rope_inv_freq(i, rot_dim, base, scaling);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const float pos = static_cast<float>(positions ? positions[r] : r % seq_len);
    T* row = qkv + r * C3;
    for (int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(pos * inv[i]);
      const T c = static_cast<T>(std::cos(a));
      const T s = static_cast<T>(inverse ? -std::sin(a) : std::sin(a));
      for (int64_t h = 0; h < heads; ++h) {
        T* x = row + h * hd;
        const int64_t i1 = rope_first(i, rot_dim, interleaved);
        const int64_t i2 = rope_second(i, rot_dim, interleaved);
        const T x1 = x[i1], x2 = x[i2];
        x[i1] = x1 * c - x2 * s;
        x[i2] = x2 * c + x1 * s;
      }
    }
  }
}

}  // namespace tessera::cpu
