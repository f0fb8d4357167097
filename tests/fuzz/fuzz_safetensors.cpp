// fuzz_safetensors.cpp: a .safetensors file of any bytes: the header parser and every tensor it
// declares read back. Bad input may only throw Error (ConfigError naming the file).
#include <cstdint>

#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "fuzz_util.hpp"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::scratch_dir() + "/model.safetensors";
  fuzz::write_file(path, data, size);
  try {
    SafetensorsReader r(path);
    for (const auto& [name, entry] : r.entries()) {
      (void)entry;
      (void)r.read(name);
      (void)r.raw(name);
    }
  } catch (const Error&) {
  }
  return 0;
}
