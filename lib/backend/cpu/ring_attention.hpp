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

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tessera::cpu::ring {

// The global positions of rank r's 2c tokens: chunk r, then chunk 2·CP−1−r.
inline std::vector<int64_t> local_positions(int rank, int cp, int64_t S) {
  const int64_t c = S / (2 * cp);
  std::vector<int64_t> pos;
  for (int64_t chunk : {int64_t(rank), int64_t(2 * cp - 1 - rank)})
    for (int64_t t = 0; t < c; ++t) pos.push_back(chunk * c + t);
  return pos;
}

// Which part of a step's block a rank computes (the schedule above): query rows [q0, q0 + nq) of
// the rank's 2c, key rows [k0, k0 + nk) of the owner's 2c.
struct StepBlock {
  int owner;
  int64_t q0, nq, k0, nk;
  bool causal;
};
inline StepBlock step_block(int rank, int cp, int step, int64_t c) {
  const int owner = ((rank - step) % cp + cp) % cp;
  if (step == 0) return {owner, 0, 2 * c, 0, 2 * c, true};
  if (step <= rank) return {owner, 0, 2 * c, 0, c, false};
  return {owner, c, c, 0, 2 * c, false};
}

// A block's partial attention: for each query row i (position qpos[i]) and head h, over the keys j
// with kpos[j] <= qpos[i] (all of them unless causal): out (normalized) and lse; a row that sees no
// key gets out 0 and lse -inf.
template <typename T>
void block_forward(T* out, T* lse, const T* q, const T* k, const T* v, const int64_t* qpos,
                   const int64_t* kpos, int64_t Tq, int64_t Tk, int64_t H, int64_t G, int64_t hd,
                   bool causal) {
  const T scale = T(1) / std::sqrt(T(hd));
  std::vector<T> s(static_cast<size_t>(Tk));
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      const T* qi = q + (i * H + h) * hd;
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < Tk; ++j) {
        if (causal && kpos[j] > qpos[i]) continue;
        T dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot += qi[d] * k[(j * G + g) * hd + d];
        s[static_cast<size_t>(j)] = dot * scale;
        m = s[static_cast<size_t>(j)] > m ? s[static_cast<size_t>(j)] : m;
      }
      T* o = out + (i * H + h) * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = 0;
      if (m == -std::numeric_limits<T>::infinity()) {
        lse[i * H + h] = m;
        continue;
      }
      T sum = 0;
      for (int64_t j = 0; j < Tk; ++j) {
        if (causal && kpos[j] > qpos[i]) continue;
        const T p = std::exp(s[static_cast<size_t>(j)] - m);
        sum += p;
        for (int64_t d = 0; d < hd; ++d) o[d] += p * v[(j * G + g) * hd + d];
      }
      for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
      lse[i * H + h] = m + std::log(sum);
    }
}

// Merges a block's partial (part_out, part_lse) into the running (out, lse) of the same rows:
// L = log(e^L + e^Li), O = O e^(L_old − L) + Oi e^(Li − L). A running lse of -inf (nothing yet)
// takes the part as it is.
template <typename T>
void merge(T* out, T* lse, const T* part_out, const T* part_lse, int64_t rows, int64_t hd) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const T a = lse[r], b = part_lse[r];
    if (b == ninf) continue;
    const T hi = a > b ? a : b, lo = a > b ? b : a;
    const T L = lo == ninf ? hi : hi + std::log1p(std::exp(lo - hi));
    const T wa = a == ninf ? T(0) : std::exp(a - L), wb = std::exp(b - L);
    for (int64_t d = 0; d < hd; ++d)
      out[r * hd + d] = out[r * hd + d] * wa + part_out[r * hd + d] * wb;
    lse[r] = L;
  }
}

// A block's backward with the rows' global out and lse (after every merge): adds the block's dq
// (Tq, H, hd), dk and dv (Tk, G, hd) contributions.
template <typename T>
void block_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                    const T* out, const T* lse, const int64_t* qpos, const int64_t* kpos,
                    int64_t Tq, int64_t Tk, int64_t H, int64_t G, int64_t hd, bool causal) {
  const T scale = T(1) / std::sqrt(T(hd));
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      const T* qi = q + (i * H + h) * hd;
      const T* doi = dout + (i * H + h) * hd;
      const T* oi = out + (i * H + h) * hd;
      T D = 0;
      for (int64_t d = 0; d < hd; ++d) D += doi[d] * oi[d];
      for (int64_t j = 0; j < Tk; ++j) {
        if (causal && kpos[j] > qpos[i]) continue;
        const T* kj = k + (j * G + g) * hd;
        const T* vj = v + (j * G + g) * hd;
        T dot = 0, dp = 0;
        for (int64_t d = 0; d < hd; ++d) {
          dot += qi[d] * kj[d];
          dp += doi[d] * vj[d];
        }
        const T p = std::exp(dot * scale - lse[i * H + h]);
        const T ds = p * (dp - D) * scale;
        for (int64_t d = 0; d < hd; ++d) {
          dq[(i * H + h) * hd + d] += ds * kj[d];
          dk[(j * G + g) * hd + d] += ds * qi[d];
          dv[(j * G + g) * hd + d] += p * doi[d];
        }
      }
    }
}

}  // namespace tessera::cpu::ring
