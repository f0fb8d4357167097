// tokenizer.hpp: the tokenizer interface that preprocessing and generation use, the options that
// choose one (Megatron's --tokenizer-type; the Hugging Face kind is data/hf_tokenizer.hpp), and
// GPT-2's byte-level BPE from the standard encoder.json (vocab.json) and vocab.bpe (merges.txt)
// files. GPT2Tokenizer::encode() pre-tokenizes with GPT-2's pattern
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

// A text <-> ids tokenizer. Implementations are immutable after loading, so one object serves
// every thread; per-thread state lives in the Cache the caller owns.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  virtual int32_t eod_id() const = 0;  // the end-of-document token
  // The token --add-BOS prepends to a prompt: the tokenizer's beginning-of-sequence token, or the
  // end-of-document token where it has none (GPT-2; Megatron-LM prepends eod there too).
  virtual int32_t bos_id() const { return eod_id(); }
  // Identifies the tokenizer in the shard attribute `tokenizer` (docs/data.md).
  virtual std::string name() const = 0;

  // Appends the ids of `text` to `out`. `cache` (piece -> ids) may be shared by calls of one
  // thread.
  using Cache = std::unordered_map<std::string, std::vector<int32_t>>;
  virtual void encode(std::string_view text, std::vector<int32_t>& out, Cache& cache) const = 0;
  std::vector<int32_t> encode(std::string_view text) const;
  // The text of a whole sequence of ids (as the tokenizer's own decode gives it).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // The bytes one token adds to running text (streaming output; a multi-byte character may be
  // split over tokens). Throws for an id outside the vocabulary.
  virtual const std::string& token_bytes(int32_t id) const = 0;
  // The id of `token` when the tokenizer has it as one token (a chat template's special tokens),
  // else -1.
  virtual int32_t special_token_id(std::string_view token) const {
    (void)token;
    return -1;
  }
};

// Megatron's tokenizer options.
struct TokenizerOptions {
  // --tokenizer-type: GPT2BPETokenizer | HuggingFaceTokenizer
  std::string type = "GPT2BPETokenizer";
  std::string vocab_file, merge_file;  // --vocab-file, --merge-file (GPT2BPETokenizer)
  std::string model;      // --tokenizer-model: tokenizer.json, or the directory that holds it
  std::string eod_token;  // --eod-token: overrides the end-of-document token (HuggingFaceTokenizer)
};

// Loads the tokenizer the options name. ConfigError (one line naming the option or the file and
// what is wrong) for a bad combination of options, a missing file or an unsupported tokenizer.
std::shared_ptr<const Tokenizer> load_tokenizer(const TokenizerOptions& opts);

class GPT2Tokenizer final : public Tokenizer {
 public:
  // Throws Error naming the file and line when a file is missing or does not parse.
  static std::shared_ptr<const GPT2Tokenizer> load(const std::string& vocab_file,
                                                   const std::string& merge_file);

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  int32_t eod_id() const override { return eod_id_; }  // <|endoftext|>
  std::string name() const override { return "gpt2-bpe"; }

  using Tokenizer::encode;
  void encode(std::string_view text, std::vector<int32_t>& out, Cache& cache) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  const std::string& token_bytes(int32_t id) const override;
  // <|endoftext|>: GPT-2's one special token.
  int32_t special_token_id(std::string_view token) const override {
    return token == "<|endoftext|>" ? eod_id_ : -1;
  }

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
