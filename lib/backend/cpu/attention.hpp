// attention.hpp: fused causal self-attention, flash style: scores are computed per block of query
// rows into per-thread scratch and never stored; the forward keeps only the log-sum-exp per row.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "backend/cpu/dropout.hpp"
#include "backend/cpu/gemm.hpp"
#include "core/alibi.hpp"

namespace tessera::cpu {

constexpr int64_t kAttnBlockRows = 64;

// ALiBi's bias of query row i and key row j of the sample whose rows start at `row0`: distance
// by the position ids when the documents restart them, by the index otherwise.
inline float alibi_bias(const AttentionAlibi& a, int64_t h, int64_t i, int64_t j,
                        const int32_t* positions, int64_t row0) {
  return positions ? a.slope(h) * static_cast<float>(positions[row0 + j] - positions[row0 + i])
                   : a.bias(h, i, j);
}

// Scratch of one thread: two blocks of score rows and one dropout mask row.
inline int64_t attention_thread_scratch(int64_t Tn) {
  return (2 * kAttnBlockRows + 1) * Tn;
}
// Scratch elements the attention functions need for sequence length Tn (both passes).
inline int64_t attention_scratch_elems(int64_t Tn) {
  return static_cast<int64_t>(omp_get_max_threads()) * attention_thread_scratch(Tn);
}

// qkv is (B,T,NH+2G,hd) (fused projection output: NH query heads, then G key heads, then G value
// heads; G = NKV, 0 meaning NH), out is (B,T,NH,hd), lse is (B,NH,T). Query head h reads key and
// value head h / (NH/G) (grouped-query attention). With `drop`, the probabilities are dropped
// (core/dropout.hpp) after the softmax and before they weigh the values; lse stays that of the
// softmax. With `alibi`, slope_h * (j - i) is added to each scaled score (lse includes it).
// Documents (core/documents.hpp; (B,T) tables, either may be null): row t of sample b sees keys
// key_begin[b*Tn+t] .. t only, and ALiBi's distance is positions[j] - positions[t].
template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t NH, int64_t hd,
                       T* scratch, const AttentionDropout* drop = nullptr, int64_t NKV = 0,
                       const AttentionAlibi* alibi = nullptr, const int32_t* key_begin = nullptr,
                       const int32_t* positions = nullptr) {
  const int64_t G = NKV > 0 ? NKV : NH, C = NH * hd, C3 = (NH + 2 * G) * hd;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < B * NH; ++bh) {
    const int64_t b = bh / NH, h = bh % NH, g = h / (NH / G);
    T* S = scratch + static_cast<int64_t>(omp_get_thread_num()) * attention_thread_scratch(Tn);
    const T* q = qkv + b * Tn * C3 + h * hd;
    const T* k = qkv + b * Tn * C3 + C + g * hd;
    const T* v = k + G * hd;
    for (int64_t t0 = 0; t0 < Tn; t0 += kAttnBlockRows) {
      const int64_t t1 = t0 + kAttnBlockRows < Tn ? t0 + kAttnBlockRows : Tn;
      const int64_t rows = t1 - t0, cols = t1;  // keys 0..t1-1 are all a causal row here can see
      gemm(false, true, rows, cols, hd, scale, q + t0 * C3, C3, k, C3, T(0), S, cols);
      for (int64_t i = 0; i < rows; ++i) {
        T* s = S + i * cols;
        const int64_t t = t0 + i, kb = key_begin ? key_begin[b * Tn + t] : 0;
        if (alibi)
          for (int64_t j = kb; j <= t; ++j)
            s[j] += static_cast<T>(alibi_bias(*alibi, h, t, j, positions, b * Tn));
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t j = kb; j <= t; ++j) m = s[j] > m ? s[j] : m;
        T sum = 0;
        for (int64_t j = kb; j <= t; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        const T inv = T(1) / sum;
        for (int64_t j = 0; j < kb; ++j) s[j] = 0;
        for (int64_t j = kb; j <= t; ++j) s[j] *= inv;
        for (int64_t j = t + 1; j < cols; ++j) s[j] = 0;
        lse[(b * NH + h) * Tn + t] = m + std::log(sum);
        if (drop) {  // the mask row into this thread's mask scratch
          T* mask = S + 2 * kAttnBlockRows * Tn;
          dropout_mask(mask, drop->spec, drop->spec.sample_begin + b, drop->element(h, t, 0, Tn),
                       t + 1);
          for (int64_t j = 0; j <= t; ++j) s[j] *= mask[j];
        }
      }
      gemm(false, false, rows, hd, cols, T(1), S, cols, v, C3, T(0),
           out + (b * Tn + t0) * C + h * hd, C);
    }
  }
}

// dqkv (B,T,NH+2G,hd) is overwritten; dout, out (B,T,NH,hd); lse (B,NH,T) from the forward. With
// dropout (mask M, survivors scaled): dV = (P o M)^T dO, dS = P o (M o dO V^T - rowsum(dO o O)).
// One task per (sample, key/value head) runs the group's query heads in turn, so the key and
// value gradients sum over the group without being shared between threads.
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int64_t B,
                        int64_t Tn, int64_t NH, int64_t hd, T* scratch,
                        const AttentionDropout* drop = nullptr, int64_t NKV = 0,
                        const AttentionAlibi* alibi = nullptr, const int32_t* key_begin = nullptr,
                        const int32_t* positions = nullptr) {
  const int64_t G = NKV > 0 ? NKV : NH, C = NH * hd, C3 = (NH + 2 * G) * hd, R = NH / G;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < B * G; ++bg) {
    const int64_t b = bg / G, g = bg % G;
    T* P = scratch + static_cast<int64_t>(omp_get_thread_num()) * attention_thread_scratch(Tn);
    T* dP = P + kAttnBlockRows * Tn;
    T* mrow = dP + kAttnBlockRows * Tn;  // the dropout mask of one row
    const T* k = qkv + b * Tn * C3 + C + g * hd;
    const T* v = k + G * hd;
    T* dk = dqkv + b * Tn * C3 + C + g * hd;
    T* dv = dk + G * hd;
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t d = 0; d < hd; ++d) dk[t * C3 + d] = dv[t * C3 + d] = 0;
    for (int64_t h = g * R; h < (g + 1) * R; ++h) {
      const T* q = qkv + b * Tn * C3 + h * hd;
      T* dq = dqkv + b * Tn * C3 + h * hd;
      const T* o = out + b * Tn * C + h * hd;
      const T* dO = dout + b * Tn * C + h * hd;
      const T* L = lse + (b * NH + h) * Tn;
      for (int64_t t0 = 0; t0 < Tn; t0 += kAttnBlockRows) {
        const int64_t t1 = t0 + kAttnBlockRows < Tn ? t0 + kAttnBlockRows : Tn;
        const int64_t rows = t1 - t0, cols = t1;
        gemm(false, true, rows, cols, hd, scale, q + t0 * C3, C3, k, C3, T(0), P, cols);
        gemm(false, true, rows, cols, hd, T(1), dO + t0 * C, C, v, C3, T(0), dP, cols);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t t = t0 + i, kb = key_begin ? key_begin[b * Tn + t] : 0;
          T Dt = 0;  // rowsum(dO * O)
          for (int64_t d = 0; d < hd; ++d) Dt += dO[t * C + d] * o[t * C + d];
          T* p = P + i * cols;
          T* dp = dP + i * cols;
          if (drop)  // the mask row into this thread's mask scratch
            dropout_mask(mrow, drop->spec, drop->spec.sample_begin + b, drop->element(h, t, 0, Tn),
                         t + 1);
          if (alibi)
            for (int64_t j = kb; j <= t; ++j)
              p[j] += static_cast<T>(alibi_bias(*alibi, h, t, j, positions, b * Tn));
          for (int64_t j = 0; j < kb; ++j) p[j] = dp[j] = 0;
          for (int64_t j = kb; j <= t; ++j) {
            p[j] = std::exp(p[j] - L[t]);
            if (drop) {
              const T mul = mrow[j];
              dp[j] = p[j] * (dp[j] * mul - Dt);  // dS
              p[j] *= mul;                        // the dropped P that weighed the values
            } else {
              dp[j] = p[j] * (dp[j] - Dt);  // dS
            }
          }
          for (int64_t j = t + 1; j < cols; ++j) p[j] = dp[j] = 0;
        }
        // dQ = scale * dS K ; dK += scale * dS^T Q ; dV += P^T dO
        gemm(false, false, rows, hd, cols, scale, dP, cols, k, C3, T(0), dq + t0 * C3, C3);
        gemm(true, false, cols, hd, rows, scale, dP, cols, q + t0 * C3, C3, T(1), dk, C3);
        gemm(true, false, cols, hd, rows, T(1), P, cols, dO + t0 * C, C, T(1), dv, C3);
      }
    }
  }
}

}  // namespace tessera::cpu
