// gpt2_vocab.hpp: the GPT-2 tokenizer the data tests share (files from scripts/get-gpt2-vocab.sh).
#pragma once

#include <memory>
#include <string>

#include "data/tokenizer.hpp"

namespace tessera::testing {

inline const std::string kVocabDir = TESSERA_SOURCE_DIR "/data/gpt2";

inline std::shared_ptr<const GPT2Tokenizer> gpt2() {
  static auto t = GPT2Tokenizer::load(kVocabDir + "/encoder.json", kVocabDir + "/vocab.bpe");
  return t;
}

}  // namespace tessera::testing
