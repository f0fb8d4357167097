// fuzz_util.hpp: what the fuzz targets share: a private scratch directory and writing the input
// to a file in it (the readers under test take paths).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace tessera::fuzz {

inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/tessera_fuzz_XXXXXX";
    const char* d = mkdtemp(tmpl.data());
    if (!d) std::abort();
    return std::string(d);
  }();
  return dir;
}

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

}  // namespace tessera::fuzz
