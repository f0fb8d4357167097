// tokenizer.cpp: GPT-2 byte-level BPE.
#include "data/tokenizer.hpp"

#include <unicode/uchar.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/json.hpp"
#include "data/hf_tokenizer.hpp"
#include "data/unicode.hpp"

namespace tessera {

namespace {

// Decodes one UTF-8 code point at s[i]; invalid or truncated sequences yield one byte with
// cp = 0xFFFFFFFF (a symbol that is neither letter, number nor space).
uint32_t next_cp(std::string_view s, size_t i, size_t& len) {
  const unsigned char c = s[i];
  auto cont = [&](size_t k) {
    return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
  };
  if (c < 0x80) {
    len = 1;
    return c;
  }
  if (c >= 0xC2 && c < 0xE0 && cont(1)) {
    len = 2;
    return ((c & 0x1Fu) << 6) | (s[i + 1] & 0x3F);
  }
  if (c >= 0xE0 && c < 0xF0 && cont(1) && cont(2)) {
    const uint32_t cp = ((c & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3F);
    if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) {
      len = 3;
      return cp;
    }
  }
  if (c >= 0xF0 && c < 0xF5 && cont(1) && cont(2) && cont(3)) {
    const uint32_t cp = ((c & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) |
                        ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3F);
    if (cp >= 0x10000 && cp <= 0x10FFFF) {
      len = 4;
      return cp;
    }
  }
  len = 1;
  return 0xFFFFFFFFu;
}

enum class Cls : uint8_t { Letter, Number, Space, Other };

Cls classify(uint32_t cp) {
  if (cp < 128) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return Cls::Letter;
    if (cp >= '0' && cp <= '9') return Cls::Number;
    if (cp == ' ' || (cp >= 9 && cp <= 13)) return Cls::Space;
    return Cls::Other;
  }
  if (cp == 0xFFFFFFFFu) return Cls::Other;
  const UChar32 c = static_cast<UChar32>(cp);
  if (u_isUWhiteSpace(c)) return Cls::Space;
  switch (u_charType(c)) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return Cls::Letter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return Cls::Number;
    default:
      return Cls::Other;
  }
}

std::string utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

std::string read_file(const std::string& path, const char* what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(std::string(what) + " '" + path +
                      "' is a directory; give the file itself (e.g. encoder.json for "
                      "--vocab-file, vocab.bpe for --merge-file)");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError(std::string(what) + " '" + path +
                      "' cannot be opened; run scripts/get-gpt2-vocab.sh or pass the right path");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::vector<std::string_view> GPT2Tokenizer::pretokenize(std::string_view s) {
  std::vector<std::string_view> out;
  const size_t n = s.size();
  size_t i = 0;
  auto cls_at = [&](size_t j, size_t& len) { return classify(next_cp(s, j, len)); };
  while (i < n) {
    size_t len = 0;
    // 's 't 're 've 'm 'll 'd
    if (s[i] == '\'' && i + 1 < n) {
      const char a = s[i + 1];
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        out.push_back(s.substr(i, 2));
        i += 2;
        continue;
      }
      const char b = i + 2 < n ? s[i + 2] : 0;
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        out.push_back(s.substr(i, 3));
        i += 3;
        continue;
      }
    }
    // ' ?' followed by a run of one class (letters, numbers, or "other")
    size_t j = i;
    if (s[j] == ' ' && j + 1 < n) {
      const Cls c = cls_at(j + 1, len);
      if (c != Cls::Space) ++j;
    }
    const Cls c = cls_at(j, len);
    if (c != Cls::Space) {
      size_t k = j + len;
      while (k < n) {
        size_t l2 = 0;
        if (cls_at(k, l2) != c) break;
        k += l2;
      }
      out.push_back(s.substr(i, k - i));
      i = k;
      continue;
    }
    // whitespace: \s+(?!\S) then \s+
    size_t k = i, last = i;
    while (k < n) {
      size_t l2 = 0;
      if (cls_at(k, l2) != Cls::Space) break;
      last = k;
      k += l2;
    }
    if (k < n && last > i) k = last;  // leave the last space to the following word
    out.push_back(s.substr(i, k - i));
    i = k;
  }
  return out;
}

