// ring_attention.hpp: the host reference of context parallelism's attention (issue 30;
// docs/parallelism.md once it is wired in): the sequence of S tokens is cut into 2·CP chunks of
// c = S / (2·CP) and CP rank r holds chunks r and 2·CP−1−r (Megatron's load balance for causal
// attention: every rank gets one early and one late chunk). Each rank's queries must attend to
// every earlier key of the whole sequence, so K/V blocks travel around the ring of CP ranks: at
// step i rank r holds the K/V of rank (r − i) mod CP and computes, by Transformer Engine's
// schedule,
//   i = 0      its own block: both local chunks against both, causal (the diagonal);
//   0 < i <= r the earlier owner: all 2c local queries against the owner's first chunk only (its
//              second chunk is later than both of r's chunks), no mask;
//   i > r      a later owner: only r's second chunk of queries (its first is earlier than both of
//              the owner's chunks) against both of the owner's chunks, no mask;
// so every rank computes 2c² scores per step after the first. Each step gives a normalized partial
// output and its log-sum-exp per query row; they merge as
//   L = log(e^L + e^Li),  O = O·e^(L_old − L) + Oi·e^(Li − L).
// The backward replays the steps with the global O and L (so each block's dQ, dK, dV are exact
// partial sums: P = exp(S − L), D = rowsum(dO ∘ O)); dQ stays on its rank, dK/dV travel back to
// their owner around the ring.
//
// Layouts (one sequence; callers loop over the batch): q (Tq, H, hd), k and v (Tk, G, hd) with
// query head h reading key/value head h / (H / G); positions are global token indices (the causal
// mask is key position <= query position). Scores are scaled by 1/sqrt(hd). All in T (double in
// the tests).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend/cpu/attention.hpp"
#include "backend/cpu/gemm.hpp"
#include "core/context_parallel.hpp"

namespace tessera::cpu::ring {

// The global positions of rank r's 2c tokens: chunk r, then chunk 2·CP−1−r.
inline std::vector<int64_t> local_positions(int rank, int cp, int64_t S) {
  const int64_t c = S / (2 * cp);
  std::vector<int64_t> pos;
  for (int64_t t = 0; t < 2 * c; ++t) pos.push_back(cp_position(rank, cp, c, t));
  return pos;
}

using StepBlock = tessera::CpStepBlock;
inline StepBlock step_block(int rank, int cp, int step, int64_t c) {
  return cp_step_block(rank, cp, step, c);
}

// One block's operands, one sequence: query row i (global position qpos[i]) head h at
// q[i * qs + h * hd]; key row j (kpos[j]) head g at k[j * ks + g * hd], its value at
// v[j * ks + g * hd]. `mult(h, i, j)` is the attention-dropout multiplier of probability (i, j)
// (1 without dropout) and `bias(h, i, j)` what is added to the scaled score (ALiBi; 0 without),
// both given local row indices.
template <typename T>
struct BlockArgs {
  const T *q, *k, *v;
  int64_t qs, ks;
  const int64_t *qpos, *kpos;
  int64_t Tq, Tk, H, G, hd;
  bool causal;
};
struct NoDropout {
  double operator()(int64_t, int64_t, int64_t) const { return 1; }
};
struct NoBias {
  double operator()(int64_t, int64_t, int64_t) const { return 0; }
};

// A block's partial attention: for each query row i and head h, over the keys j with
// kpos[j] <= qpos[i] (all of them unless causal): out (normalized; row i head h at
// out[i * os + h * hd]) and lse (at lse[i * lr + h * lh]); a row that sees no key gets out 0 and
// lse -inf. The dropout multiplies the normalized probabilities (lse stays the softmax's).
template <typename T, typename Mult = NoDropout, typename Bias = NoBias>
void block_forward(const BlockArgs<T>& a, T* out, int64_t os, T* lse, int64_t lr, int64_t lh,
                   const Mult& mult = {}, const Bias& bias = {}) {
  const T scale = T(1) / std::sqrt(T(a.hd));
  const int64_t hd = a.hd;
  std::vector<T> s(static_cast<size_t>(a.Tk));
  for (int64_t i = 0; i < a.Tq; ++i)
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t g = h / (a.H / a.G);
      const T* qi = a.q + i * a.qs + h * hd;
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < a.Tk; ++j) {
        if (a.causal && a.kpos[j] > a.qpos[i]) continue;
        T dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot += qi[d] * a.k[j * a.ks + g * hd + d];
        s[static_cast<size_t>(j)] = dot * scale + T(bias(h, i, j));
        m = s[static_cast<size_t>(j)] > m ? s[static_cast<size_t>(j)] : m;
      }
      T* o = out + i * os + h * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = 0;
      if (m == -std::numeric_limits<T>::infinity()) {
        lse[i * lr + h * lh] = m;
        continue;
      }
      T sum = 0;
      for (int64_t j = 0; j < a.Tk; ++j) {
        if (a.causal && a.kpos[j] > a.qpos[i]) continue;
        const T p = std::exp(s[static_cast<size_t>(j)] - m);
        sum += p;
        const T pm = p * T(mult(h, i, j));
        if (pm == T(0)) continue;
        for (int64_t d = 0; d < hd; ++d) o[d] += pm * a.v[j * a.ks + g * hd + d];
      }
      for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
      lse[i * lr + h * lh] = m + std::log(sum);
    }
}

