// cross_entropy.hpp: softmax cross-entropy over a vocabulary shard, in three passes so the row max
// and the row sum can be all-reduced across tensor-parallel ranks between them (Megatron's
// vocab-parallel cross-entropy); the full logits are never gathered. Columns at or past
// `valid_cols` are vocabulary padding: they never enter the softmax and get zero gradient.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace tessera::cpu {

// logits (N,V) -> rowmax (N): max over this shard's valid columns (-inf if it has none).
template <typename T>
void xent_row_max(T* rowmax, const T* logits, int64_t N, int64_t V, int64_t valid_cols) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < valid_cols; ++j) m = logits[n * V + j] > m ? logits[n * V + j] : m;
    rowmax[n] = m;
  }
}

// sumexp (N) = sum_j exp(logit - rowmax) over valid columns; target_logit (N) = the logit of the
// target if this shard holds it, else 0. targets < 0 are ignored rows. col_begin is the global id
// of column 0 of this shard.
template <typename T>
void xent_row_sums(T* sumexp, T* target_logit, const T* logits, const T* rowmax,
                   const int32_t* targets, int64_t N, int64_t V, int64_t valid_cols,
                   int64_t col_begin) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* l = logits + n * V;
    T s = 0;
    for (int64_t j = 0; j < valid_cols; ++j) s += std::exp(l[j] - rowmax[n]);
    sumexp[n] = s;
    const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
    target_logit[n] = (targets[n] >= 0 && tj >= 0 && tj < valid_cols) ? l[tj] : T(0);
  }
}

// losses (N) = log(sumexp) + rowmax - target_logit (0 for ignored rows); logits are overwritten
// with dloss/dlogits * grad_scale, where grad_scale is 1 / (loss tokens in the global batch).
template <typename T>
void xent_loss_and_grad(T* losses, T* logits, const T* rowmax, const T* sumexp,
                        const T* target_logit, const int32_t* targets, int64_t N, int64_t V,
                        int64_t valid_cols, int64_t col_begin, T grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* l = logits + n * V;
    if (targets[n] < 0) {
      losses[n] = 0;
      for (int64_t j = 0; j < V; ++j) l[j] = 0;
      continue;
    }
    losses[n] = std::log(sumexp[n]) + rowmax[n] - target_logit[n];
    const T inv = T(1) / sumexp[n];
    for (int64_t j = 0; j < valid_cols; ++j) l[j] = std::exp(l[j] - rowmax[n]) * inv * grad_scale;
    for (int64_t j = valid_cols; j < V; ++j) l[j] = 0;
    const int64_t tj = static_cast<int64_t>(targets[n]) - col_begin;
    if (tj >= 0 && tj < valid_cols) l[tj] -= grad_scale;
  }
}

}  // namespace tessera::cpu
