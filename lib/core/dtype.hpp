// dtype.hpp: element types (f32, bf16, f16) and their host-side conversions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace tessera {

enum class DType { F32, BF16, F16, I32, U16 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType dtype_from_name(const std::string& name);  // throws ConfigError naming the allowed values

// bf16: the upper half of an f32, rounded to nearest even.
inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t x = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// IEEE binary16 conversions, round to nearest even, with subnormals and infinities.
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

}  // namespace tessera
