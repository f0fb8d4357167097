// fuzz_json.cpp: the JSON reader on any bytes: a whole document as a tree, the streaming object
// reader, and the jsonl member lookup. Bad input may only throw JsonError.
#include <cstdint>
#include <string>

#include "core/json.hpp"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    JsonReader r(text);
    JsonValue v = r.value();
    r.expect_end();
    (void)v.find("text");
  } catch (const JsonError&) {
  }
  try {
    JsonReader r(text);
    r.object([&](const std::string&) {
      const char c = r.peek_char();
      if (c == '"')
        (void)r.string_value();
      else if (c == '-' || (c >= '0' && c <= '9'))
        (void)r.int_value();
      else if (c == '[')
        r.array([&] { r.skip_value(); });
      else
        r.skip_value();
    });
  } catch (const JsonError&) {
  }
  try {
    (void)json_string_member(text, "text");
  } catch (const JsonError&) {
  }
  return 0;
}
