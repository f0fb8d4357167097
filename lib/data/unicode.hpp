// unicode.hpp: what the Hugging Face tokenizer needs to know about text: UTF-8 decoding with the
// standard replacement of ill-formed input, and the Unicode classes its pre-tokenizer patterns name
// (\p{L} and its subcategories, \p{M}, \p{N}, \s), from ICU.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/utf8.hpp"

namespace tessera {

// Character class bits of one code point. \p{L} = any of the five letter bits; \s is Unicode
// White_Space (what Oniguruma's \s matches in the `tokenizers` library).
enum : uint8_t {
  kClsLu = 1,    // uppercase letter
  kClsLl = 2,    // lowercase letter
  kClsLt = 4,    // titlecase letter
  kClsLm = 8,    // modifier letter
  kClsLo = 16,   // other letter
  kClsM = 32,    // mark (Mn, Mc, Me)
  kClsN = 64,    // number (Nd, Nl, No)
  kClsWs = 128,  // White_Space
  kClsL = kClsLu | kClsLl | kClsLt | kClsLm | kClsLo,
};

uint8_t unicode_class(uint32_t cp);

// The code point at byte i of valid UTF-8 `s` and its length in bytes.
inline uint32_t utf8_at(std::string_view s, size_t i, size_t& len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    len = 1;
    return c;
  }
  if (c < 0xE0) {
    len = 2;
    return ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
  }
  if (c < 0xF0) {
    len = 3;
    return ((c & 0x0Fu) << 12) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6) |
           (static_cast<unsigned char>(s[i + 2]) & 0x3Fu);
  }
  len = 4;
  return ((c & 0x07u) << 18) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 12) |
         ((static_cast<unsigned char>(s[i + 2]) & 0x3Fu) << 6) |
         (static_cast<unsigned char>(s[i + 3]) & 0x3Fu);
}

// Ill-formed UTF-8 in `in` replaced by U+FFFD, one per maximal subpart (the Unicode recommended
// practice that Python's errors="replace", Rust's from_utf8_lossy and the WHATWG decoder follow).
// Returns false, leaving `out` untouched, when `in` is already valid.
bool utf8_sanitize(std::string_view in, std::string& out);

// `s` as a JSON string literal; ill-formed UTF-8 becomes U+FFFD (one per maximal subpart): the
// server's replies, tessera-inspect --json.
std::string json_quote(std::string_view s);

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others for 256 + n
// in byte order (the byte-level BPE's alphabet; GPT2Tokenizer and the Hugging Face ByteLevel
// pre-tokenizer both use it).
std::array<uint32_t, 256> gpt2_byte_to_codepoint();

}  // namespace tessera
