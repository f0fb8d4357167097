// packing.cpp: first-fit with a max segment tree over the bins' free room (data/packing.hpp).
#include "data/packing.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace tessera {

Packing pack_first_fit(const std::vector<int64_t>& docs, const std::vector<int64_t>& length,
                       int64_t capacity) {
  TESSERA_CHECK(docs.size() == length.size() && capacity > 0, "packing: bad arguments");
  const size_t n = docs.size();
  Packing p;
  if (n == 0) return p;
  // Leaves: the free room of bins 0..n-1 (a bin never opened has all of it, so the leftmost leaf
  // with room is the first opened bin that fits, or the next new one).
  size_t leaves = 1;
  while (leaves < n) leaves *= 2;
  std::vector<int64_t> tree(2 * leaves, 0);
  for (size_t i = 0; i < n; ++i) tree[leaves + i] = capacity;
  for (size_t i = leaves - 1; i > 0; --i) tree[i] = std::max(tree[2 * i], tree[2 * i + 1]);
  std::vector<int64_t> bin_of(n), len(n);
  int64_t opened = 0;
  for (size_t i = 0; i < n; ++i) {
    len[i] = std::min(length[i], capacity);
    p.truncated += length[i] > capacity;
    p.tokens += len[i];
    size_t node = 1;  // the leftmost leaf with room >= len[i]
    while (node < leaves) node = tree[2 * node] >= len[i] ? 2 * node : 2 * node + 1;
    const int64_t bin = static_cast<int64_t>(node - leaves);
    bin_of[i] = bin;
    opened = std::max(opened, bin + 1);
    tree[node] -= len[i];
    for (node /= 2; node > 0; node /= 2) tree[node] = std::max(tree[2 * node], tree[2 * node + 1]);
  }
  // Pieces grouped by bin, in placement order within each (a counting sort).
  std::vector<int64_t> count(static_cast<size_t>(opened) + 1, 0);
  for (size_t i = 0; i < n; ++i) ++count[static_cast<size_t>(bin_of[i]) + 1];
  for (size_t b = 1; b < count.size(); ++b) count[b] += count[b - 1];
  p.bin_begin = count;
  p.piece_doc.resize(n);
  p.piece_len.resize(n);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t at = next[static_cast<size_t>(bin_of[i])]++;
    p.piece_doc[static_cast<size_t>(at)] = docs[i];
    p.piece_len[static_cast<size_t>(at)] = len[i];
  }
  return p;
}

}  // namespace tessera
