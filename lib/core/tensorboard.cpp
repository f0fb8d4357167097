// tensorboard.cpp: TFRecord framing and the hand-encoded Event protobuf (see tensorboard.hpp).
#include "core/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <system_error>

#include "core/error.hpp"

namespace tessera {

namespace {

// The byte-at-a-time table of the reflected Castagnoli polynomial.
const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protobuf wire format: wire types 0 (varint), 1 (64-bit), 2 (length-delimited), 5 (32-bit).
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_tag(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}

// Little-endian fixed-width integers (the framing and the fixed32/fixed64 protobuf fields).
template <typename T>
void put_le(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_tag(out, field, 1);
  put_le(out, bits);
}

void put_float(std::string& out, int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_tag(out, field, 5);
  put_le(out, bits);
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  const auto& table = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  const auto fail = [&](const std::string& what, const std::string& why) {
    throw ConfigError("--tensorboard-dir '" + dir + "': cannot create '" + what + "': " + why);
  };
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail(dir, ec.message());

  char host[256] = "localhost";
  if (gethostname(host, sizeof host) != 0) std::strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  path_ =
      (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(std::time(nullptr)) +
                                     "." + host + "." + std::to_string(getpid()) + ".0"))
          .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) fail(path_, std::strerror(errno));

  try {
    std::string event;
    put_double(event, 1, wall_time());
    put_bytes(event, 7, "brain.Event:2");
    write_record(event);
    flush();
  } catch (...) {
    std::fclose(file_);
    throw;
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  std::string summary_value;
  put_bytes(summary_value, 1, tag);
  put_float(summary_value, 2, static_cast<float>(value));
  std::string summary;
  put_bytes(summary, 1, summary_value);

  std::string event;
  put_double(event, 1, wall_time());
  put_tag(event, 2, 0);
  put_varint(event, static_cast<uint64_t>(step));  // int64: negatives take 10 bytes
  put_bytes(event, 5, summary);
  write_record(event);
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0)
    throw Error("cannot write TensorBoard events to '" + path_ + "': " + std::strerror(errno));
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string record;
  put_le(record, static_cast<uint64_t>(data.size()));
  put_le(record, masked_crc32c(record.data(), 8));
  record += data;
  put_le(record, masked_crc32c(data.data(), data.size()));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size())
    throw Error("cannot write TensorBoard events to '" + path_ + "': " + std::strerror(errno));
}

}  // namespace tessera
