// tokenizer.hpp: GPT-2's byte-level BPE, reading the standard encoder.json (vocab.json) and
// vocab.bpe (merges.txt) files. encode() pre-tokenizes with GPT-2's pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (Unicode letters and numbers from ICU, \s = Unicode White_Space), maps bytes to GPT-2's
// printable code points, and merges by rank. Any bytes round-trip: invalid UTF-8 is encoded byte
// by byte like any other symbol, so decode(encode(x)) == x for every byte string x.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tessera {

class GPT2Tokenizer {
 public:
  // Throws Error naming the file and line when a file is missing or does not parse.
  static std::shared_ptr<const GPT2Tokenizer> load(const std::string& vocab_file,
                                                   const std::string& merge_file);

  int64_t vocab_size() const { return static_cast<int64_t>(id_to_token_.size()); }
  int32_t eod_id() const { return eod_id_; }  // <|endoftext|>
  static const char* name() { return "gpt2-bpe"; }

  // Appends the ids of `text` to `out`. `cache` (word -> ids) may be shared by calls of one thread.
  using Cache = std::unordered_map<std::string, std::vector<int32_t>>;
  void encode(std::string_view text, std::vector<int32_t>& out, Cache& cache) const;
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  // The byte string of one token (throws for an id outside the vocabulary).
  const std::string& token_bytes(int32_t id) const;

  // Pre-tokenization alone: the byte ranges of the pieces of `text`, in order.
  static std::vector<std::string_view> pretokenize(std::string_view text);

 private:
  GPT2Tokenizer() = default;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;

  std::vector<std::string> id_to_token_;  // decoded bytes of every token
  int32_t byte_id_[256] = {};             // the one-byte token of each byte
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (a,b) -> (rank, merged)
  int32_t eod_id_ = -1;
};

}  // namespace tessera
