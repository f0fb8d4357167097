// rng.hpp: Philox4x32-10, a counter-based RNG: value = f(key, counter), no state, no communication.
// Every random number in Tessera (init, mock data, later dropout) is keyed by what it is for and
// the global index of the element it belongs to, so any rank can draw exactly its slice (DESIGN.md
// inv. 2).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>

namespace tessera {

using Philox4 = std::array<uint32_t, 4>;

inline Philox4 philox4x32(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(M0) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(M1) * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ k0, static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ k1, static_cast<uint32_t>(p0)};
    k0 += W0;
    k1 += W1;
  }
  return ctr;
}

// 64-bit FNV-1a: a stable id for a parameter name (the same on every rank and every run).
inline uint64_t stable_hash(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Uniform in (0, 1) from 32 random bits.
inline double uniform_open01(uint32_t x) {
  return (static_cast<double>(x) + 0.5) / 4294967296.0;
}

// Random draws for the element `index` of stream `stream` under `seed`.
class CounterRng {
 public:
  CounterRng(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}
  Philox4 bits(uint64_t index) const {
    return philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                       static_cast<uint32_t>(stream_), static_cast<uint32_t>(stream_ >> 32)},
                      static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32));
  }
  // Standard normal by Box-Muller from the first two words.
  double normal(uint64_t index) const {
    const Philox4 r = bits(index);
    const double u1 = uniform_open01(r[0]), u2 = uniform_open01(r[1]);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  double uniform(uint64_t index) const { return uniform_open01(bits(index)[0]); }

 private:
  uint64_t seed_, stream_;
};

}  // namespace tessera
