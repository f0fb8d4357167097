// hf_tokenizer.cpp: tokenizer.json loading, the encode pipeline (added tokens -> normalizer ->
// pre-tokenizer -> BPE) and the decoders, following the `tokenizers` library (Rust) step by step;
// the comments name the library's behaviour where it is not obvious.
#include "data/hf_tokenizer.hpp"

#include <sys/stat.h>
#include <unicode/bytestream.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/utypes.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <deque>
#include <fstream>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/json.hpp"
#include "data/split_patterns.hpp"
#include "data/unicode.hpp"

namespace tessera {

namespace {

// ---------------------------------------------------------------------------------------------
// Files, errors and JSON helpers

// Reports a problem with one part of a file: "'FILE': WHAT".
struct Where {
  std::string file;
  [[noreturn]] void fail(const std::string& what) const {
    throw ConfigError("'" + file + "': " + what);
  }
};

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

bool read_file(const std::string& path, std::string& out) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  out = ss.str();
  return true;
}

const std::string& str_of(const JsonValue& v, const char* key, const Where& w, const char* part) {
  const JsonValue* m = v.find(key);
  if (!m || m->type != JsonValue::Type::String)
    w.fail(std::string(part) + " lacks the string \"" + key + "\"");
  return m->string;
}

bool bool_of(const JsonValue& v, const char* key, bool dflt) {
  const JsonValue* m = v.find(key);
  return m && m->type == JsonValue::Type::Bool ? m->boolean : dflt;
}

int64_t int_of(const JsonValue& v, const char* key, int64_t dflt) {
  const JsonValue* m = v.find(key);
  return m && m->type == JsonValue::Type::Number ? static_cast<int64_t>(m->number) : dflt;
}

std::string type_of(const JsonValue& v, const Where& w, const char* part) {
  if (v.type != JsonValue::Type::Object) w.fail(std::string(part) + " is not a JSON object");
  return str_of(v, "type", w, part);
}

// A {"String": s} pattern's text; refuses {"Regex": ...} where only strings are supported.
std::string string_pattern(const JsonValue& v, const Where& w, const std::string& part) {
  const JsonValue* p = v.find("pattern");
  if (p) {
    if (const JsonValue* s = p->find("String"); s && s->type == JsonValue::Type::String) {
      if (s->string.empty()) w.fail(part + " has an empty String pattern");
      return s->string;
    }
    if (p->find("Regex"))
      w.fail(part + " with a Regex pattern is not supported (only String patterns)");
  }
  w.fail(part + " lacks its pattern");
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (s.find(from) == std::string::npos) return;
  std::string out;
  size_t i = 0;
  while (true) {
    const size_t k = s.find(from, i);
    if (k == std::string::npos) break;
    out.append(s, i, k - i);
    out += to;
    i = k + from.size();
  }
  out.append(s, i, std::string::npos);
  s = std::move(out);
}

bool is_white_space(uint32_t cp) {
  return (unicode_class(cp) & kClsWs) != 0;
}

// Rust regex's \w (word character): Alphabetic, marks, decimal digits, connector punctuation,
// Join_Control.
bool is_word_char(uint32_t cp) {
  const UChar32 c = static_cast<UChar32>(cp);
  const int8_t t = u_charType(c);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL) ||
         t == U_NON_SPACING_MARK || t == U_ENCLOSING_MARK || t == U_COMBINING_SPACING_MARK ||
         t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION;
}

// The code point that ends at byte `end` of valid UTF-8.
uint32_t utf8_before(std::string_view s, size_t end, size_t& len) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return utf8_at(s, b, len);
}

// ---------------------------------------------------------------------------------------------
// Pieces: views of the text, or of normalized copies kept in an arena for one encode call.

struct Piece {
  std::string_view s;
  bool at_start;  // begins at offset 0 of the original text (Metaspace's prepend_scheme "first")
};
using Arena = std::deque<std::string>;

std::string_view keep(Arena& arena, std::string s) {
  arena.push_back(std::move(s));
  return arena.back();
}

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Splits `p` at the delimiter matches `m` (sorted, disjoint [begin, end) ranges), as the library's
// NormalizedString::split: matches and the gaps between them form spans, `invert` swaps which are
// delimiters, `behavior` says what becomes of a delimiter, and empty pieces are dropped.
void split_piece(const Piece& p, const std::vector<std::pair<size_t, size_t>>& m, bool invert,
                 Behavior behavior, std::vector<Piece>& out) {
  struct Span {
    size_t b, e;
    bool match;
  };
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& [b, e] : m) {
    if (b > prev) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }
  if (prev < p.s.size()) spans.push_back({prev, p.s.size(), invert});
  std::vector<Span> acc;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::Isolated:
      acc = spans;
      break;
    case Behavior::Removed:
      for (const Span& s : spans)
        if (!s.match) acc.push_back(s);
      break;
    case Behavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.match && !previous_match && !acc.empty())
          acc.back().e = s.e;
        else
          acc.push_back(s);
        previous_match = s.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !acc.empty())
          acc.back().b = it->b;
        else
          acc.push_back(*it);
        previous_match = it->match;
      }
      std::reverse(acc.begin(), acc.end());
      break;
    case Behavior::Contiguous:
      for (const Span& s : spans) {
        if (s.match == previous_match && !acc.empty())
          acc.back().e = s.e;
        else
          acc.push_back(s);
        previous_match = s.match;
      }
      break;
  }
  for (const Span& s : acc)
    if (s.e > s.b) out.push_back({p.s.substr(s.b, s.e - s.b), p.at_start && s.b == 0});
}

// Each character for which `pred` holds is one match (the library's char-predicate patterns).
template <typename Pred>
void char_matches(std::string_view s, Pred pred, std::vector<std::pair<size_t, size_t>>& m) {
  m.clear();
  size_t len = 0;
  for (size_t i = 0; i < s.size(); i += len)
    if (pred(utf8_at(s, i, len))) m.emplace_back(i, i + len);
}

void string_matches(std::string_view s, const std::string& pat,
                    std::vector<std::pair<size_t, size_t>>& m) {
  m.clear();
  for (size_t i = s.find(pat); i != std::string_view::npos; i = s.find(pat, i + pat.size()))
    m.emplace_back(i, i + pat.size());
}

