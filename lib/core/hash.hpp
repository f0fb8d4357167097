// hash.hpp: XXH64 (xxHash, 64-bit, seed 0) of a byte range: the per-tensor checksum of
// checkpoints. It is the standard algorithm, so `xxhsum -H1` on the raw little-endian tensor bytes
// gives the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera {

uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);

}  // namespace tessera
