// preprocess.hpp: text -> HDF5 token shards. A reader streams documents from jsonl or text files in
// order, N worker threads tokenize batches of them, a writer puts them back in input order and cuts
// shards of about `shard_tokens` tokens (documents are never split). Shards are written under
// temporary names and renamed only when the whole run succeeded, so a failed run leaves nothing
// under the final names.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/chat_template.hpp"
#include "data/shard.hpp"
#include "data/tokenizer.hpp"

namespace tessera {

struct PreprocessOptions {
  std::vector<std::string> inputs;  // files or glob patterns
  std::string json_key = "text";
  bool split_lines = false;  // plain text: one document per non-empty line
  std::string output_prefix;
  int workers = 1;
  int64_t shard_tokens = 100'000'000;
  bool append_eod = true;
  double progress_seconds = 5;  // between plain progress lines when not on a terminal
  // Chat data (--chat-template): each jsonl line's json_key is a list of messages, rendered with
  // chat_format and written with /loss_mask (data/chat_template.hpp); the EOD appended after a
  // conversation is not a target.
  bool chat = false;
  ChatFormat chat_format = ChatFormat::ChatML;
  std::string chat_default_system;  // ChatML: the template's system message when one is missing
};

struct PreprocessResult {
  int64_t documents = 0, tokens = 0, bytes = 0;
  std::vector<std::string> shards;
  double seconds = 0;
  // Chat data: conversations left out because no token of theirs is a target (no assistant
  // turn), and where the first of them is (FILE:LINE).
  int64_t skipped = 0;
  std::string first_skipped;
  std::string note;  // what a user should know about the output (empty: nothing)
};

// Documents in, shards of about `shard_tokens` tokens out (a document is never split), written
// under temporary names; commit() renames them into place and removes stale shards of an earlier,
// longer run of the prefix. Destroyed without commit (a failure), it removes what it wrote.
class ShardWriter {
 public:
  ShardWriter(std::string prefix, int64_t shard_tokens, ShardMeta meta);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  // One document; ConfigError naming it when an id is outside the vocabulary of the meta. With
  // `mask` (one 0/1 per token), the shards get /loss_mask (every document must then have one).
  void add(const uint32_t* tokens, size_t n, const uint8_t* mask = nullptr);
  // Shards written so far, the one being filled included.
  size_t shards() const { return tmp_.size() + (offsets_.size() > 1 ? 1 : 0); }
  std::vector<std::string> commit();  // the final names

 private:
  void flush();
  std::string prefix_;
  int64_t shard_tokens_;
  ShardMeta meta_;
  std::vector<uint32_t> tokens_;
  std::vector<uint8_t> mask_;  // with masks: one per token of tokens_
  bool masked_ = false;        // the documents come with masks
  std::vector<uint64_t> offsets_{0};
  std::vector<std::string> tmp_;
  int64_t documents_ = 0;  // added so far
  bool committed_ = false;
};

// Expands globs and checks every input exists (ConfigError naming the first that does not).
std::vector<std::string> expand_inputs(const std::vector<std::string>& patterns);
// "100M" -> 100000000 (K, M, G suffixes, powers of 1000). ConfigError naming --shard-size.
int64_t parse_token_count(const std::string& text);

// Runs the pipeline. `progress` (may be empty) receives one status line at a time; `tty` chooses
// a carriage-return progress bar over periodic lines. Throws Error naming the file and line of a
// bad input; then no shard of this run exists under its final name.
PreprocessResult preprocess(const PreprocessOptions& opts, const Tokenizer& tokenizer,
                            const std::function<void(const std::string&, bool final)>& progress,
                            bool tty);

}  // namespace tessera