// The contiguous form: q (Tq, H, hd), k and v (Tk, G, hd), out (Tq, H, hd), lse (Tq, H).
template <typename T>
void block_forward(T* out, T* lse, const T* q, const T* k, const T* v, const int64_t* qpos,
                   const int64_t* kpos, int64_t Tq, int64_t Tk, int64_t H, int64_t G, int64_t hd,
                   bool causal) {
  const BlockArgs<T> a{q, k, v, H * hd, G * hd, qpos, kpos, Tq, Tk, H, G, hd, causal};
  block_forward(a, out, H * hd, lse, H, 1);
}

// Merges a block's partial (part_out, part_lse) into the running (out, lse) of the same rows:
// L = log(e^L + e^Li), O = O e^(L_old − L) + Oi e^(Li − L). A running lse of -inf (nothing yet)
// takes the part as it is.
template <typename T>
void merge_row(T* out, T& lse, const T* part_out, T part_lse, int64_t hd) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const T a = lse, b = part_lse;
  if (b == ninf) return;
  const T hi = a > b ? a : b, lo = a > b ? b : a;
  const T L = lo == ninf ? hi : hi + std::log1p(std::exp(lo - hi));
  const T wa = a == ninf ? T(0) : std::exp(a - L), wb = std::exp(b - L);
  for (int64_t d = 0; d < hd; ++d) out[d] = out[d] * wa + part_out[d] * wb;
  lse = L;
}
template <typename T>
void merge(T* out, T* lse, const T* part_out, const T* part_lse, int64_t rows, int64_t hd) {
  for (int64_t r = 0; r < rows; ++r)
    merge_row(out + r * hd, lse[r], part_out + r * hd, part_lse[r], hd);
}

// A block's backward with the rows' global out and lse (after every merge): adds the block's dq
// (row i head h at dq[i * qs + h * hd]), dk and dv (row j head g at dk/dv[j * ks + g * hd])
// contributions; dout and out as out in block_forward. P = exp(S − L) with the global L,
// D = rowsum(dO ∘ O), dS = P (dO·V mult − D).
template <typename T, typename Mult = NoDropout, typename Bias = NoBias>
void block_backward(const BlockArgs<T>& a, T* dq, T* dk, T* dv, const T* dout, const T* out,
                    int64_t os, const T* lse, int64_t lr, int64_t lh, const Mult& mult = {},
                    const Bias& bias = {}) {
  const T scale = T(1) / std::sqrt(T(a.hd));
  const int64_t hd = a.hd;
  for (int64_t i = 0; i < a.Tq; ++i)
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t g = h / (a.H / a.G);
      const T* qi = a.q + i * a.qs + h * hd;
      const T* doi = dout + i * os + h * hd;
      const T* oi = out + i * os + h * hd;
      const T L = lse[i * lr + h * lh];
      T D = 0;
      for (int64_t d = 0; d < hd; ++d) D += doi[d] * oi[d];
      for (int64_t j = 0; j < a.Tk; ++j) {
        if (a.causal && a.kpos[j] > a.qpos[i]) continue;
        const T* kj = a.k + j * a.ks + g * hd;
        const T* vj = a.v + j * a.ks + g * hd;
        T dot = 0, dp = 0;
        for (int64_t d = 0; d < hd; ++d) {
          dot += qi[d] * kj[d];
          dp += doi[d] * vj[d];
        }
        const T p = std::exp(dot * scale + T(bias(h, i, j)) - L);
        const T m = T(mult(h, i, j));
        const T ds = p * (dp * m - D) * scale;
        for (int64_t d = 0; d < hd; ++d) {
          dq[i * a.qs + h * hd + d] += ds * kj[d];
          dk[j * a.ks + g * hd + d] += ds * qi[d];
          dv[j * a.ks + g * hd + d] += p * m * doi[d];
        }
      }
    }
}

// The contiguous form (layouts as the contiguous block_forward).
template <typename T>
void block_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                    const T* out, const T* lse, const int64_t* qpos, const int64_t* kpos,
                    int64_t Tq, int64_t Tk, int64_t H, int64_t G, int64_t hd, bool causal) {
  const BlockArgs<T> a{q, k, v, H * hd, G * hd, qpos, kpos, Tq, Tk, H, G, hd, causal};
  block_backward(a, dq, dk, dv, dout, out, H * hd, lse, H, 1);
}

// Backend::ring_block_forward / ring_block_backward on host arrays of one dtype T (float or
// double; layouts in backend.hpp): qkv (B,T,(H+2G)*hd), kv (B,T,2G*hd); the forward's out
// (B,nq,H*hd) and lse (B,H,nq); the backward's dout, out (B,T,H*hd) and lse (B,H,T). The same
// arithmetic as block_forward / block_backward above, on BLAS: per (sample, head) and block of
// kRingRows query rows, S = scale Q K^T (+ ALiBi), the mask and softmax row by row, then GEMMs.
// Documents inside the samples (core/documents.hpp): `key_begin` and `positions` are tables of the
// whole samples, (B, cp*T) int32 indexed by global position (null when off): a key before its
// query's key_begin is masked like a future one, and ALiBi's distance is by the position ids. A
// document may span chunks and ranks; the tables travel with nothing, every rank holds them whole.
constexpr int64_t kRingRows = 64;

struct RingDocs {
  const int32_t* key_begin = nullptr;  // (B, S) by global position, or null
  const int32_t* positions = nullptr;  // (B, S) by global position, or null
};

struct RingRows {
  std::vector<int64_t> qpos, kpos;
  int64_t H, G, hd, W, KW, S;
  RingDocs docs;
  RingRows(const RingBlockSpec& b, int64_t Tn, int64_t hd_, RingDocs d) : hd(hd_), docs(d) {
    H = b.heads;
    G = b.kv_heads > 0 ? b.kv_heads : b.heads;
    W = (H + 2 * G) * hd;
    KW = 2 * G * hd;
    S = b.cp * Tn;
    const int64_t c = Tn / 2;
    for (int64_t i = 0; i < b.nq; ++i) qpos.push_back(cp_position(b.q_rank, b.cp, c, b.q0 + i));
    for (int64_t j = 0; j < b.nk; ++j) kpos.push_back(cp_position(b.k_rank, b.cp, c, b.k0 + j));
  }
  // Whether query row i of sample bb sees key j: not a future key (causal blocks), not a key of an
  // earlier document (documents).
  bool visible(const RingBlockSpec& b, int64_t bb, int64_t i, int64_t j) const {
    const int64_t qp = qpos[static_cast<size_t>(i)], kp = kpos[static_cast<size_t>(j)];
    if (b.causal && kp > qp) return false;
    return !docs.key_begin || kp >= docs.key_begin[bb * S + qp];
  }
  // ALiBi's bias of query row i and key j of sample bb (by the documents' positions when given).
  float alibi_bias(const AttentionAlibi& a, int64_t h, int64_t bb, int64_t i, int64_t j) const {
    return cpu::alibi_bias(a, h, qpos[static_cast<size_t>(i)], kpos[static_cast<size_t>(j)],
                           docs.positions, bb * S);
  }
  // The keys query rows [0, last] can see at all: positions rise with the row, so a causal
  // block's rows up to `last` see only a prefix of its keys (the rest are skipped, not masked).
  int64_t key_limit(const RingBlockSpec& b, int64_t last) const {
    if (!b.causal) return static_cast<int64_t>(kpos.size());
    return std::upper_bound(kpos.begin(), kpos.end(), qpos[static_cast<size_t>(last)]) -
           kpos.begin();
  }
};

template <typename T>
void ring_block_forward(T* out, T* lse, const T* qkv, const T* kv, int64_t B, int64_t Tn,
                        int64_t hd, const RingBlockSpec& b, RingDocs docs = {}) {
  const RingRows r(b, Tn, hd, docs);
  const int64_t H = r.H, nq = b.nq, nk = b.nk, OW = H * hd;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  const T ninf = -std::numeric_limits<T>::infinity();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t bb = bh / H, h = bh % H, g = h / (H / r.G);
    const T* q = qkv + (bb * Tn + b.q0) * r.W + h * hd;
    const T* k = kv + (bb * Tn + b.k0) * r.KW + g * hd;
    const T* v = k + r.G * hd;
    std::vector<T> S(static_cast<size_t>(kRingRows * nk));
    for (int64_t i0 = 0; i0 < nq; i0 += kRingRows) {
      const int64_t rows = std::min(kRingRows, nq - i0);
      T* o = out + (bb * nq + i0) * OW + h * hd;
      if (nk == 0) {
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t d = 0; d < hd; ++d) o[i * OW + d] = 0;
          lse[(bb * H + h) * nq + i0 + i] = ninf;
        }
        continue;
      }
      const int64_t cols = r.key_limit(b, i0 + rows - 1);
      if (cols > 0)
        gemm(false, true, rows, cols, hd, scale, q + i0 * r.W, r.W, k, r.KW, T(0), S.data(), cols);
      for (int64_t i = 0; i < rows; ++i) {
        T* s = S.data() + i * cols;
        const int64_t qi = i0 + i;
        T m = ninf;
        for (int64_t j = 0; j < cols; ++j) {
          if (!r.visible(b, bb, qi, j)) continue;
          if (b.alibi) s[j] += static_cast<T>(r.alibi_bias(*b.alibi, h, bb, qi, j));
          m = s[j] > m ? s[j] : m;
        }
        T sum = 0;
        for (int64_t j = 0; j < cols; ++j) {
          if (m == ninf || !r.visible(b, bb, qi, j)) {
            s[j] = 0;
            continue;
          }
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        lse[(bb * H + h) * nq + qi] = m == ninf ? ninf : m + std::log(sum);
        const T inv = m == ninf ? T(0) : T(1) / sum;
        for (int64_t j = 0; j < cols; ++j) {
          s[j] *= inv;
          if (b.dropout && s[j] != T(0))
            s[j] *= static_cast<T>(b.dropout->multiplier(bb, h, r.qpos[static_cast<size_t>(qi)],
                                                         r.kpos[static_cast<size_t>(j)], r.S));
        }
      }
      if (cols > 0)
        gemm(false, false, rows, hd, cols, T(1), S.data(), cols, v, r.KW, T(0), o, OW);
      else
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t d = 0; d < hd; ++d) o[i * OW + d] = 0;
    }
  }
}

template <typename T>
void ring_block_backward(T* dqkv, T* dkv, const T* dout, const T* qkv, const T* kv, const T* out,
                         const T* lse, int64_t B, int64_t Tn, int64_t hd, const RingBlockSpec& b,
                         RingDocs docs = {}) {
  const RingRows r(b, Tn, hd, docs);
  const int64_t H = r.H, nq = b.nq, nk = b.nk, OW = H * hd;
  if (nq == 0 || nk == 0) return;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  // Heads of one key/value group add into the same dK/dV: one task per (sample, group), its
  // heads in order.
  const int64_t per = H / r.G;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < B * r.G; ++bg) {
    const int64_t bb = bg / r.G, g = bg % r.G;
    const T* k = kv + (bb * Tn + b.k0) * r.KW + g * hd;
    const T* v = k + r.G * hd;
    T* dk = dkv + (bb * Tn + b.k0) * r.KW + g * hd;
    T* dv = dk + r.G * hd;
    std::vector<T> P(static_cast<size_t>(kRingRows * nk)), dP(P.size()), PM(P.size());
    for (int64_t h = g * per; h < (g + 1) * per; ++h) {
      const T* q = qkv + (bb * Tn + b.q0) * r.W + h * hd;
      T* dq = dqkv + (bb * Tn + b.q0) * r.W + h * hd;
      const T* dO = dout + (bb * Tn + b.q0) * OW + h * hd;
      const T* O = out + (bb * Tn + b.q0) * OW + h * hd;
      const T* L = lse + (bb * H + h) * Tn + b.q0;
      for (int64_t i0 = 0; i0 < nq; i0 += kRingRows) {
        const int64_t rows = std::min(kRingRows, nq - i0), cols = r.key_limit(b, i0 + rows - 1);
        if (cols == 0) continue;
        gemm(false, true, rows, cols, hd, scale, q + i0 * r.W, r.W, k, r.KW, T(0), P.data(), cols);
        gemm(false, true, rows, cols, hd, T(1), dO + i0 * OW, OW, v, r.KW, T(0), dP.data(), cols);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t qi = i0 + i;
          T D = 0;
          for (int64_t d = 0; d < hd; ++d) D += dO[qi * OW + d] * O[qi * OW + d];
          T* p = P.data() + i * cols;
          T* dp = dP.data() + i * cols;
          T* pm = PM.data() + i * cols;
          for (int64_t j = 0; j < cols; ++j) {
            if (!r.visible(b, bb, qi, j)) {
              p[j] = dp[j] = pm[j] = 0;
              continue;
            }
            T sc = p[j];
            if (b.alibi) sc += static_cast<T>(r.alibi_bias(*b.alibi, h, bb, qi, j));
            const T pj = std::exp(sc - L[qi]);
            const T mult =
                b.dropout
                    ? static_cast<T>(b.dropout->multiplier(bb, h, r.qpos[static_cast<size_t>(qi)],
                                                           r.kpos[static_cast<size_t>(j)], r.S))
                    : T(1);
            pm[j] = pj * mult;
            dp[j] = pj * (dp[j] * mult - D);  // dS / scale
            p[j] = pj;
          }
        }
        // dQ += scale dS K, dK += scale dS^T Q, dV += (P o M)^T dO.
        gemm(false, false, rows, hd, cols, scale, dP.data(), cols, k, r.KW, T(1), dq + i0 * r.W,
             r.W);
        gemm(true, false, cols, hd, rows, scale, dP.data(), cols, q + i0 * r.W, r.W, T(1), dk,
             r.KW);
        gemm(true, false, cols, hd, rows, T(1), PM.data(), cols, dO + i0 * OW, OW, T(1), dv, r.KW);
      }
    }
  }
}

// out (B,Tn,H*hd), lse (B,H,Tn) merged at rows [q0, q0 + nq) with part_out (B,nq,H*hd) and
// part_lse (B,H,nq).
template <typename T>
void merge_block(T* out, T* lse, const T* part_out, const T* part_lse, int64_t B, int64_t Tn,
                 int64_t H, int64_t hd, int64_t q0, int64_t nq) {
  for (int64_t bb = 0; bb < B; ++bb)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t h = 0; h < H; ++h)
        merge_row(out + ((bb * Tn + q0 + i) * H + h) * hd, lse[(bb * H + h) * Tn + q0 + i],
                  part_out + ((bb * nq + i) * H + h) * hd, part_lse[(bb * H + h) * nq + i], hd);
}

}  // namespace tessera::cpu::ring
