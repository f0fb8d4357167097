// fuzz_bpe.cpp: GPT-2's byte-level BPE round trip: decode(encode(bytes)) == bytes for any bytes
// (invalid UTF-8 included), and every id inside the vocabulary.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "data/tokenizer.hpp"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto tok = GPT2Tokenizer::load(TESSERA_SOURCE_DIR "/data/gpt2/encoder.json",
                                              TESSERA_SOURCE_DIR "/data/gpt2/vocab.bpe");
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> ids = tok->encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= tok->vocab_size()) std::abort();
  if (tok->decode(ids) != text) std::abort();
  return 0;
}
