// unicode.cpp: UTF-8 decoding and character classes for the Hugging Face tokenizer.
#include "data/unicode.hpp"

#include <unicode/uchar.h>

#include <array>
#include <cstdio>

namespace tessera {

namespace {

uint8_t icu_class(uint32_t cp) {
  const UChar32 c = static_cast<UChar32>(cp);
  uint8_t cls = u_isUWhiteSpace(c) ? kClsWs : 0;
  switch (u_charType(c)) {
    case U_UPPERCASE_LETTER:
      return cls | kClsLu;
    case U_LOWERCASE_LETTER:
      return cls | kClsLl;
    case U_TITLECASE_LETTER:
      return cls | kClsLt;
    case U_MODIFIER_LETTER:
      return cls | kClsLm;
    case U_OTHER_LETTER:
      return cls | kClsLo;
    case U_NON_SPACING_MARK:
    case U_ENCLOSING_MARK:
    case U_COMBINING_SPACING_MARK:
      return cls | kClsM;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return cls | kClsN;
    default:
      return cls;
  }
}

// The Basic Multilingual Plane from a table (most text never leaves it), the rest from ICU.
const std::array<uint8_t, 0x10000>& bmp_classes() {
  static const std::array<uint8_t, 0x10000> table = [] {
    std::array<uint8_t, 0x10000> t{};
    for (uint32_t cp = 0; cp < 0x10000; ++cp) t[cp] = icu_class(cp);
    return t;
  }();
  return table;
}

}  // namespace

uint8_t unicode_class(uint32_t cp) {
  if (cp < 0x10000) return bmp_classes()[cp];
  return icu_class(cp);
}

bool utf8_sanitize(std::string_view in, std::string& out) {
  // The WHATWG UTF-8 decoder (encoding.spec.whatwg.org): a sequence is cut at the first byte
  // outside its allowed range, which is then read again as the start of the next sequence.
  const size_t n = in.size();
  size_t i = 0;
  // Fast path: the valid prefix.
  auto valid_at = [&](size_t p, size_t& len) -> bool {
    const unsigned char c = static_cast<unsigned char>(in[p]);
    auto byte = [&](size_t k) -> unsigned { return static_cast<unsigned char>(in[p + k]); };
    if (c < 0x80) {
      len = 1;
      return true;
    }
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      len = 0;  // not a lead byte
      return false;
    }
    size_t k = 1;
    for (; k < len; ++k) {
      if (p + k >= n) break;
      const unsigned b = byte(k);
      if (b < (k == 1 ? lo : 0x80u) || b > (k == 1 ? hi : 0xBFu)) break;
    }
    if (k == len) return true;
    len = k;  // the maximal subpart: one replacement for bytes [p, p+k)
    return false;
  };
  size_t len = 0;
  while (i < n && valid_at(i, len)) i += len;
  if (i == n) return false;
  out.assign(in.data(), i);
  while (i < n) {
    if (valid_at(i, len)) {
      out.append(in.data() + i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += len == 0 ? 1 : len;
    }
  }
  return true;
}

std::array<uint32_t, 256> gpt2_byte_to_codepoint() {
  std::array<uint32_t, 256> cp{};
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cp[b] = direct ? b : 256 + n++;
  }
  return cp;
}

std::string json_quote(std::string_view in) {
  std::string fixed;
  const std::string_view s = utf8_sanitize(in, fixed) ? std::string_view(fixed) : in;
  std::string o = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        o += "\\\"";
        break;
      case '\\':
        o += "\\\\";
        break;
      case '\n':
        o += "\\n";
        break;
      case '\r':
        o += "\\r";
        break;
      case '\t':
        o += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
          o += buf;
        } else {
          o += c;
        }
    }
  }
  return o + "\"";
}

}  // namespace tessera
