// shard.hpp: the HDF5 token shard (DESIGN.md invariant 5; other tools read it, keep it stable):
//   /tokens       1-D uint16 (vocabulary <= 65536) or uint32, chunked (readers also take any
//                 integer type, and any HDF5 filter the library has: gzip from h5py)
//   /doc_offsets  1-D uint64, n_docs + 1 entries from 0; document i is
//                 tokens[doc_offsets[i] : doc_offsets[i+1]] and ends with the end-of-document token
//   /loss_mask    optional, 1-D uint8 (readers take any integer type), one per token of /tokens:
//                 1 = the token is a target whose loss counts, 0 = not (chat prompts); absent:
//                 every token counts
//   attributes    vocab_size (int64), eod_id (int64), tokenizer (string), format_version (int64);
//                 readers take integers of any width and sign, fixed or variable-length strings
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/hdf5_handle.hpp"

namespace tessera {

constexpr int64_t kShardFormatVersion = 1;

struct ShardMeta {
  int64_t vocab_size = 0;
  int64_t eod_id = 0;
  std::string tokenizer;
  int64_t format_version = kShardFormatVersion;
};

// Writes `path` atomically: to "<path>.tmp", then renamed. Throws Error naming the file. With a
// non-empty `loss_mask` (one 0/1 per token), also /loss_mask.
void write_shard(const std::string& path, const std::vector<uint32_t>& tokens,
                 const std::vector<uint64_t>& doc_offsets, const ShardMeta& meta,
                 const std::vector<uint8_t>& loss_mask = {});

// Opens a shard and checks its schema; every problem is an Error naming the file and the fix.
class ShardReader {
 public:
  explicit ShardReader(const std::string& path);
  const std::string& path() const { return path_; }
  const ShardMeta& meta() const { return meta_; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::vector<uint64_t>& doc_offsets() const { return doc_offsets_; }
  // Reads tokens [begin, begin + count) into out (as int32); ConfigError naming the document and
  // position of an id outside [0, vocab_size).
  void read(int64_t begin, int64_t count, int32_t* out) const;
  bool has_loss_mask() const { return loss_mask_.valid(); }
  // The loss mask of tokens [begin, begin + count) (all 1 without /loss_mask); ConfigError naming
  // the document and position of a value other than 0 or 1.
  void read_loss_mask(int64_t begin, int64_t count, uint8_t* out) const;

 private:
  // "document D (token I of the document, P of the shard)" of shard token `at`.
  std::string where(uint64_t at) const;

  std::string path_;
  ShardMeta meta_;
  H5Id file_, tokens_, loss_mask_;
  bool wide_ = false;  // /tokens is not uint16/uint32: read through int64
  int64_t num_tokens_ = 0;
  std::vector<uint64_t> doc_offsets_;
};

// The shards of a prefix: "<prefix>_00000.h5", "<prefix>_00001.h5", ... in order (or the single
// file "<prefix>.h5", or <prefix> itself when it names a .h5 file). Throws when there is none.
std::vector<std::string> shard_paths(const std::string& prefix);
std::string shard_path(const std::string& prefix, int index);

}  // namespace tessera
