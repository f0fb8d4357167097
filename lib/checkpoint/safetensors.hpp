// safetensors.hpp: the safetensors format (Hugging Face): an 8-byte little-endian header length N,
// N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
// (padded with spaces to a multiple of 8), then the row-major tensor bytes, offsets relative to the
// end of the header. Written streaming (one tensor in memory at a time), read through mmap.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace tessera {

struct SafetensorsEntry {
  std::string dtype;  // "F32", "F16", "BF16"
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// Writes f32 tensors: declare them all, then write each tensor's data in declaration order.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  void declare(const std::string& name, const Shape& shape);
  void write(const std::string& name, const float* data);  // in declaration order
  void finish();  // checks every tensor was written, closes, renames "<path>.tmp" to path

 private:
  void write_header();
  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::pair<std::string, Shape>> tensors_;
  size_t next_ = 0;
  bool header_done_ = false;
  std::FILE* f_ = nullptr;
};

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
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::map<std::string, SafetensorsEntry> entries_;
  const unsigned char* map_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;
};

}  // namespace tessera
