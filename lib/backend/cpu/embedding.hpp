// embedding.hpp: token embedding lookup over a vocabulary shard, and the position embedding add.
#pragma once

#include <cstdint>
#include <cstring>

namespace tessera::cpu {

// out is (N,C); ids is (N); table is (V_local,C) holding rows [row_begin, row_begin+V_local) of the
// global vocabulary. Ids outside this shard produce zero rows (a TP all-reduce completes them).
template <typename T>
void embedding_forward(T* out, const int32_t* ids, const T* table, int64_t N, int64_t C,
                       int64_t row_begin, int64_t rows) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
    if (r >= 0 && r < rows)
      std::memcpy(out + n * C, table + r * C, sizeof(T) * C);
    else
      std::memset(out + n * C, 0, sizeof(T) * C);
  }
}

// dtable (V_local,C) += scatter of dout (N,C). Deterministic: threads own channel ranges and
// visit tokens in order.
template <typename T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t row_begin, int64_t rows) {
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += 16) {
    const int64_t c1 = c0 + 16 < C ? c0 + 16 : C;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
      if (r < 0 || r >= rows) continue;
      for (int64_t c = c0; c < c1; ++c) dtable[r * C + c] += dout[n * C + c];
    }
  }
}

// out (B,T,C) += wpe[t] for position t; wpe is (>=T, C).
template <typename T>
void position_embedding_forward(T* out, const T* wpe, int64_t B, int64_t Tn, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * Tn; ++bt) {
    const T* p = wpe + (bt % Tn) * C;
    for (int64_t c = 0; c < C; ++c) out[bt * C + c] += p[c];
  }
}

// dwpe[t] += sum over the batch of dout[b,t].
template <typename T>
void position_embedding_backward(T* dwpe, const T* dout, int64_t B, int64_t Tn, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < C; ++c) dwpe[t * C + c] += dout[(b * Tn + t) * C + c];
}

}  // namespace tessera::cpu
