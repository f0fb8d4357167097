// dtype.cpp: element type names, sizes and the f16 conversion.
#include "core/dtype.hpp"

#include "core/error.hpp"

namespace tessera {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::U16:
      return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::I32:
      return "i32";
    case DType::U16:
      return "u16";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::F32;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::F16;
  throw ConfigError("unknown dtype '" + name + "' (allowed: f32, bf16, f16)");
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absx < 0x38800000u) {  // subnormal or zero in f16
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(absx >> 23);  // 14..24 (113 - exp + 13)
    const uint32_t rshift = static_cast<uint32_t>(shift);
    uint32_t half = mant >> rshift;
    const uint32_t rem = mant & ((1u << rshift) - 1u);
    const uint32_t halfway = 1u << (rshift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) half++;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t h = ((absx >> 13) - ((127 - 15) << 10));
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return static_cast<uint16_t>(sign | h);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        exp--;
      }
      mant &= 0x3ffu;
      x = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace tessera