std::shared_ptr<const GPT2Tokenizer> GPT2Tokenizer::load(const std::string& vocab_file,
                                                         const std::string& merge_file) {
  std::shared_ptr<GPT2Tokenizer> t(new GPT2Tokenizer());
  const std::array<uint32_t, 256> cp = gpt2_byte_to_codepoint();
  std::unordered_map<uint32_t, unsigned char> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[cp[b]] = static_cast<unsigned char>(b);
  // A token string of encoder.json is UTF-8 of byte-standing code points; decode it to bytes.
  auto to_bytes = [&](const std::string& tok, std::string& bytes) {
    bytes.clear();
    for (size_t i = 0; i < tok.size();) {
      size_t len = 0;
      const uint32_t c = next_cp(tok, i, len);
      auto it = cp_to_byte.find(c);
      if (it == cp_to_byte.end()) return false;
      bytes += static_cast<char>(it->second);
      i += len;
    }
    return true;
  };
  std::unordered_map<std::string, int32_t> token_to_id;
  {
    const std::string text = read_file(vocab_file, "--vocab-file");
    try {
      JsonReader r(text);
      std::string bytes;
      r.object([&](const std::string& key) {
        const int64_t id = r.int_value();
        if (id < 0 || id > 10000000)
          throw JsonError{"token id " + std::to_string(id) + " out of range"};
        if (key == "<|endoftext|>") {
          bytes = key;
          t->eod_id_ = static_cast<int32_t>(id);
        } else if (!to_bytes(key, bytes)) {
          throw JsonError{"token \"" + key + "\" is not byte-level BPE"};
        }
        if (static_cast<size_t>(id) >= t->id_to_token_.size()) t->id_to_token_.resize(id + 1);
        t->id_to_token_[id] = bytes;
        token_to_id[key] = static_cast<int32_t>(id);
      });
      r.expect_end();
    } catch (const JsonError& e) {
      throw ConfigError("--vocab-file '" + vocab_file +
                        "' does not parse as GPT-2 encoder.json: " + e.message);
    }
    if (t->eod_id_ < 0)
      throw ConfigError("--vocab-file '" + vocab_file + "' has no <|endoftext|> token");
  }
  for (int b = 0; b < 256; ++b) {
    auto it = token_to_id.find(utf8(cp[b]));
    if (it == token_to_id.end())
      throw ConfigError("--vocab-file '" + vocab_file + "' lacks the one-byte token of byte " +
                        std::to_string(b));
    t->byte_id_[b] = it->second;
  }
  {
    const std::string text = read_file(merge_file, "--merge-file");
    std::istringstream in(text);
    std::string line;
    int64_t lineno = 0;
    int32_t rank = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || (lineno == 1 && line.rfind("#version", 0) == 0)) continue;
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() ||
          line.find(' ', sp + 1) != std::string::npos)
        throw ConfigError("--merge-file '" + merge_file + "' line " + std::to_string(lineno) +
                          ": expected two tokens separated by one space");
      const std::string a = line.substr(0, sp), b = line.substr(sp + 1);
      auto ia = token_to_id.find(a), ib = token_to_id.find(b), im = token_to_id.find(a + b);
      if (ia == token_to_id.end() || ib == token_to_id.end() || im == token_to_id.end())
        throw ConfigError("--merge-file '" + merge_file + "' line " + std::to_string(lineno) +
                          ": merge '" + line + "' uses a token missing from the vocabulary file");
      const uint64_t key =
          (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second);
      t->merges_.emplace(key, std::make_pair(rank++, im->second));
    }
    if (rank == 0) throw ConfigError("--merge-file '" + merge_file + "' has no merges");
  }
  return t;
}

void GPT2Tokenizer::bpe(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<int32_t> w;
  w.reserve(word.size());
  for (unsigned char c : word) w.push_back(byte_id_[c]);
  while (w.size() > 1) {
    int32_t best_rank = INT32_MAX, best_merged = -1;
    int32_t first = -1, second = -1;
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      auto it = merges_.find((static_cast<uint64_t>(w[i]) << 32) | static_cast<uint32_t>(w[i + 1]));
      if (it != merges_.end() && it->second.first < best_rank) {
        best_rank = it->second.first;
        best_merged = it->second.second;
        first = w[i];
        second = w[i + 1];
      }
    }
    if (best_merged < 0) break;
    size_t o = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      if (i + 1 < w.size() && w[i] == first && w[i + 1] == second) {
        w[o++] = best_merged;
        ++i;
      } else {
        w[o++] = w[i];
      }
    }
    w.resize(o);
  }
  out.insert(out.end(), w.begin(), w.end());
}

void GPT2Tokenizer::encode(std::string_view text, std::vector<int32_t>& out, Cache& cache) const {
  std::string key;  // reused: the cache look-up allocates nothing once it has grown
  for (std::string_view piece : pretokenize(text)) {
    if (piece.size() == 1) {
      out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
      continue;
    }
    key.assign(piece.data(), piece.size());
    auto it = cache.find(key);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      continue;
    }
    std::vector<int32_t> ids;
    bpe(piece, ids);
    out.insert(out.end(), ids.begin(), ids.end());
    if (cache.size() < (1u << 20)) cache.emplace(key, std::move(ids));
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  Cache cache;
  std::vector<int32_t> out;
  encode(text, out, cache);
  return out;
}

const std::string& GPT2Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw Error("token id " + std::to_string(id) + " is outside the vocabulary of " +
                std::to_string(vocab_size()));
  return id_to_token_[id];
}

std::string GPT2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

std::shared_ptr<const Tokenizer> load_tokenizer(const TokenizerOptions& o) {
  if (o.type == "GPT2BPETokenizer") {
    if (!o.model.empty())
      throw ConfigError(
          "--tokenizer-model is for --tokenizer-type HuggingFaceTokenizer; "
          "GPT2BPETokenizer reads --vocab-file and --merge-file");
    if (!o.eod_token.empty())
      throw ConfigError(
          "--eod-token is for --tokenizer-type HuggingFaceTokenizer; "
          "GPT2BPETokenizer always ends documents with <|endoftext|>");
    if (o.vocab_file.empty() || o.merge_file.empty())
      throw ConfigError(
          "--tokenizer-type GPT2BPETokenizer needs --vocab-file encoder.json and "
          "--merge-file vocab.bpe (scripts/get-gpt2-vocab.sh fetches them)");
    return GPT2Tokenizer::load(o.vocab_file, o.merge_file);
  }
  if (o.type == "HuggingFaceTokenizer") {
    if (o.model.empty())
      throw ConfigError(
          "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
          "(a tokenizer.json, or the directory that holds it)");
    return HfTokenizer::load(o.model, o.eod_token);
  }
  throw ConfigError("--tokenizer-type '" + o.type +
                    "' is not supported (supported: GPT2BPETokenizer, HuggingFaceTokenizer)");
}

}  // namespace tessera
