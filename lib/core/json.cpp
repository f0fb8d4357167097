// json.cpp: the JSON reader.
#include "core/json.hpp"

#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/utf8.hpp"

namespace tessera {

namespace {

// One level of nesting (an object or an array being read), undone however the reading ends.
struct Level {
  explicit Level(int& depth) : depth_(depth) { ++depth_; }
  ~Level() { --depth_; }
  Level(const Level&) = delete;
  Level& operator=(const Level&) = delete;
  int& depth_;
};

// A decoded key for a one-line error: quoted, control characters escaped, cut after its first 64
// bytes (at a character boundary).
std::string quoted_key(const std::string& key) {
  std::string out = "\"";
  for (size_t k = 0; k < key.size(); ++k) {
    if (k >= 64 && (static_cast<unsigned char>(key[k]) & 0xC0) != 0x80) {
      out += "...";
      break;
    }
    const unsigned char c = static_cast<unsigned char>(key[k]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7F) {
      static const char hex[] = "0123456789abcdef";
      out += "\\u00";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The keys of one object, to find one given twice: an open-addressing table over flat arrays of
// the keys and their hashes. A node-based set (an allocation per key) made loading GPT-2's
// vocabulary (encoder.json: one object of 50k keys) 30% slower; this, about 15%.
class KeySet {
 public:
  // The key as kept in the set (stays in place until the next insert), and false when it was
  // there already.
  std::pair<const std::string*, bool> insert(std::string&& key) {
    if (2 * (keys_.size() + 1) > slots_.size()) grow();
    const size_t h = std::hash<std::string>{}(key);
    for (size_t at = h & (slots_.size() - 1);; at = (at + 1) & (slots_.size() - 1)) {
      const uint32_t k = slots_[at];
      if (k == 0) {
        slots_[at] = static_cast<uint32_t>(keys_.size() + 1);
        keys_.push_back(std::move(key));
        hashes_.push_back(h);
        return {&keys_.back(), true};
      }
      if (hashes_[k - 1] == h && keys_[k - 1] == key) return {&keys_[k - 1], false};
    }
  }

 private:
  void grow() {
    slots_.assign(std::max<size_t>(16, 2 * slots_.size()), 0);
    for (size_t k = 0; k < keys_.size(); ++k) {
      size_t at = hashes_[k] & (slots_.size() - 1);
      while (slots_[at] != 0) at = (at + 1) & (slots_.size() - 1);
      slots_[at] = static_cast<uint32_t>(k + 1);
    }
  }
  std::vector<uint32_t> slots_;  // 1 + the index of a key, 0 when empty; a power of 2 long
  std::vector<std::string> keys_;
  std::vector<size_t> hashes_;
};

}  // namespace

void JsonReader::fail(const std::string& what) const {
  throw JsonError{what + " at byte " + std::to_string(i_)};
}

void JsonReader::ws() {
  while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
    ++i_;
}

char JsonReader::peek() {
  ws();
  if (i_ >= s_.size()) fail("unexpected end of input");
  return s_[i_];
}

std::string JsonReader::parse_string() {
  if (peek() != '"') fail("expected a string");
  ++i_;
  std::string out;
  auto hex4 = [&]() {
    if (i_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        fail("bad hex digit in \\u escape");
    }
    return v;
  };
  while (true) {
    if (i_ >= s_.size()) fail("unterminated string");
    const char c = s_[i_++];
    if (c == '"') break;
    if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
    if (c != '\\') {
      out += c;
      continue;
    }
    if (i_ >= s_.size()) fail("unterminated escape");
    const char e = s_[i_++];
    switch (e) {
      case '"':
        out += '"';
        break;
      case '\\':
        out += '\\';
        break;
      case '/':
        out += '/';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'u': {
        uint32_t cp = hex4();
        if (cp >= 0xD800 && cp < 0xDC00 && i_ + 1 < s_.size() && s_[i_] == '\\' &&
            s_[i_ + 1] == 'u') {
          const size_t save = i_;
          i_ += 2;
          const uint32_t lo = hex4();
          if (lo >= 0xDC00 && lo < 0xE000)
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          else
            i_ = save;  // a lone high surrogate; the next escape stands alone
        }
        if (cp >= 0xD800 && cp < 0xE000) cp = 0xFFFD;  // lone surrogate: replacement character
        utf8_append(out, cp);
        break;
      }
      default:
        fail(std::string("bad escape \\") + e);
    }
  }
  return out;
}

void JsonReader::enter() {
  if (depth_ >= kJsonMaxDepth)
    fail("nesting deeper than " + std::to_string(kJsonMaxDepth) + " levels");
}

void JsonReader::object(const std::function<void(const std::string&)>& on_member) {
  if (peek() != '{') fail("expected a JSON object");
  enter();
  const Level level(depth_);
  ++i_;
  if (peek() == '}') {
    ++i_;
    return;
  }
  KeySet keys;  // of this object, to refuse one given twice
  while (true) {
    ws();
    const size_t key_start = i_;
    const auto [key, fresh] = keys.insert(parse_string());
    if (!fresh) {
      i_ = key_start;
      fail("duplicate key " + quoted_key(*key));
    }
    if (peek() != ':') fail("expected ':' after a key");
    ++i_;
    on_member(*key);  // this object's next key comes after the callback
    const char c = peek();
    ++i_;
    if (c == '}') return;
    if (c != ',') fail("expected ',' or '}'");
  }
}

std::string JsonReader::string_value() {
  return parse_string();
}

int64_t JsonReader::int_value() {
  ws();
  const size_t start = i_;
  if (i_ < s_.size() && s_[i_] == '-') ++i_;
  while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
  if (i_ == start || (i_ == start + 1 && s_[start] == '-')) fail("expected an integer");
  try {
    return std::stoll(std::string(s_.substr(start, i_ - start)));
  } catch (const std::out_of_range&) {
    i_ = start;
    fail("integer out of range (at most 19 digits)");
  }
}

double JsonReader::number_value() {
  ws();
  const size_t start = i_;
  while (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' ||
                            s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-'))
    ++i_;
  if (i_ == start) fail("expected a number");
  try {
    return std::stod(std::string(s_.substr(start, i_ - start)));
  } catch (const std::exception&) {
    i_ = start;
    fail("malformed number");
  }
}

bool JsonReader::null_value() {
  ws();
  if (s_.substr(i_, 4) == "null") {
    i_ += 4;
    return true;
  }
  return false;
}

bool JsonReader::bool_value() {
  ws();
  if (s_.substr(i_, 4) == "true") {
    i_ += 4;
    return true;
  }
  if (s_.substr(i_, 5) == "false") {
    i_ += 5;
    return false;
  }
  fail("expected true or false");
}

void JsonReader::array(const std::function<void()>& on_element) {
  if (peek() != '[') fail("expected an array");
  enter();
  const Level level(depth_);
  ++i_;
  if (peek() == ']') {
    ++i_;
    return;
  }
  while (true) {
    on_element();
    const char d = peek();
    ++i_;
    if (d == ']') return;
    if (d != ',') fail("expected ',' or ']'");
  }
}

void JsonReader::skip_value() {
  const char c = peek();
  if (c == '"') {
    parse_string();
  } else if (c == '{') {
    object([this](const std::string&) { skip_value(); });
  } else if (c == '[') {
    array([this] { skip_value(); });
  } else if (s_.substr(i_, 4) == "true" || s_.substr(i_, 4) == "null") {
    i_ += 4;
  } else if (s_.substr(i_, 5) == "false") {
    i_ += 5;
  } else if (c == '-' || (c >= '0' && c <= '9')) {
    ++i_;
    while (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' ||
                              s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-'))
      ++i_;
  } else {
    fail("unexpected character");
  }
}

JsonValue JsonReader::value() {
  JsonValue v;
  const char c = peek();
  if (c == '"') {
    v.type = JsonValue::Type::String;
    v.string = parse_string();
  } else if (c == '{') {
    v.type = JsonValue::Type::Object;
    object([&](const std::string& key) { v.members.emplace_back(key, value()); });
  } else if (c == '[') {
    v.type = JsonValue::Type::Array;
    array([&] { v.items.push_back(value()); });
  } else if (null_value()) {
    v.type = JsonValue::Type::Null;
  } else if (c == 't' || c == 'f') {
    v.type = JsonValue::Type::Bool;
    v.boolean = bool_value();
  } else {
    v.type = JsonValue::Type::Number;
    v.number = number_value();
  }
  return v;
}

char JsonReader::peek_char() {
  return peek();
}

const JsonValue* JsonValue::find(std::string_view key) const {
  for (const auto& m : members)
    if (m.first == key) return &m.second;
  return nullptr;
}

void JsonReader::expect_end() {
  ws();
  if (i_ != s_.size()) fail("unexpected text after the JSON value");
}

std::string json_string_member(std::string_view line, const std::string& key) {
  JsonReader r(line);
  std::string value;
  bool found = false;
  r.object([&](const std::string& k) {
    if (k == key && !found) {
      value = r.string_value();
      found = true;
    } else {
      r.skip_value();
    }
  });
  r.expect_end();
  if (!found) throw JsonError{"no string member \"" + key + "\""};
  return value;
}

}  // namespace tessera
