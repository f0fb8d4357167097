// alibi.hpp: ALiBi (Press et al., "Train Short, Test Long"): no position embedding; each attention
// head h adds slope_h * (j - i) to the score of query position i and key position j <= i, a
// linear penalty on distance. The slopes are the paper's geometric sequence, keyed by the global
// head index so every tensor-parallel layout uses the same one; shared by the CPU and CUDA
// kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.hpp"

namespace tessera {

// The slope of head `head` of `heads`: with p the largest power of two <= heads, 2^(-8(h+1)/p)
// for the first p heads, then 2^(-4(2k+1)/p) for head p + k (the odd terms of the sequence of 2p
// heads), as the reference implementation (and BLOOM, MPT) computes them.
TESSERA_HD float alibi_slope(int64_t head, int64_t heads) {
  int64_t p = 1;
  while (p * 2 <= heads) p *= 2;
  const double e = head < p
                       ? -8.0 * static_cast<double>(head + 1) / static_cast<double>(p)
                       : -4.0 * static_cast<double>(2 * (head - p) + 1) / static_cast<double>(p);
  return static_cast<float>(exp2(e));
}

// ALiBi for the heads of one rank: local head h is global head head_begin + h of heads_total.
struct AttentionAlibi {
  int64_t head_begin = 0, heads_total = 0;
  TESSERA_HD float slope(int64_t h) const { return alibi_slope(head_begin + h, heads_total); }
  // The bias of query position i and key position j (j <= i): slope * (j - i), in f32.
  TESSERA_HD float bias(int64_t h, int64_t i, int64_t j) const {
    return slope(h) * static_cast<float>(j - i);
  }
};

}  // namespace tessera