// ---------------------------------------------------------------------------------------------
// Normalizers

struct Normalizer {
  enum class Kind { Unicode, Lowercase, Prepend, Replace, Strip, Sequence } kind = Kind::Sequence;
  const icu::Normalizer2* form = nullptr;  // Unicode: NFC, NFD, NFKC or NFKD
  std::string text, content;               // Prepend: text; Replace: text -> content
  bool left = false, right = false;        // Strip
  std::vector<Normalizer> seq;

  void apply(std::string& s) const {
    switch (kind) {
      case Kind::Unicode: {
        UErrorCode err = U_ZERO_ERROR;
        const icu::StringPiece in(s.data(), static_cast<int32_t>(s.size()));
        if (form->isNormalizedUTF8(in, err) && U_SUCCESS(err)) return;
        std::string out;
        icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(s.size()));
        err = U_ZERO_ERROR;
        form->normalizeUTF8(0, in, sink, nullptr, err);
        if (U_FAILURE(err))
          throw Error(std::string("Unicode normalization failed: ") + u_errorName(err));
        s = std::move(out);
        return;
      }
      case Kind::Lowercase: {
        // Character by character, full mappings without context (Rust's char::to_lowercase).
        std::string out;
        out.reserve(s.size());
        size_t len = 0;
        for (size_t i = 0; i < s.size(); i += len) {
          const uint32_t cp = utf8_at(s, i, len);
          if (cp < 0x80) {
            out += static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp);
          } else {
            icu::UnicodeString u(static_cast<UChar32>(cp));
            u.toLower(icu::Locale::getRoot());
            u.toUTF8String(out);
          }
        }
        s = std::move(out);
        return;
      }
      case Kind::Prepend:
        if (!s.empty()) s.insert(0, text);
        return;
      case Kind::Replace:
        replace_all(s, text, content);
        return;
      case Kind::Strip: {
        size_t b = 0, e = s.size(), len = 0;
        while (left && b < e && is_white_space(utf8_at(s, b, len))) b += len;
        while (right && e > b && is_white_space(utf8_before(s, e, len))) e -= len;
        s = s.substr(b, e - b);
        return;
      }
      case Kind::Sequence:
        for (const Normalizer& n : seq) n.apply(s);
        return;
    }
  }
};

