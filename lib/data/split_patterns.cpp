// split_patterns.cpp: hand-coded matchers of the known pre-tokenizer regexes. Each alternative is
// tried in the regex's order at the current position; where a greedy quantifier must give back
// characters for the rest of the alternative to match, the comment says what backtracking finds.
#include "data/split_patterns.hpp"

#include "data/unicode.hpp"

namespace tessera {

namespace {

const std::string kGpt2 =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re";
const std::string kCl100k =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
const std::string kQwen2 =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
const std::string kO200k =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";
const std::string kTekken =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and [\p{Ll}\p{Lm}\p{Lo}\p{M}] of o200k and tekken.
constexpr uint8_t kUpper = kClsLu | kClsLt | kClsLm | kClsLo | kClsM;
constexpr uint8_t kLower = kClsLl | kClsLm | kClsLo | kClsM;

// A view of valid UTF-8 with class look-ups.
struct Cursor {
  std::string_view s;
  size_t n() const { return s.size(); }
  uint8_t cls(size_t i, size_t& len) const { return unicode_class(utf8_at(s, i, len)); }
  bool is_crlf(size_t i) const { return s[i] == '\r' || s[i] == '\n'; }
  // "Other": [^\s\p{L}\p{N}]
  static bool other(uint8_t c) { return (c & (kClsWs | kClsL | kClsN)) == 0; }
  // End of the run of characters from i whose class has a bit of `mask` (at most `max` of them).
  size_t run(size_t i, uint8_t mask, size_t max = SIZE_MAX) const {
    size_t len = 0, count = 0;
    while (i < n() && count < max && (cls(i, len) & mask)) {
      i += len;
      ++count;
    }
    return i;
  }
  size_t other_run(size_t i) const {
    size_t len = 0;
    while (i < n() && other(cls(i, len))) i += len;
    return i;
  }
  // (?i:'s|'t|'re|'ve|'m|'ll|'d) at i: its length, or 0. Case folding is Unicode's, so U+017F
  // (long s) matches 's' as in Oniguruma.
  size_t contraction(size_t i) const {
    if (i + 1 >= n() || s[i] != '\'') return 0;
    size_t l1 = 0;
    const uint32_t c1 = utf8_at(s, i + 1, l1);
    if (c1 == 0x17F) return 1 + l1;
    if (c1 >= 128) return 0;
    const char a = static_cast<char>(c1 | 0x20);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (i + 2 >= n()) return 0;
    const char b = static_cast<char>(s[i + 2] | 0x20);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
  }
  // The whitespace alternatives shared by every pattern, at i where s[i] is whitespace:
  // [\s*[\r\n]+ |] \s+(?!\S) | \s+
  size_t whitespace(size_t i, bool newline_alternative) const {
    size_t k = i, len = 0, last_start = i, after_crlf = 0;
    while (k < n() && (cls(k, len) & kClsWs)) {
      last_start = k;
      if (is_crlf(k)) after_crlf = k + 1;
      k += len;
    }
    // \s*[\r\n]+: \s* gives back characters until [\r\n]+ can match: the match ends after the
    // run's last CR or LF.
    if (newline_alternative && after_crlf) return after_crlf - i;
    // \s+(?!\S): the whole run at the end of the text, else all but its last character (which
    // then precedes another whitespace character), if that leaves one.
    if (k == n()) return k - i;
    if (last_start > i) return last_start - i;
    return k - i;  // \s+
  }
};

size_t match_gpt2(const Cursor& t, size_t i) {
  // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive)
  if (t.s[i] == '\'' && i + 1 < t.n()) {
    const char a = t.s[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    const char b = i + 2 < t.n() ? t.s[i + 2] : 0;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  }
  size_t len = 0;
  // ' ?\p{L}+ | ?\p{N}+ | ?[^\s\p{L}\p{N}]+': the optional space only when a run follows it.
  size_t j = i;
  uint8_t c = t.cls(j, len);
  if (t.s[i] == ' ' && i + 1 < t.n()) {
    size_t l2 = 0;
    const uint8_t c2 = t.cls(i + 1, l2);
    if (!(c2 & kClsWs)) {
      j = i + 1;
      c = c2;
    }
  }
  if (c & kClsL) return t.run(j, kClsL) - i;
  if (c & kClsN) return t.run(j, kClsN) - i;
  if (Cursor::other(c)) return t.other_run(j) - i;
  return t.whitespace(i, /*newline_alternative=*/false);
}

// cl100k (max_digits 3) and Qwen2 (max_digits 1).
size_t match_cl100k(const Cursor& t, size_t i, size_t max_digits) {
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)
  if (size_t c = t.contraction(i)) return c;
  size_t len = 0;
  const uint8_t c0 = t.cls(i, len);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (!(c0 & (kClsL | kClsN)) && !t.is_crlf(i) && i + len < t.n()) {
    size_t l2 = 0;
    if (t.cls(i + len, l2) & kClsL) return t.run(i + len, kClsL) - i;
  }
  if (c0 & kClsL) return t.run(i, kClsL) - i;
  // \p{N}{1,3}
  if (c0 & kClsN) return t.run(i, kClsN, max_digits) - i;
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  size_t j = i;
  if (t.s[i] == ' ' && i + 1 < t.n()) {
    size_t l2 = 0;
    if (Cursor::other(t.cls(i + 1, l2))) j = i + 1;
  }
  if (j < t.n() && Cursor::other(t.cls(j, len))) {
    size_t k = t.other_run(j);
    while (k < t.n() && t.is_crlf(k)) ++k;
    return k - i;
  }
  return t.whitespace(i, /*newline_alternative=*/true);
}

// o200k (contractions, max_digits 3) and tekken (no contractions, max_digits 1).
size_t match_o200k(const Cursor& t, size_t i, bool contractions, size_t max_digits) {
  size_t len = 0;
  const uint8_t c0 = t.cls(i, len);
  // [^\r\n\p{L}\p{N}]?: tried first with the character, then without it.
  const bool prefix = !(c0 & (kClsL | kClsN)) && !t.is_crlf(i);
  const size_t starts[2] = {i + len, i};
  const int n_starts = prefix ? 2 : 1;
  const size_t* first = prefix ? starts : starts + 1;
  auto suffix = [&](size_t e) { return contractions ? e + t.contraction(e) : e; };
  // [Upper]*[Lower]+: the upper run, then a lower run after it; if none follows, the upper run
  // gives back characters until its last character that is also in [Lower] (Lm, Lo, M).
  for (int k = 0; k < n_starts; ++k) {
    const size_t j = first[k];
    size_t p = j, l = 0, last_lower_end = 0;
    while (p < t.n()) {
      const uint8_t c = t.cls(p, l);
      if (!(c & kUpper)) break;
      p += l;
      if (c & kLower) last_lower_end = p;
    }
    if (p < t.n() && (t.cls(p, l) & kLower)) return suffix(t.run(p, kLower)) - i;
    if (last_lower_end) return suffix(last_lower_end) - i;
  }
  // [Upper]+[Lower]*
  for (int k = 0; k < n_starts; ++k) {
    const size_t j = first[k];
    size_t l = 0;
    if (j < t.n() && (t.cls(j, l) & kUpper)) return suffix(t.run(t.run(j, kUpper), kLower)) - i;
  }
  // \p{N}{1,3} or \p{N}
  if (c0 & kClsN) return t.run(i, kClsN, max_digits) - i;
  // ' ?[^\s\p{L}\p{N}]+[\r\n/]*'
  size_t j = i;
  if (t.s[i] == ' ' && i + 1 < t.n()) {
    size_t l2 = 0;
    if (Cursor::other(t.cls(i + 1, l2))) j = i + 1;
  }
  if (j < t.n() && Cursor::other(t.cls(j, len))) {
    size_t k = t.other_run(j);
    while (k < t.n() && (t.is_crlf(k) || t.s[k] == '/')) ++k;
    return k - i;
  }
  return t.whitespace(i, /*newline_alternative=*/true);
}

}  // namespace

bool find_split_pattern(const std::string& regex, SplitPattern& out) {
  for (SplitPattern p : {SplitPattern::Gpt2, SplitPattern::Cl100k, SplitPattern::Qwen2,
                         SplitPattern::O200k, SplitPattern::Tekken})
    if (split_pattern_regex(p) == regex) {
      out = p;
      return true;
    }
  return false;
}

const std::string& split_pattern_regex(SplitPattern p) {
  switch (p) {
    case SplitPattern::Gpt2:
      return kGpt2;
    case SplitPattern::Cl100k:
      return kCl100k;
    case SplitPattern::Qwen2:
      return kQwen2;
    case SplitPattern::O200k:
      return kO200k;
    case SplitPattern::Tekken:
      break;
  }
  return kTekken;
}

const char* split_pattern_name(SplitPattern p) {
  switch (p) {
    case SplitPattern::Gpt2:
      return "GPT-2";
    case SplitPattern::Cl100k:
      return "Llama 3 / cl100k";
    case SplitPattern::Qwen2:
      return "Qwen2";
    case SplitPattern::O200k:
      return "GPT-4o / o200k";
    case SplitPattern::Tekken:
      break;
  }
  return "Mistral NeMo / tekken";
}

size_t split_pattern_match(SplitPattern p, std::string_view s, size_t i) {
  const Cursor t{s};
  switch (p) {
    case SplitPattern::Gpt2:
      return match_gpt2(t, i);
    case SplitPattern::Cl100k:
      return match_cl100k(t, i, 3);
    case SplitPattern::Qwen2:
      return match_cl100k(t, i, 1);
    case SplitPattern::O200k:
      return match_o200k(t, i, true, 3);
    case SplitPattern::Tekken:
      break;
  }
  return match_o200k(t, i, false, 1);
}

void split_pattern_find_all(SplitPattern p, std::string_view s,
                            std::vector<std::pair<size_t, size_t>>& out) {
  out.clear();
  size_t i = 0;
  while (i < s.size()) {
    const size_t m = split_pattern_match(p, s, i);
    if (m > 0) {
      out.emplace_back(i, i + m);
      i += m;
    } else {
      size_t len = 0;
      utf8_at(s, i, len);  // no match here: the next one starts at a later character
      i += len;
    }
  }
}

}  // namespace tessera
