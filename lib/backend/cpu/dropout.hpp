// dropout.hpp: hidden dropout on the CPU, the masks of core/dropout.hpp.
#pragma once

#include <cstdint>

#include "core/dropout.hpp"

namespace tessera::cpu {

// out (rows, C) = in times the mask; local row r is row row_begin + r of the micro-batch, whose
// sequences are seq_len rows long. out may alias in.
template <typename T>
void dropout(T* out, const T* in, const DropoutSpec& d, int64_t rows, int64_t C, int64_t row_begin,
             int64_t seq_len) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = row_begin + r, sample = d.sample_begin + g / seq_len, t = g % seq_len;
    const uint64_t e0 = static_cast<uint64_t>(t) * static_cast<uint64_t>(C);
    for (int64_t c = 0; c < C; ++c)
      out[r * C + c] = in[r * C + c] *
                       static_cast<T>(dropout_multiplier(d, sample, e0 + static_cast<uint64_t>(c)));
  }
}

}  // namespace tessera::cpu
