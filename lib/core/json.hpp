// json.hpp: a small strict JSON reader for what Tessera reads: jsonl documents (one object per
// line, one string field wanted), the GPT-2 encoder.json (one object of string -> integer),
// tokenizer.json, config.json, safetensors headers and the server's requests. Bounded: nesting
// deeper than kJsonMaxDepth and a key twice in one object are errors, in every mode.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera {

// The deepest nesting of objects and arrays accepted (the top-level value is level 1). Deeper
// input is refused before it can exhaust the stack; real files nest a few levels.
constexpr int kJsonMaxDepth = 512;

// Thrown with a message that says what is wrong and at which byte offset.
struct JsonError {
  std::string message;
};

// A parsed JSON value: for small configuration objects (large arrays are better streamed with the
// reader's callbacks).
struct JsonValue {
  enum class Type { Null, Bool, Number, String, Array, Object };
  Type type = Type::Null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<JsonValue> items;                            // Array
  std::vector<std::pair<std::string, JsonValue>> members;  // Object, in document order
  // The member `key` of an object; nullptr when absent or when this is not an object.
  const JsonValue* find(std::string_view key) const;
};

// Calls `on_member(key)` for each member of the object in `text`; the callback must consume the
// value with one of the reader's functions. Throws JsonError, also for nesting deeper than
// kJsonMaxDepth (however the levels are read) and for a key that appears twice in one object.
class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : s_(text) {}
  // Iterates the members of a top-level object.
  void object(const std::function<void(const std::string& key)>& on_member);
  std::string string_value();  // the next value must be a string (escapes decoded to UTF-8)
  int64_t int_value();         // the next value must be an integer
  double number_value();       // the next value must be a number
  bool null_value();           // consumes `null` and returns true if the next value is null
  bool bool_value();           // the next value must be true or false
  // Iterates the elements of an array value; the callback must consume each element.
  void array(const std::function<void()>& on_element);
  void skip_value();  // any value
  JsonValue value();  // any value, as a tree
  char peek_char();   // the first character of the next value ('{', '[', '"', digit, ...)
  void expect_end();  // only whitespace may follow

 private:
  void ws();
  void enter();  // before opening an object or array: refuses nesting past kJsonMaxDepth
  [[noreturn]] void fail(const std::string& what) const;
  char peek();
  std::string parse_string();
  std::string_view s_;
  size_t i_ = 0;
  int depth_ = 0;  // objects and arrays open now
};

// The string member `key` of the JSON object on one line; throws JsonError when the line is not a
// JSON object or has no string member of that name.
std::string json_string_member(std::string_view line, const std::string& key);

}  // namespace tessera
