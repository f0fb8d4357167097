// fuzz_shard.cpp: an HDF5 token shard of any bytes (seeds: shards written by tessera-preprocess
// and by h5py, mutated): the schema checks and every token read, with the vocabulary check.
// Bad input may only throw Error.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "data/shard.hpp"
#include "fuzz_util.hpp"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::scratch_dir() + "/corpus_00000.h5";
  fuzz::write_file(path, data, size);
  try {
    ShardReader r(path);
    std::vector<int32_t> buf(4096);
    const int64_t n = std::min<int64_t>(r.num_tokens(), 1 << 16);
    for (int64_t b = 0; b < n; b += 4096) r.read(b, std::min<int64_t>(4096, n - b), buf.data());
  } catch (const Error&) {
  }
  return 0;
}