Normalizer parse_normalizer(const JsonValue& v, const Where& w) {
  const std::string type = type_of(v, w, "normalizer");
  Normalizer n;
  UErrorCode err = U_ZERO_ERROR;
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    n.kind = Normalizer::Kind::Unicode;
    n.form = type == "NFC"    ? icu::Normalizer2::getNFCInstance(err)
             : type == "NFD"  ? icu::Normalizer2::getNFDInstance(err)
             : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(err)
                              : icu::Normalizer2::getNFKDInstance(err);
    if (U_FAILURE(err)) w.fail("normalizer " + type + ": ICU has no data for it");
  } else if (type == "Lowercase") {
    n.kind = Normalizer::Kind::Lowercase;
  } else if (type == "Prepend") {
    n.kind = Normalizer::Kind::Prepend;
    n.text = str_of(v, "prepend", w, "normalizer Prepend");
  } else if (type == "Replace") {
    n.kind = Normalizer::Kind::Replace;
    n.text = string_pattern(v, w, "normalizer Replace");
    n.content = str_of(v, "content", w, "normalizer Replace");
  } else if (type == "Strip") {
    n.kind = Normalizer::Kind::Strip;
    n.left = bool_of(v, "strip_left", true);
    n.right = bool_of(v, "strip_right", true);
  } else if (type == "Sequence") {
    const JsonValue* items = v.find("normalizers");
    if (!items || items->type != JsonValue::Type::Array)
      w.fail("normalizer Sequence lacks the array \"normalizers\"");
    for (const JsonValue& item : items->items) n.seq.push_back(parse_normalizer(item, w));
  } else {
    w.fail("normalizer type " + type +
           " is not supported (supported: NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, "
           "Strip, Sequence)");
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers

enum class PrependScheme { Always, First, Never };

PrependScheme parse_prepend_scheme(const JsonValue& v, const Where& w, const char* part) {
  if (const JsonValue* p = v.find("prepend_scheme"); p && p->type == JsonValue::Type::String) {
    if (p->string == "always") return PrependScheme::Always;
    if (p->string == "first") return PrependScheme::First;
    if (p->string == "never") return PrependScheme::Never;
    w.fail(std::string(part) + " prepend_scheme '" + p->string +
           "' is unknown (allowed: always, first, never)");
  }
  // Files written before prepend_scheme existed say add_prefix_space.
  return bool_of(v, "add_prefix_space", true) ? PrependScheme::Always : PrependScheme::Never;
}

std::string parse_replacement(const JsonValue& v, const Where& w, const char* part) {
  std::string r = "\xE2\x96\x81";  // U+2581, the metaspace
  if (const JsonValue* p = v.find("replacement"); p && p->type == JsonValue::Type::String)
    r = p->string;
  size_t len = 0;
  if (r.empty() || (utf8_at(r, 0, len), len != r.size()))
    w.fail(std::string(part) + " replacement '" + r + "' is not one character");
  return r;
}

struct PreTokenizer {
  enum class Kind { ByteLevel, Split, Metaspace, Digits, Sequence } kind = Kind::Sequence;
  bool add_prefix_space = false, use_regex = true;  // ByteLevel
  bool is_regex = false;                            // Split
  SplitPattern regex = SplitPattern::Gpt2;
  std::string literal;
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  std::string replacement;  // Metaspace
  PrependScheme prepend = PrependScheme::Always;
  bool split = true;
  bool individual_digits = false;  // Digits
  std::vector<PreTokenizer> seq;

  bool has_byte_level() const {
    if (kind == Kind::ByteLevel) return true;
    for (const PreTokenizer& p : seq)
      if (p.has_byte_level()) return true;
    return false;
  }

  // Replaces `pieces` by their pre-tokens.
  void apply(std::vector<Piece>& pieces, Arena& arena) const {
    if (kind == Kind::Sequence) {
      for (const PreTokenizer& p : seq) p.apply(pieces, arena);
      return;
    }
    std::vector<Piece> out;
    std::vector<std::pair<size_t, size_t>> m;
    for (Piece p : pieces) {
      switch (kind) {
        case Kind::ByteLevel:
          if (add_prefix_space && (p.s.empty() || p.s[0] != ' '))
            p.s = keep(arena, " " + std::string(p.s));
          if (!use_regex) {
            out.push_back(p);
            break;
          }
          split_pattern_find_all(SplitPattern::Gpt2, p.s, m);
          split_piece(p, m, false, Behavior::Isolated, out);
          break;
        case Kind::Split:
          if (is_regex)
            split_pattern_find_all(regex, p.s, m);
          else
            string_matches(p.s, literal, m);
          split_piece(p, m, invert, behavior, out);
          break;
        case Kind::Metaspace: {
          std::string s(p.s);
          replace_all(s, " ", replacement);
          if ((prepend == PrependScheme::Always ||
               (prepend == PrependScheme::First && p.at_start)) &&
              s.compare(0, replacement.size(), replacement) != 0)
            s.insert(0, replacement);
          p.s = keep(arena, std::move(s));
          if (!split) {
            out.push_back(p);
            break;
          }
          string_matches(p.s, replacement, m);
          split_piece(p, m, false, Behavior::MergedWithNext, out);
          break;
        }
        case Kind::Digits:
          // char::is_numeric: general categories Nd, Nl, No.
          char_matches(
              p.s, [](uint32_t cp) { return (unicode_class(cp) & kClsN) != 0; }, m);
          split_piece(p, m, false, individual_digits ? Behavior::Isolated : Behavior::Contiguous,
                      out);
          break;
        case Kind::Sequence:
          break;
      }
    }
    pieces.swap(out);
  }
};

Behavior parse_behavior(const JsonValue& v, const Where& w) {
  const std::string b = str_of(v, "behavior", w, "pre_tokenizer Split");
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  w.fail("pre_tokenizer Split behavior '" + b +
         "' is unknown (allowed: Removed, Isolated, MergedWithPrevious, MergedWithNext, "
         "Contiguous)");
}

PreTokenizer parse_pre_tokenizer(const JsonValue& v, const Where& w) {
  const std::string type = type_of(v, w, "pre_tokenizer");
  PreTokenizer p;
  if (type == "ByteLevel") {
    p.kind = PreTokenizer::Kind::ByteLevel;
    p.add_prefix_space = bool_of(v, "add_prefix_space", true);
    p.use_regex = bool_of(v, "use_regex", true);
  } else if (type == "Split") {
    p.kind = PreTokenizer::Kind::Split;
    const JsonValue* pat = v.find("pattern");
    const JsonValue* re = pat ? pat->find("Regex") : nullptr;
    const JsonValue* str = pat ? pat->find("String") : nullptr;
    if (re && re->type == JsonValue::Type::String) {
      p.is_regex = true;
      if (!find_split_pattern(re->string, p.regex))
        w.fail("pre_tokenizer Split regex '" + one_line(re->string) +
               "' is not supported (supported: the exact regexes of GPT-2, Llama 3 / cl100k, "
               "Qwen2, GPT-4o / o200k and Mistral NeMo / tekken)");
    } else if (str && str->type == JsonValue::Type::String && !str->string.empty()) {
      p.literal = str->string;
    } else {
      w.fail("pre_tokenizer Split lacks a String or Regex pattern");
    }
    p.behavior = parse_behavior(v, w);
    p.invert = bool_of(v, "invert", false);
  } else if (type == "Metaspace") {
    p.kind = PreTokenizer::Kind::Metaspace;
    p.replacement = parse_replacement(v, w, "pre_tokenizer Metaspace");
    p.prepend = parse_prepend_scheme(v, w, "pre_tokenizer Metaspace");
    p.split = bool_of(v, "split", true);
  } else if (type == "Digits") {
    p.kind = PreTokenizer::Kind::Digits;
    p.individual_digits = bool_of(v, "individual_digits", false);
  } else if (type == "Sequence") {
    const JsonValue* items = v.find("pretokenizers");
    if (!items || items->type != JsonValue::Type::Array)
      w.fail("pre_tokenizer Sequence lacks the array \"pretokenizers\"");
    for (const JsonValue& item : items->items) {
      if (!p.seq.empty() && p.seq.back().has_byte_level())
        w.fail(
            "pre_tokenizer ByteLevel followed by another pre-tokenizer is not supported "
            "(ByteLevel must come last)");
      p.seq.push_back(parse_pre_tokenizer(item, w));
    }
  } else {
    w.fail("pre_tokenizer type " + type +
           " is not supported (supported: ByteLevel, Split, Metaspace, Digits, Sequence)");
  }
  return p;
}

// ---------------------------------------------------------------------------------------------
// Decoders. `continuation` decodes one token as it continues running text (token_bytes): byte
// tokens stay raw bytes, and nothing that only applies at the start of the text is done.

struct Decoder {
  enum class Kind {
    ByteLevel,
    Metaspace,
    Replace,
    ByteFallback,
    Fuse,
    Strip,
    Sequence
  } kind = Kind::Sequence;
  std::string text, content;  // Replace: text -> content; Metaspace: text = replacement
  PrependScheme prepend = PrependScheme::Always;
  std::string strip;  // Strip: the character
  int64_t start = 0, stop = 0;
  std::vector<Decoder> seq;
  const std::array<int16_t, 324>* char_to_byte = nullptr;  // ByteLevel

  void chain(std::vector<std::string>& toks, bool continuation) const {
    switch (kind) {
      case Kind::ByteLevel: {
        // Every token's characters mapped back to bytes (a token with another character is taken
        // as its UTF-8), then all bytes as one string, ill-formed UTF-8 replaced (from_utf8_lossy).
        std::string bytes, one;
        for (const std::string& t : toks) {
          one.clear();
          bool mapped = true;
          size_t len = 0;
          for (size_t i = 0; i < t.size() && mapped; i += len) {
            const uint32_t cp = utf8_at(t, i, len);
            const int b = cp < 324 ? (*char_to_byte)[cp] : -1;
            if (b < 0)
              mapped = false;
            else
              one += static_cast<char>(b);
          }
          bytes += mapped ? one : t;
        }
        std::string clean;
        if (!continuation && utf8_sanitize(bytes, clean)) bytes.swap(clean);
        toks.assign(1, std::move(bytes));
        return;
      }
      case Kind::Metaspace:
        for (size_t i = 0; i < toks.size(); ++i) {
          // The library drops every metaspace of the first token (prepend_scheme not never) and
          // turns the others into spaces.
          const bool drop = i == 0 && !continuation && prepend != PrependScheme::Never;
          replace_all(toks[i], text, drop ? "" : " ");
        }
        return;
      case Kind::Replace:
        for (std::string& t : toks) replace_all(t, text, content);
        return;
      case Kind::ByteFallback: {
        // <0xXX> tokens become bytes; a run of them is one string if it is valid UTF-8, else one
        // U+FFFD per byte.
        std::vector<std::string> out;
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          std::string clean;
          if (continuation || !utf8_sanitize(run, clean)) {
            out.push_back(run);
          } else {
            std::string repl;
            for (size_t k = 0; k < run_tokens; ++k) repl += "\xEF\xBF\xBD";
            out.push_back(repl);
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& t : toks) {
          int byte = -1;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              std::isxdigit(static_cast<unsigned char>(t[3])) &&
              std::isxdigit(static_cast<unsigned char>(t[4])))
            byte = std::stoi(t.substr(3, 2), nullptr, 16);
          if (byte >= 0) {
            run += static_cast<char>(byte);
            ++run_tokens;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        toks.swap(out);
        return;
      }
      case Kind::Fuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        toks.assign(1, std::move(all));
        return;
      }
      case Kind::Strip:
        if (continuation) return;
        for (std::string& t : toks) {
          // Up to `start` leading and `stop` trailing copies of the character.
          const size_t n = strip.size();
          size_t b = 0, e = t.size();
          for (int64_t k = 0; k < start && e - b >= n && t.compare(b, n, strip) == 0; ++k) b += n;
          for (int64_t k = 0; k < stop && e - b >= n && t.compare(e - n, n, strip) == 0; ++k)
            e -= n;
          t = t.substr(b, e - b);
        }
        return;
      case Kind::Sequence:
        for (const Decoder& d : seq) d.chain(toks, continuation);
        return;
    }
  }
};

Decoder parse_decoder(const JsonValue& v, const Where& w,
                      const std::array<int16_t, 324>* char_to_byte) {
  const std::string type = type_of(v, w, "decoder");
  Decoder d;
  if (type == "ByteLevel") {
    d.kind = Decoder::Kind::ByteLevel;
    d.char_to_byte = char_to_byte;
  } else if (type == "Metaspace") {
    d.kind = Decoder::Kind::Metaspace;
    d.text = parse_replacement(v, w, "decoder Metaspace");
    d.prepend = parse_prepend_scheme(v, w, "decoder Metaspace");
  } else if (type == "Replace") {
    d.kind = Decoder::Kind::Replace;
    d.text = string_pattern(v, w, "decoder Replace");
    d.content = str_of(v, "content", w, "decoder Replace");
  } else if (type == "ByteFallback") {
    d.kind = Decoder::Kind::ByteFallback;
  } else if (type == "Fuse") {
    d.kind = Decoder::Kind::Fuse;
  } else if (type == "Strip") {
    d.kind = Decoder::Kind::Strip;
    d.strip = str_of(v, "content", w, "decoder Strip");
    size_t len = 0;
    if (d.strip.empty() || (utf8_at(d.strip, 0, len), len != d.strip.size()))
      w.fail("decoder Strip content '" + d.strip + "' is not one character");
    d.start = int_of(v, "start", 0);
    d.stop = int_of(v, "stop", 0);
  } else if (type == "Sequence") {
    const JsonValue* items = v.find("decoders");
    if (!items || items->type != JsonValue::Type::Array)
      w.fail("decoder Sequence lacks the array \"decoders\"");
    for (const JsonValue& item : items->items)
      d.seq.push_back(parse_decoder(item, w, char_to_byte));
  } else {
    w.fail("decoder type " + type +
           " is not supported (supported: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, "
           "Strip, Sequence)");
  }
  return d;
}

// ---------------------------------------------------------------------------------------------
// Added tokens: a byte trie, matched leftmost-longest (the library's Aho-Corasick).

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

class Trie {
 public:
  void add(const std::string& s, int32_t token) {
    if (s.empty()) return;
    int32_t node = 0;
    for (unsigned char c : s) {
      int32_t child = -1;
      for (const auto& [b, n] : nodes_[node].next)
        if (b == c) child = n;
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].next.emplace_back(c, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    nodes_[node].token = token;
    first_[static_cast<unsigned char>(s[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The longest token that starts at s[i] (-1 if none); `len` its length.
  int32_t longest(std::string_view s, size_t i, size_t& len) const {
    if (!first_[static_cast<unsigned char>(s[i])]) return -1;
    int32_t node = 0, best = -1;
    for (size_t k = i; k < s.size(); ++k) {
      int32_t child = -1;
      for (const auto& [b, n] : nodes_[node].next)
        if (b == static_cast<unsigned char>(s[k])) child = n;
      if (child < 0) break;
      node = child;
      if (nodes_[node].token >= 0) {
        best = nodes_[node].token;
        len = k + 1 - i;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;
    int32_t token = -1;
  };
  std::vector<Node> nodes_{1};
  bool first_[256] = {};
};

struct Segment {
  size_t b, e;
  int32_t added;  // index into the added tokens, or -1 for text
};

// ---------------------------------------------------------------------------------------------
// The BPE model

struct Bpe {
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, merged)
  bool byte_fallback = false, ignore_merges = false, fuse_unk = false;
  int32_t unk_id = -1;
  std::string prefix, suffix;  // continuing_subword_prefix, end_of_word_suffix
  // Byte-level fast paths: the token of each byte's character, and bytes -> id of every token
  // made only of such characters (for ignore_merges).
  std::array<int32_t, 256> byte_id{};
  bool all_bytes = false;
  std::unordered_map<std::string, int32_t> bytes_to_id;
  std::array<int32_t, 256> fallback_id{};  // <0xXX>
  std::array<std::string, 256> byte_char;  // UTF-8 of each byte's character

  bool merge_of(int32_t a, int32_t b, int32_t& rank, int32_t& id) const {
    auto it = merges.find((static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b));
    if (it == merges.end()) return false;
    rank = it->second.first;
    id = it->second.second;
    return true;
  }

  // The library's Word::merge_all: a queue of (rank, position) candidates, lowest rank first and
  // leftmost among equal ranks; an entry whose pair has changed since it was queued is skipped.
  void merge_all(std::vector<int32_t>& w) const {
    const int32_t n = static_cast<int32_t>(w.size());
    if (n < 2) return;
    struct Cand {
      int32_t rank, pos, id;
    };
    auto later = [](const Cand& a, const Cand& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::priority_queue<Cand, std::vector<Cand>, decltype(later)> q(later);
    std::vector<int32_t> prev(n), next(n);
    std::vector<char> alive(n, 1);
    int32_t rank = 0, id = 0;
    for (int32_t i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
      if (i + 1 < n && merge_of(w[i], w[i + 1], rank, id)) q.push({rank, i, id});
    }
    while (!q.empty()) {
      const Cand t = q.top();
      q.pop();
      if (!alive[t.pos]) continue;
      const int32_t nx = next[t.pos];
      if (nx < 0 || !merge_of(w[t.pos], w[nx], rank, id) || id != t.id) continue;
      w[t.pos] = t.id;
      alive[nx] = 0;
      next[t.pos] = next[nx];
      if (next[nx] >= 0) prev[next[nx]] = t.pos;
      if (prev[t.pos] >= 0 && merge_of(w[prev[t.pos]], w[t.pos], rank, id))
        q.push({rank, prev[t.pos], id});
      if (next[t.pos] >= 0 && merge_of(w[t.pos], w[next[t.pos]], rank, id))
        q.push({rank, t.pos, id});
    }
    int32_t o = 0;
    for (int32_t i = 0; i < n; ++i)
      if (alive[i]) w[o++] = w[i];
    w.resize(o);
  }

  // The ids of one pre-token. `byte_level`: each byte is a symbol (standing for its character).
  void encode_word(std::string_view word, bool byte_level, std::vector<int32_t>& out) const {
    if (ignore_merges) {
      // A pre-token that is itself a token maps to it directly.
      const auto& map = byte_level ? bytes_to_id : vocab;
      auto it = map.find(std::string(word));
      if (it != map.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::vector<int32_t> w;
    w.reserve(word.size());
    if (byte_level && all_bytes && prefix.empty() && suffix.empty()) {
      for (unsigned char c : word) w.push_back(byte_id[c]);
    } else {
      // The library's merge_word: each symbol (with the prefix when not first, the suffix when
      // last) is a token, else its bytes as <0xXX> tokens, else the unknown token.
      int32_t unk_pending = -1;
      size_t len = 0;
      std::string s;
      for (size_t i = 0; i < word.size(); i += len) {
        if (byte_level) {
          len = 1;
          s = byte_char[static_cast<unsigned char>(word[i])];
        } else {
          utf8_at(word, i, len);
          s.assign(word.data() + i, len);
        }
        if (i > 0 && !prefix.empty()) s.insert(0, prefix);
        if (i + len == word.size() && !suffix.empty()) s += suffix;
        auto it = vocab.find(s);
        if (it != vocab.end()) {
          if (unk_pending >= 0) w.push_back(unk_pending);
          unk_pending = -1;
          w.push_back(it->second);
          continue;
        }
        if (byte_fallback) {
          bool all = true;
          for (unsigned char c : s) all = all && fallback_id[c] >= 0;
          if (all) {
            for (unsigned char c : s) w.push_back(fallback_id[c]);
            continue;
          }
        }
        if (unk_id >= 0) {
          if (unk_pending >= 0 && !fuse_unk) w.push_back(unk_pending);
          unk_pending = unk_id;
        }
        // Without an unknown token the character is dropped, as in the library.
      }
      if (unk_pending >= 0) w.push_back(unk_pending);
    }
    merge_all(w);
    out.insert(out.end(), w.begin(), w.end());
  }
};

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// The top level of a tokenizer.json: the model's vocabulary and merges are streamed (the vocabulary
// straight into the Bpe), the rest kept as trees.
struct TokenizerJson {
  JsonValue normalizer_v, pre_v, decoder_v, added_v, model_type, dropout, unk, prefix, suffix;
  JsonValue byte_fallback_v, ignore_merges_v, fuse_unk_v;
  bool have_model = false, vocab_is_object = true;
  std::vector<std::pair<std::string, std::string>> merge_pairs;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The tokenizer

struct HfTokenizer::Impl {
  std::string path, name;
  bool has_normalizer = false, has_pre = false, has_decoder = false, byte_level = false;
  Normalizer normalizer;
  PreTokenizer pre;
  Decoder decoder;
  Bpe bpe;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_ids;
  Trie raw_trie, norm_trie;
  std::array<int16_t, 324> char_to_byte{};
  std::vector<std::string> id_to_token, token_bytes;
  std::vector<char> present;
  int64_t vocab_size = 0;
  int32_t eod = -1;
  int32_t bos = -1;  // bos_token of tokenizer_config.json, when it names a token

  // The library's AddedVocabulary::find_matches on `s` with one trie.
  void split_added(std::string_view s, const Trie& trie, std::vector<Segment>& out) const {
    out.clear();
    if (trie.empty()) {
      out.push_back({0, s.size(), -1});
      return;
    }
    size_t start_offset = 0, i = 0;
    while (i < s.size()) {
      size_t len = 0;
      const int32_t t = trie.longest(s, i, len);
      if (t < 0) {
        ++i;
        continue;
      }
      const AddedToken& tok = added[t];
      size_t start = i, stop = i + len;
      i = stop;
      if (tok.single_word) {
        size_t l = 0;
        const bool start_space = start == 0 || !is_word_char(utf8_before(s, start, l));
        const bool stop_space = stop == s.size() || !is_word_char(utf8_at(s, stop, l));
        if (!start_space || !stop_space) continue;
      }
      if (tok.lstrip) {
        size_t l = 0;
        while (start > start_offset && is_white_space(utf8_before(s, start, l))) start -= l;
      }
      if (tok.rstrip) {
        size_t l = 0;
        while (stop < s.size() && is_white_space(utf8_at(s, stop, l))) stop += l;
        i = stop;
      }
      if (start > start_offset) out.push_back({start_offset, start, -1});
      out.push_back({start, stop, t});
      start_offset = stop;
    }
    if (start_offset < s.size()) out.push_back({start_offset, s.size(), -1});
  }

  // Calls on_token(id) for added tokens and on_piece(piece) for the pre-tokens, in text order.
  template <typename OnToken, typename OnPiece>
  void walk(std::string_view text, OnToken on_token, OnPiece on_piece) const {
    std::string clean;
    if (utf8_sanitize(text, clean)) text = clean;
    Arena arena;
    std::vector<Segment> segs, subs;
    std::vector<Piece> pieces;
    split_added(text, raw_trie, segs);
    for (const Segment& sg : segs) {
      if (sg.added >= 0) {
        on_token(added[sg.added].id);
        continue;
      }
      std::string_view sec = text.substr(sg.b, sg.e - sg.b);
      if (has_normalizer) {
        std::string s(sec);
        normalizer.apply(s);
        sec = keep(arena, std::move(s));
      }
      split_added(sec, norm_trie, subs);
      for (const Segment& sub : subs) {
        if (sub.added >= 0) {
          on_token(added[sub.added].id);
          continue;
        }
        if (sub.e == sub.b) continue;
        pieces.assign(1, Piece{sec.substr(sub.b, sub.e - sub.b), sg.b == 0 && sub.b == 0});
        if (has_pre) pre.apply(pieces, arena);
        for (const Piece& p : pieces) on_piece(p.s);
      }
    }
  }

  void encode(std::string_view text, std::vector<int32_t>& out, Cache& cache) const {
    std::string key;  // reused: a cache look-up allocates nothing once it has grown
    walk(
        text, [&](int32_t id) { out.push_back(id); },
        [&](std::string_view piece) {
          if (piece.empty()) return;
          const bool cacheable = piece.size() <= 256;
          if (cacheable) {
            key.assign(piece.data(), piece.size());
            auto it = cache.find(key);
            if (it != cache.end()) {
              out.insert(out.end(), it->second.begin(), it->second.end());
              return;
            }
          }
          std::vector<int32_t> ids;
          bpe.encode_word(piece, byte_level, ids);
          out.insert(out.end(), ids.begin(), ids.end());
          if (cacheable && cache.size() < (1u << 20)) cache.emplace(key, std::move(ids));
        });
  }

  int32_t token_to_id(std::string_view token) const {
    const std::string t(token);
    if (auto it = added_ids.find(t); it != added_ids.end()) return it->second;
    if (auto it = bpe.vocab.find(t); it != bpe.vocab.end()) return it->second;
    return -1;
  }

  void load(const std::string& file, const std::string& text);
  void resolve_eod(const std::string& eod_token);

 private:
  void init_byte_tables();
  void parse_json(const std::string& text, const Where& w, TokenizerJson& j);
  void parse_model(JsonReader& r, TokenizerJson& j);
  void load_model(const TokenizerJson& j, const Where& w);
  void load_pipeline(const TokenizerJson& j, const Where& w);
  void load_added_tokens(const JsonValue& added_v, const Where& w);
  void build_id_tables();
};

void HfTokenizer::Impl::load(const std::string& file, const std::string& text) {
  const Where w{file};
  path = file;
  if (std::string bad; utf8_sanitize(text, bad)) w.fail("is not valid UTF-8");
  name = "hf:xxh64:" + hex64(xxh64(text.data(), text.size()));
  init_byte_tables();

  // The top level: the model's vocabulary and merges are streamed, the rest parsed as trees.
  TokenizerJson j;
  parse_json(text, w, j);
  if (!j.have_model) w.fail("has no \"model\"");

  // The model.
  load_model(j, w);

  // Normalizer, pre-tokenizer, decoder.
  load_pipeline(j, w);

  // Added tokens.
  load_added_tokens(j.added_v, w);

  // Ids: the vocabulary, then the added tokens (which the library's decode looks up first).
  build_id_tables();
}

// The byte-level alphabet: each byte's code point, and back.
void HfTokenizer::Impl::init_byte_tables() {
  const std::array<uint32_t, 256> cps = gpt2_byte_to_codepoint();
  char_to_byte.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char_to_byte[cps[b]] = static_cast<int16_t>(b);
    bpe.byte_char[b].clear();
    utf8_append(bpe.byte_char[b], cps[b]);
  }
}

// Reads the top level of the tokenizer.json text into j (the vocabulary into bpe.vocab).
void HfTokenizer::Impl::parse_json(const std::string& text, const Where& w, TokenizerJson& j) {
  try {
    JsonReader r(text);
    r.object([&](const std::string& key) {
      if (key == "normalizer") {
        j.normalizer_v = r.value();
      } else if (key == "pre_tokenizer") {
        j.pre_v = r.value();
      } else if (key == "decoder") {
        j.decoder_v = r.value();
      } else if (key == "added_tokens") {
        j.added_v = r.value();
      } else if (key == "model") {
        j.have_model = true;
        parse_model(r, j);
      } else {
        r.skip_value();  // version, truncation, padding, post_processor (no BOS/EOS is added)
      }
    });
    r.expect_end();
  } catch (const JsonError& e) {
    w.fail("does not parse as a tokenizer.json: " + e.message);
  }
}

// Reads the "model" object: its vocabulary into bpe.vocab, its merges and settings into j.
void HfTokenizer::Impl::parse_model(JsonReader& r, TokenizerJson& j) {
  r.object([&](const std::string& k) {
    if (k == "vocab") {
      j.vocab_is_object = r.peek_char() == '{';
      if (!j.vocab_is_object) {
        r.skip_value();  // Unigram's [[piece, score], ...]
        return;
      }
      r.object([&](const std::string& tok) {
        const int64_t id = r.int_value();
        if (id < 0 || id >= (1 << 30))
          throw JsonError{"token id " + std::to_string(id) + " out of range"};
        bpe.vocab[tok] = static_cast<int32_t>(id);
      });
    } else if (k == "merges") {
      r.array([&] {
        JsonValue m = r.value();
        if (m.type == JsonValue::Type::String) {
          const size_t sp = m.string.find(' ');
          if (sp == std::string::npos || m.string.find(' ', sp + 1) != std::string::npos)
            throw JsonError{"merge \"" + m.string + "\" is not two tokens separated by one space"};
          j.merge_pairs.emplace_back(m.string.substr(0, sp), m.string.substr(sp + 1));
        } else if (m.type == JsonValue::Type::Array && m.items.size() == 2 &&
                   m.items[0].type == JsonValue::Type::String &&
                   m.items[1].type == JsonValue::Type::String) {
          j.merge_pairs.emplace_back(m.items[0].string, m.items[1].string);
        } else {
          throw JsonError{"a merge is neither \"a b\" nor [\"a\", \"b\"]"};
        }
      });
    } else if (k == "type") {
      j.model_type = r.value();
    } else if (k == "dropout") {
      j.dropout = r.value();
    } else if (k == "unk_token") {
      j.unk = r.value();
    } else if (k == "continuing_subword_prefix") {
      j.prefix = r.value();
    } else if (k == "end_of_word_suffix") {
      j.suffix = r.value();
    } else if (k == "byte_fallback") {
      j.byte_fallback_v = r.value();
    } else if (k == "ignore_merges") {
      j.ignore_merges_v = r.value();
    } else if (k == "fuse_unk") {
      j.fuse_unk_v = r.value();
    } else {
      r.skip_value();
    }
  });
}

// Checks the BPE model and sets its settings, merge ranks and byte-fallback ids.
void HfTokenizer::Impl::load_model(const TokenizerJson& j, const Where& w) {
  const std::string type = j.model_type.type == JsonValue::Type::String ? j.model_type.string
                           : !j.merge_pairs.empty()                     ? "BPE"
                                                                        : "(none)";
  if (type != "BPE" || !j.vocab_is_object)
    w.fail("model type " + (j.vocab_is_object ? type : std::string("Unigram")) +
           " is not supported (supported: BPE)");
  if (j.dropout.type == JsonValue::Type::Number && j.dropout.number != 0)
    w.fail("model BPE dropout " + std::to_string(j.dropout.number) +
           " is not supported (only null or 0)");
  if (bpe.vocab.empty()) w.fail("model BPE has an empty vocabulary");
  bpe.byte_fallback = j.byte_fallback_v.type == JsonValue::Type::Bool && j.byte_fallback_v.boolean;
  bpe.ignore_merges = j.ignore_merges_v.type == JsonValue::Type::Bool && j.ignore_merges_v.boolean;
  bpe.fuse_unk = j.fuse_unk_v.type == JsonValue::Type::Bool && j.fuse_unk_v.boolean;
  if (j.prefix.type == JsonValue::Type::String) bpe.prefix = j.prefix.string;
  if (j.suffix.type == JsonValue::Type::String) bpe.suffix = j.suffix.string;
  if (j.unk.type == JsonValue::Type::String) {
    auto it = bpe.vocab.find(j.unk.string);
    if (it == bpe.vocab.end())
      w.fail("model BPE unk_token '" + j.unk.string + "' is not in the vocabulary");
    bpe.unk_id = it->second;
  }
  for (size_t i = 0; i < j.merge_pairs.size(); ++i) {
    const auto& [a, b] = j.merge_pairs[i];
    auto ia = bpe.vocab.find(a), ib = bpe.vocab.find(b);
    const std::string merged =
        a + (b.size() >= bpe.prefix.size() ? b.substr(bpe.prefix.size()) : std::string());
    auto im = bpe.vocab.find(merged);
    if (ia == bpe.vocab.end() || ib == bpe.vocab.end() || im == bpe.vocab.end())
      w.fail("model BPE merge " + std::to_string(i) + " ('" + a + "' '" + b +
             "') uses a token missing from the vocabulary");
    // A repeated pair keeps its last rank, as the library's hash map does.
    bpe.merges[(static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second)] = {
        static_cast<int32_t>(i), im->second};
  }
  bpe.fallback_id.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char code[8];
    std::snprintf(code, sizeof code, "<0x%02X>", b);
    if (auto it = bpe.vocab.find(code); it != bpe.vocab.end()) bpe.fallback_id[b] = it->second;
  }
}

// Parses the normalizer, pre-tokenizer and decoder; for a byte-level pre-tokenizer, the ids of
// the bytes (and of every token as bytes, when merges are ignored).
void HfTokenizer::Impl::load_pipeline(const TokenizerJson& j, const Where& w) {
  if (j.normalizer_v.type != JsonValue::Type::Null) {
    normalizer = parse_normalizer(j.normalizer_v, w);
    has_normalizer = true;
  }
  if (j.pre_v.type != JsonValue::Type::Null) {
    pre = parse_pre_tokenizer(j.pre_v, w);
    has_pre = true;
    byte_level = pre.has_byte_level();
  }
  if (j.decoder_v.type != JsonValue::Type::Null) {
    decoder = parse_decoder(j.decoder_v, w, &char_to_byte);
    has_decoder = true;
  }
  if (byte_level) {
    bpe.all_bytes = true;
    for (int b = 0; b < 256; ++b) {
      auto it = bpe.vocab.find(bpe.byte_char[b]);
      bpe.byte_id[b] = it == bpe.vocab.end() ? -1 : it->second;
      bpe.all_bytes = bpe.all_bytes && it != bpe.vocab.end();
    }
    if (bpe.ignore_merges) {
      for (const auto& [tok, id] : bpe.vocab) {
        std::string bytes;
        bool ok = true;
        size_t len = 0;
        for (size_t i = 0; i < tok.size() && ok; i += len) {
          const uint32_t cp = utf8_at(tok, i, len);
          ok = cp < 324 && char_to_byte[cp] >= 0;
          if (ok) bytes += static_cast<char>(char_to_byte[cp]);
        }
        if (ok) bpe.bytes_to_id.emplace(bytes, id);
      }
    }
  }
}

// Reads the added tokens and files each in the trie it is matched with (normalized text or raw).
void HfTokenizer::Impl::load_added_tokens(const JsonValue& added_v, const Where& w) {
  if (added_v.type == JsonValue::Type::Array) {
    for (const JsonValue& a : added_v.items) {
      AddedToken t;
      t.content = str_of(a, "content", w, "an added token");
      const int64_t id = int_of(a, "id", -1);
      if (id < 0 || id >= (1 << 30)) w.fail("added token '" + t.content + "' has no valid id");
      t.id = static_cast<int32_t>(id);
      t.special = bool_of(a, "special", false);
      t.single_word = bool_of(a, "single_word", false);
      t.lstrip = bool_of(a, "lstrip", false);
      t.rstrip = bool_of(a, "rstrip", false);
      t.normalized = bool_of(a, "normalized", !t.special);
      added_ids[t.content] = t.id;
      added.push_back(std::move(t));
    }
  }
  for (size_t i = 0; i < added.size(); ++i) {
    if (added[i].normalized && has_normalizer) {
      std::string s = added[i].content;
      normalizer.apply(s);
      norm_trie.add(s, static_cast<int32_t>(i));
    } else if (added[i].normalized) {
      norm_trie.add(added[i].content, static_cast<int32_t>(i));
    } else {
      raw_trie.add(added[i].content, static_cast<int32_t>(i));
    }
  }
}

// The id tables: each id's token, whether it is one, and the bytes it decodes to.
void HfTokenizer::Impl::build_id_tables() {
  int64_t max_id = -1;
  for (const auto& [tok, id] : bpe.vocab) max_id = std::max<int64_t>(max_id, id);
  for (const AddedToken& t : added) max_id = std::max<int64_t>(max_id, t.id);
  vocab_size = max_id + 1;
  id_to_token.assign(vocab_size, std::string());
  present.assign(vocab_size, 0);
  for (const auto& [tok, id] : bpe.vocab) {
    id_to_token[id] = tok;
    present[id] = 1;
  }
  for (const AddedToken& t : added) {
    id_to_token[t.id] = t.content;
    present[t.id] = 1;
  }
  token_bytes.assign(vocab_size, std::string());
  for (int64_t id = 0; id < vocab_size; ++id) {
    if (!present[id]) continue;
    std::vector<std::string> toks{id_to_token[id]};
    if (has_decoder) decoder.chain(toks, /*continuation=*/true);
    for (const std::string& t : toks) token_bytes[id] += t;
  }
}

void HfTokenizer::Impl::resolve_eod(const std::string& eod_token) {
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  const std::string config = dir + "tokenizer_config.json";
  // eos_token and bos_token of tokenizer_config.json: a string, or an object with "content".
  std::string text, eos, bos_text;
  const bool have_config = read_file(config, text);
  if (have_config) {
    try {
      JsonReader r(text);
      r.object([&](const std::string& key) {
        if (key != "eos_token" && key != "bos_token") {
          r.skip_value();
          return;
        }
        const JsonValue v = r.value();
        std::string& into = key == "eos_token" ? eos : bos_text;
        if (v.type == JsonValue::Type::String) {
          into = v.string;
        } else if (const JsonValue* c = v.find("content");
                   c && c->type == JsonValue::Type::String) {
          into = c->string;
        }
      });
    } catch (const JsonError& e) {
      throw ConfigError("'" + config + "' does not parse as JSON: " + e.message);
    }
    if (!bos_text.empty()) bos = token_to_id(bos_text);
  }
  if (!eod_token.empty()) {
    eod = token_to_id(eod_token);
    if (eod < 0)
      throw ConfigError("--eod-token '" + eod_token + "' is not a token of '" + path + "'");
    return;
  }
  if (!eos.empty()) {
    eod = token_to_id(eos);
    if (eod < 0)
      throw ConfigError("'" + config + "': eos_token '" + eos + "' is not a token of '" + path +
                        "'; name the end-of-document token with --eod-token");
    return;
  }
  for (const char* well_known : {"<|end_of_text|>", "<|endoftext|>", "</s>"}) {
    eod = token_to_id(well_known);
    if (eod >= 0) return;
  }
  throw ConfigError("'" + path +
                    "': no end-of-document token (no tokenizer_config.json with an eos_token "
                    "beside it, and none of <|end_of_text|>, <|endoftext|>, </s> is a token); "
                    "name it with --eod-token");
}

std::shared_ptr<const HfTokenizer> HfTokenizer::load(const std::string& path_or_dir,
                                                     const std::string& eod_token) {
  std::string file = path_or_dir;
  struct stat st;
  if (stat(file.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    file = (file.back() == '/' ? file : file + "/") + "tokenizer.json";
  std::string text;
  if (!read_file(file, text))
    throw ConfigError("--tokenizer-model '" + file +
                      "' cannot be read (give a tokenizer.json or the directory that holds it; "
                      "scripts/get-hf-tokenizers.sh fetches some)");
  auto impl = std::make_unique<Impl>();
  impl->load(file, text);
  impl->resolve_eod(eod_token);
  return std::shared_ptr<const HfTokenizer>(new HfTokenizer(std::move(impl)));
}

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

int64_t HfTokenizer::vocab_size() const {
  return impl_->vocab_size;
}
int32_t HfTokenizer::bos_id() const {
  return impl_->bos >= 0 ? impl_->bos : impl_->eod;
}

int32_t HfTokenizer::eod_id() const {
  return impl_->eod;
}
std::string HfTokenizer::name() const {
  return impl_->name;
}
const std::string& HfTokenizer::path() const {
  return impl_->path;
}

void HfTokenizer::encode(std::string_view text, std::vector<int32_t>& out, Cache& cache) const {
  impl_->encode(text, out, cache);
}

int32_t HfTokenizer::token_to_id(std::string_view token) const {
  return impl_->token_to_id(token);
}

std::vector<std::string> HfTokenizer::pretokenize(std::string_view text) const {
  std::vector<std::string> out;
  impl_->walk(
      text, [](int32_t) {}, [&](std::string_view piece) { out.emplace_back(piece); });
  return out;
}

const std::string& HfTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size)
    throw Error("token id " + std::to_string(id) + " is outside the vocabulary of " +
                std::to_string(impl_->vocab_size));
  return impl_->token_bytes[id];
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= impl_->vocab_size)
      throw Error("token id " + std::to_string(id) + " is outside the vocabulary of " +
                  std::to_string(impl_->vocab_size));
    if (impl_->present[id]) toks.push_back(impl_->id_to_token[id]);
  }
  std::string out;
  if (!impl_->has_decoder) {
    // The library joins the tokens with spaces when there is no decoder.
    for (size_t i = 0; i < toks.size(); ++i) out += (i ? " " : "") + toks[i];
    return out;
  }
  impl_->decoder.chain(toks, /*continuation=*/false);
  for (const std::string& t : toks) out += t;
  return out;
}

}  // namespace tessera
