// tensorboard.hpp: a self-contained writer of TensorBoard event files (scalars only), so training
// curves can be viewed with `tensorboard --logdir DIR` without TensorFlow or protobuf.
//
// What it writes, as TensorFlow's EventsWriter does:
//  - one file DIR/events.out.tfevents.<unix seconds>.<hostname>.<pid>.0 (TensorBoard only looks at
//    the "events.out.tfevents." prefix);
//  - a sequence of TFRecords, each framed as
//      uint64 length (little-endian), uint32 masked_crc32c(the 8 length bytes),
//      length data bytes, uint32 masked_crc32c(data)
//    with masked_crc = ((crc >> 15) | (crc << 17)) + 0xa282ead8 and crc the CRC32C (Castagnoli);
//  - each record's data is a hand-encoded tensorflow.Event protobuf: Event { double wall_time = 1;
//    int64 step = 2; Summary summary = 5; string file_version = 7; }, Summary { repeated Value
//    value = 1; }, Value { string tag = 1; float simple_value = 2; }.
//    The first record carries wall_time and file_version "brain.Event:2"; each add_scalar() call
//    appends one Event with wall_time, step and a one-value summary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace tessera {

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF).
uint32_t crc32c(const void* data, size_t size);
// The CRC stored in TFRecord framing: crc32c rotated right by 15 bits plus 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size);

class TensorBoardWriter {
 public:
  // Creates `dir` (with its parents) and a new events file in it, and writes the file_version
  // record. Throws ConfigError naming --tensorboard-dir when either cannot be created.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();  // flushes and closes
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Appends a scalar summary `tag` = `value` (stored as float32) at `step`. Throws Error on a
  // failed write.
  void add_scalar(const std::string& tag, double value, int64_t step);
  // Hands buffered records to the operating system. Throws Error on failure.
  void flush();
  // The events file being written.
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace tessera
