// test_safetensors.cpp: the safetensors writer and reader against the format's definition.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "checkpoint/safetensors.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"

using namespace tessera;

namespace {
std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
}  // namespace

TEST(Safetensors, WriteThenReadFollowsTheFormat) {
  const std::string path = "/tmp/tessera_test.safetensors";
  std::vector<float> a(6), b(5);
  for (int i = 0; i < 6; ++i) a[i] = 0.5f * i - 1;
  for (int i = 0; i < 5; ++i) b[i] = 100.f + i;
  {
    SafetensorsWriter w(path, {{"format", "pt"}});
    w.declare("transformer.h.0.attn.c_attn.weight", {2, 3});
    w.declare("lm.bias", {5});
    w.write("transformer.h.0.attn.c_attn.weight", a.data());
    w.write("lm.bias", b.data());
    w.finish();
  }
  const std::string bytes = slurp(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);  // little-endian on the machines Tessera runs on
  EXPECT_EQ(n % 8, 0u) << "header padded to 8 bytes";
  EXPECT_EQ(bytes.size(), 8 + n + 4 * (6 + 5));
  const std::string header = bytes.substr(8, n);
  EXPECT_NE(header.find("\"__metadata__\":{\"format\":\"pt\"}"), std::string::npos) << header;
  EXPECT_NE(header.find("\"transformer.h.0.attn.c_attn.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],"
                        "\"data_offsets\":[0,24]}"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find("\"lm.bias\":{\"dtype\":\"F32\",\"shape\":[5],\"data_offsets\":[24,44]}"),
            std::string::npos);
  SafetensorsReader r(path);
  EXPECT_EQ(r.entries().size(), 2u);
  EXPECT_EQ(r.entries().at("lm.bias").shape, (Shape{5}));
  EXPECT_EQ(r.read("transformer.h.0.attn.c_attn.weight"), a);
  EXPECT_EQ(r.read("lm.bias"), b);
  EXPECT_THROW(r.read("missing"), ConfigError);
  std::remove(path.c_str());
}

TEST(Safetensors, ReadsHalfPrecisionAndRejectsDamage) {
  const std::string path = "/tmp/tessera_test16.safetensors";
  std::string header =
      "{\"x\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
      "\"y\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[4,6]}}";
  while (header.size() % 8) header += ' ';
  std::string file(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(&file[0], &n, 8);
  file += header;
  const uint16_t x0 = f32_to_bf16(1.5f), x1 = f32_to_bf16(-2.0f), y = f32_to_f16(0.25f);
  file.append(reinterpret_cast<const char*>(&x0), 2).append(reinterpret_cast<const char*>(&x1), 2);
  file.append(reinterpret_cast<const char*>(&y), 2);
  std::ofstream(path, std::ios::binary) << file;
  {
    SafetensorsReader r(path);
    EXPECT_EQ(r.read("x"), (std::vector<float>{1.5f, -2.0f}));
    EXPECT_EQ(r.read("y"), (std::vector<float>{0.25f}));
  }
  std::ofstream(path, std::ios::binary) << file.substr(0, file.size() - 3);  // truncated data
  try {
    SafetensorsReader r(path);
    FAIL() << "a truncated file was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::ofstream(path, std::ios::binary) << std::string("\x10\0\0\0\0\0\0\0{not json}      ", 24);
  EXPECT_THROW(SafetensorsReader r(path), ConfigError);
  // An offset past what a 64-bit integer holds (found by fuzz_safetensors): a one-line error
  // naming the file, not std::out_of_range from the number parser.
  std::string big =
      "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,99999999999999999999999]}}";
  while (big.size() % 8) big += ' ';
  std::string bad(8, '\0');
  const uint64_t nb = big.size();
  std::memcpy(&bad[0], &nb, 8);
  std::ofstream(path, std::ios::binary) << bad + big + std::string(4, '\0');
  try {
    SafetensorsReader r(path);
    FAIL() << "an out-of-range offset was accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("integer out of range"), std::string::npos) << m;
  }
  std::remove(path.c_str());
}

// The header goes through the bounded JSON reader: a tensor named twice (which one would be read?)
// and nesting past 512 levels (a stack overflow before) are one-line errors naming the file.
TEST(Safetensors, DuplicateTensorsAndDeepHeadersAreRefused) {
  const std::string path = "/tmp/tessera_test_bounds.safetensors";
  auto error_of = [&](std::string header, size_t data_bytes) -> std::string {
    while (header.size() % 8) header += ' ';
    std::string file(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(&file[0], &n, 8);
    std::ofstream(path, std::ios::binary) << file + header + std::string(data_bytes, '\0');
    try {
      SafetensorsReader r(path);
      return "accepted, " + std::to_string(r.entries().size()) + " tensors";
    } catch (const ConfigError& e) {
      return e.what();
    }
  };
  const std::string x = R"("x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  const std::string x2 = R"("x":{"dtype":"F32","shape":[2],"data_offsets":[4,12]})";
  EXPECT_EQ(error_of("{" + x + "}", 4), "accepted, 1 tensors");
  EXPECT_EQ(error_of("{" + x + "," + x2 + "}", 12),
            "'" + path + "': the safetensors header does not parse: duplicate key \"x\" at byte " +
                std::to_string(1 + x.size() + 1));
  const std::string deep(50000, '[');
  EXPECT_EQ(error_of("{\"__metadata__\":" + deep + std::string(50000, ']') + "," + x + "}", 4),
            "'" + path + "': the safetensors header does not parse: nesting deeper than 512 " +
                "levels at byte " + std::to_string(16 + 511));
  std::remove(path.c_str());
}
