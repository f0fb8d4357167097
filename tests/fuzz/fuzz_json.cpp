// fuzz_json.cpp: the JSON reader on any bytes: a whole document as a tree, the streaming object
// reader, and the jsonl member lookup. Bad input may only throw JsonError, and a tree read has no
// object with a key twice and nests at most kJsonMaxDepth levels.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>

#include "core/json.hpp"

using namespace tessera;

namespace {
// The levels of objects and arrays in `v` (a scalar: 0); aborts on an object with a key twice.
int depth_of(const JsonValue& v) {
  int deepest = 0;
  if (v.type == JsonValue::Type::Array) {
    for (const JsonValue& item : v.items) deepest = std::max(deepest, depth_of(item));
    return deepest + 1;
  }
  if (v.type != JsonValue::Type::Object) return 0;
  std::set<std::string> keys;
  for (const auto& [key, member] : v.members) {
    if (!keys.insert(key).second) std::abort();
    deepest = std::max(deepest, depth_of(member));
  }
  return deepest + 1;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    JsonReader r(text);
    JsonValue v = r.value();
    r.expect_end();
    (void)v.find("text");
    if (depth_of(v) > kJsonMaxDepth) std::abort();
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
