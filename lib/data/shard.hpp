// shard.hpp: the HDF5 token shard (DESIGN.md invariant 5; other tools read it, keep it stable):
//   /tokens       1-D uint16 (vocabulary <= 65536) or uint32, chunked (readers also take any
//                 integer type, and any HDF5 filter the library has: gzip from h5py)
//   /doc_offsets  1-D uint64, n_docs + 1 entries from 0; document i is
//                 tokens[doc_offsets[i] : doc_offsets[i+1]] and ends with the end-of-document token
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

// Writes `path` atomically: to "<path>.tmp", then renamed. Throws Error naming the file.
void write_shard(const std::string& path, const std::vector<uint32_t>& tokens,
                 const std::vector<uint64_t>& doc_offsets, const ShardMeta& meta);

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

 private:
  std::string path_;
  ShardMeta meta_;
  H5Id file_, tokens_;
  bool wide_ = false;  // /tokens is not uint16/uint32: read through int64
  int64_t num_tokens_ = 0;
  std::vector<uint64_t> doc_offsets_;
};

// The shards of a prefix: "<prefix>_00000.h5", "<prefix>_00001.h5", ... in order (or the single
// file "<prefix>.h5", or <prefix> itself when it names a .h5 file). Throws when there is none.
std::vector<std::string> shard_paths(const std::string& prefix);
std::string shard_path(const std::string& prefix, int index);

}  // namespace tessera
