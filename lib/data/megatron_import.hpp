// megatron_import.hpp: a Megatron-LM indexed dataset (MMapIndexedDataset, PREFIX.bin + PREFIX.idx,
// index version 1) into Tessera's HDF5 token shards, tokens unchanged.
//
// PREFIX.idx (little-endian): the 9 magic bytes "MMIDIDX\0\0", uint64 version (1), uint8 dtype
// code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), uint64
// sequence count S, uint64 document-index count D, int32 sequence lengths[S] (in tokens), int64
// sequence byte offsets into PREFIX.bin[S], int64 document index[D] (document d is sequences
// [index[d], index[d+1]); index[0] = 0, index[D-1] = S). PREFIX.bin holds the tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "data/preprocess.hpp"
#include "data/tokenizer.hpp"

namespace tessera {

// Each Megatron document (its sequences joined) becomes one document of the shards, whose
// attributes name `tok` (the tokenizer the data was made with). Throws ConfigError naming the
// file for a bad magic, another version or dtype, an index inconsistent with itself or a .bin
// shorter than it says, and a token outside the tokenizer's vocabulary (naming the document).
// `progress` as for preprocess().
PreprocessResult import_megatron_dataset(
    const std::string& prefix, const std::string& output_prefix, int64_t shard_tokens,
    const Tokenizer& tok, const std::function<void(const std::string&, bool final)>& progress,
    bool tty);

}  // namespace tessera
