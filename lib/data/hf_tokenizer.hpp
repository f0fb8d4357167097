// hf_tokenizer.hpp: a Hugging Face tokenizer.json of the BPE kind, encoded exactly as the
// `tokenizers` library does (with split_special_tokens false and no post-processing, so no BOS or
// EOS is added): added tokens split out of the raw text, then normalizer, pre-tokenizer, BPE model;
// decoding through the file's decoder. Supported, for Llama 3 / 3.1, GPT-4o, Mistral NeMo (tekken),
// Qwen2, GPT-NeoX and SentencePiece-style BPE (Llama 2, Mistral 7B v0.1):
//   model        BPE: vocab, merges ("a b" strings or ["a", "b"] pairs), ignore_merges,
//                byte_fallback, unk_token, fuse_unk, continuing_subword_prefix, end_of_word_suffix
//   normalizer   NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace (String pattern), Strip,
//   Sequence pre_tokenizer ByteLevel (last), Split (String pattern, or one of the regexes of
//                data/split_patterns.hpp; any behavior, invert), Metaspace, Digits, Sequence
//   decoder      ByteLevel, Metaspace, Replace (String pattern), ByteFallback, Fuse, Strip,
//   Sequence
// Anything else is refused at load with one line naming the file and the part.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.hpp"

namespace tessera {

class HfTokenizer final : public Tokenizer {
 public:
  // `path`: tokenizer.json, or the directory that holds it. The end-of-document token is
  // `eod_token` when not empty, else the eos_token of tokenizer_config.json beside the file, else
  // the first of <|end_of_text|>, <|endoftext|>, </s> that is a token. ConfigError naming the file
  // and the part for anything unsupported or missing.
  static std::shared_ptr<const HfTokenizer> load(const std::string& path,
                                                 const std::string& eod_token = "");
  ~HfTokenizer() override;

  int64_t vocab_size() const override;  // largest id (vocabulary or added token) + 1
  int32_t eod_id() const override;
  // bos_token of tokenizer_config.json when it names a token, else the end-of-document token.
  int32_t bos_id() const override;
  // "hf:xxh64:<16 hex digits>": the XXH64 of tokenizer.json's bytes (`xxhsum -H1 tokenizer.json`).
  std::string name() const override;

  using Tokenizer::encode;
  // Ill-formed UTF-8 in `text` is first replaced by U+FFFD (one per maximal subpart), as reading
  // the text as UTF-8 with errors="replace" would.
  void encode(std::string_view text, std::vector<int32_t>& out, Cache& cache) const override;
  // What the library's decode(ids) gives (special tokens kept); ids inside the range that name no
  // token are skipped.
  std::string decode(const std::vector<int32_t>& ids) const override;
  // A token's bytes as it continues running text: ByteLevel bytes, ByteFallback bytes raw,
  // metaspace as a space, no first-token stripping.
  const std::string& token_bytes(int32_t id) const override;

  // The id of a token string (added tokens first, then the model's vocabulary), -1 when absent.
  int32_t token_to_id(std::string_view token) const;
  int32_t special_token_id(std::string_view token) const override { return token_to_id(token); }
  // The pre-tokenizer's pieces of `text` (added tokens split out, normalized; ByteLevel pieces are
  // raw bytes, not the byte-to-character mapping). For tests and diagnostics.
  std::vector<std::string> pretokenize(std::string_view text) const;
  const std::string& path() const;  // the tokenizer.json read

  struct Impl;

 private:
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera
