// test_tensorboard.cpp: the TensorBoard event-file writer: CRC32C check values, TFRecord framing,
// the error for an unwritable directory, and the file read back by tests/core/read_tfevents.py.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensorboard.hpp"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

// A fresh directory under /tmp, removed with its contents at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/tessera_tb_XXXXXX";
    EXPECT_NE(mkdtemp(name), nullptr);
    path = name;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

template <typename T>
T load_le(const std::string& s, size_t pos) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i)
    v |= static_cast<T>(static_cast<unsigned char>(s[pos + i])) << (8 * i);
  return v;
}

// Splits a file into its TFRecord payloads, checking the framing; fails the test on any error.
std::vector<std::string> records_of(const std::string& file) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < file.size()) {
    EXPECT_LE(pos + 12, file.size()) << "truncated header at " << pos;
    if (pos + 12 > file.size()) break;
    const uint64_t length = load_le<uint64_t>(file, pos);
    EXPECT_EQ(load_le<uint32_t>(file, pos + 8), masked_crc32c(file.data() + pos, 8))
        << "length CRC of record " << out.size();
    const size_t start = pos + 12;
    EXPECT_LE(start + length + 4, file.size()) << "truncated record " << out.size();
    if (start + length + 4 > file.size()) break;
    EXPECT_EQ(load_le<uint32_t>(file, start + length), masked_crc32c(file.data() + start, length))
        << "data CRC of record " << out.size();
    out.push_back(file.substr(start, length));
    pos = start + length + 4;
  }
  return out;
}

bool have_python3() {
  return std::system("command -v python3 >/dev/null 2>&1") == 0;
}

// Runs `command` (stderr folded into stdout) and returns its exit status and output.
int run(const std::string& command, std::string& output) {
  output.clear();
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) output.append(buf, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string reader_command(const std::string& events_file) {
  return std::string("python3 '") + TESSERA_SOURCE_DIR + "/tests/core/read_tfevents.py' '" +
         events_file + "'";
}

struct Scalar {
  std::string tag;
  double value;
  int64_t step;
};

const std::vector<Scalar> kScalars = {{"lm loss", 2.5, 1},   {"learning-rate", 1e-4, 1},
                                      {"lm loss", 2.25, 2},  {"learning-rate", 1e-4, 2},
                                      {"lm loss", 2.125, 3}, {"learning-rate", 1e-4, 3}};

std::string write_scalars(const std::string& dir) {
  TensorBoardWriter writer(dir);
  for (const auto& s : kScalars) writer.add_scalar(s.tag, s.value, s.step);
  return writer.path();
}

}  // namespace

TEST(TensorBoard, Crc32cCheckValues) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c("", 0), 0u);
}

TEST(TensorBoard, FramingAndEncoding) {
  TempDir tmp;
  const std::string dir = tmp.path + "/runs/a";  // parents are created too
  const std::string path = write_scalars(dir);
  EXPECT_EQ(fs::path(path).parent_path(), fs::path(dir));
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u) << path;

  const auto records = records_of(read_file(path));
  ASSERT_EQ(records.size(), 1 + kScalars.size());
  // The first Event: wall_time (field 1, fixed64) then file_version (field 7, string).
  const std::string version = std::string("\x3a\x0d") + "brain.Event:2";
  ASSERT_EQ(records[0].size(), 9 + version.size());
  EXPECT_EQ(records[0][0], '\x09');
  EXPECT_EQ(records[0].substr(9), version);
  // A scalar Event: wall_time, step 3 (field 2, varint), summary (field 5) { value (field 1) {
  // tag (field 1) "lm loss", simple_value (field 2, fixed32) 2.125f } }.
  const float v = 2.125f;
  std::string bits(4, '\0');
  std::memcpy(&bits[0], &v, 4);  // little-endian host
  const std::string tail = std::string("\x10\x03\x2a\x10\x0a\x0e\x0a\x07", 8) + "lm loss" +
                           std::string("\x15", 1) + bits;
  const std::string& r = records[5];
  ASSERT_EQ(r.size(), 9 + tail.size());
  EXPECT_EQ(r[0], '\x09');
  EXPECT_EQ(r.substr(9), tail);
}

TEST(TensorBoard, UnwritableDirectoryIsAConfigError) {
  TempDir tmp;
  const std::string file = tmp.path + "/plain-file";
  std::ofstream(file) << "x";
  const std::string dir = file + "/tb";
  try {
    TensorBoardWriter writer(dir);
    FAIL() << "no ConfigError for " << dir;
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--tensorboard-dir"), std::string::npos) << what;
    EXPECT_NE(what.find("'" + dir + "'"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST(TensorBoard, IndependentReaderDecodesScalars) {
  if (!have_python3()) GTEST_SKIP() << "python3 not found";
  TempDir tmp;
  const std::string path = write_scalars(tmp.path);
  std::string output;
  ASSERT_EQ(run(reader_command(path), output), 0) << output;

  std::istringstream lines(output);
  std::string line;
  ASSERT_TRUE(std::getline(lines, line));
  EXPECT_EQ(line, "file_version brain.Event:2");
  for (const auto& s : kScalars) {
    ASSERT_TRUE(std::getline(lines, line)) << "missing " << s.tag << " at step " << s.step;
    // "<step> <tag> <value>": the tag may contain spaces, the value is the last word.
    const size_t first = line.find(' '), last = line.rfind(' ');
    ASSERT_NE(first, last) << line;
    EXPECT_EQ(std::stoll(line.substr(0, first)), s.step) << line;
    EXPECT_EQ(line.substr(first + 1, last - first - 1), s.tag) << line;
    EXPECT_EQ(std::strtod(line.c_str() + last + 1, nullptr),
              static_cast<double>(static_cast<float>(s.value)))
        << line;
  }
  EXPECT_FALSE(std::getline(lines, line)) << "extra line: " << line;
}

TEST(TensorBoard, IndependentReaderRejectsACorruptRecord) {
  if (!have_python3()) GTEST_SKIP() << "python3 not found";
  TempDir tmp;
  const std::string path = write_scalars(tmp.path);
  std::string bytes = read_file(path);
  // One byte in the data of the second record (the first scalar): skip the first record whole.
  const size_t second = 12 + load_le<uint64_t>(bytes, 0) + 4;
  bytes[second + 12 + 3] ^= 0x01;
  const std::string corrupt = tmp.path + "/events.out.tfevents.corrupt";
  std::ofstream(corrupt, std::ios::binary) << bytes;
  std::string output;
  EXPECT_NE(run(reader_command(corrupt), output), 0) << output;
  EXPECT_NE(output.find("data CRC mismatch"), std::string::npos) << output;
}
