// safetensors.hpp: the safetensors format (Hugging Face): an 8-byte little-endian header length N,
// N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
// (padded with spaces to a multiple of 8), then the row-major tensor bytes, offsets relative to the
// end of the header. Written streaming (one tensor in memory at a time), read through mmap.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace tessera {

struct SafetensorsEntry {
  std::string dtype;  // "F32", "F16", "BF16"
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// Writes tensors stored as F32, BF16 or F16 from f32 data (rounded to nearest even): declare them
// all, then write each tensor's data in declaration order.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  void declare(const std::string& name, const Shape& shape, const std::string& dtype = "F32");
  void write(const std::string& name, const float* data);  // in declaration order
  // Bytes of the file's data so far declared (the header aside).
  uint64_t data_bytes() const;
  void finish();  // checks every tensor was written, closes, renames "<path>.tmp" to path

 private:
  void write_header();
  std::string path_;
  std::map<std::string, std::string> metadata_;
  struct Declared {
    std::string name;
    Shape shape;
    std::string dtype;
  };
  std::vector<Declared> tensors_;
  size_t next_ = 0;
  bool header_done_ = false;
  std::FILE* f_ = nullptr;
};

// Bytes per element of a safetensors dtype (F32, BF16, F16); 0 for others.
size_t safetensors_width(const std::string& dtype);
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);  // throws ConfigError naming the file
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  // The tensor converted to f32 (from F32, F16 or BF16).
  std::vector<float> read(const std::string& name) const;
  // The tensor's stored bytes.
  std::string raw(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::map<std::string, SafetensorsEntry> entries_;
  const unsigned char* map_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;
};

}  // namespace tessera

namespace tessera {

// The tensors of a Hugging Face model directory: DIR/model.safetensors, or the shards that
// DIR/model.safetensors.index.json maps names to (save_pretrained's sharded form).
class SafetensorsDir {
 public:
  explicit SafetensorsDir(const std::string& dir);  // throws ConfigError naming the file
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;
  const SafetensorsEntry& entry(const std::string& name) const;
  std::vector<float> read(const std::string& name) const;
  // The file holding `name` (for messages).
  const std::string& file_of(const std::string& name) const;

 private:
  const SafetensorsReader& reader(const std::string& name) const;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, size_t> where_;  // tensor -> files_ index
};

}  // namespace tessera
