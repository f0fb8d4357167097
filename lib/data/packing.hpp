// packing.hpp: --sft's packing of whole documents into samples (docs/data.md, "Packed
// sequences"): first-fit, in a given document order, into bins of a fixed number of tokens; a
// document longer than a bin is cut to the bin's length (and counted).
#pragma once

#include <cstdint>
#include <vector>

namespace tessera {

struct Packing {
  // Bin b holds pieces [bin_begin[b], bin_begin[b + 1]): document piece_doc[i]'s first
  // piece_len[i] tokens, in placement order.
  std::vector<int64_t> bin_begin{0};
  std::vector<int64_t> piece_doc;
  std::vector<int64_t> piece_len;
  int64_t truncated = 0;  // documents cut to the bin's length
  int64_t tokens = 0;     // tokens placed
  int64_t bins() const { return static_cast<int64_t>(bin_begin.size()) - 1; }
};

// Documents docs[i] of lengths length[i], placed in that order: each into the first bin (in
// opening order) with room for it, a new bin when none has. O(n log n).
Packing pack_first_fit(const std::vector<int64_t>& docs, const std::vector<int64_t>& length,
                       int64_t capacity);

}  // namespace tessera
