// context_parallel.hpp: the arithmetic of context parallelism (docs/parallelism.md), shared by
// the model, the trainer's data slicing, the backends and the tests. A sequence of S tokens is cut
// into 2·CP chunks of c = S / (2·CP); CP rank r holds chunks r and 2·CP−1−r (Megatron's load
// balance for causal attention), local rows 0..c−1 and c..2c−1. In that order the local causal
// mask is the global one (chunk r precedes chunk 2·CP−1−r).
#pragma once

#include <cstdint>

#include "core/alibi.hpp"
#include "core/dropout.hpp"
#include "core/host_device.hpp"

namespace tessera {

struct AttentionDocuments;  // core/documents.hpp

// The global position of local row t (0 <= t < 2c) of CP rank `rank`.
TESSERA_HD int64_t cp_position(int rank, int cp, int64_t c, int64_t t) {
  return t < c ? rank * c + t : (2 * cp - 1 - rank) * c + (t - c);
}

// The first of CP rank `rank`'s 2c local rows whose global position is at or after g (2c if
// none): local order is global order (chunk r before chunk 2·CP−1−r).
TESSERA_HD int64_t cp_local_at_or_after(int rank, int cp, int64_t c, int64_t g) {
  const int64_t a = rank * c, z = (2 * cp - 1 - rank) * c;
  if (g <= a) return 0;
  if (g < a + c) return g - a;
  if (g <= z) return c;
  if (g < z + c) return c + (g - z);
  return 2 * c;
}

// Documents in a ring block (RingBlockSpec::docs): the first visible key of the block's query row
// i (0 <= i < nq), as a key row of the block (0 .. nk; nk: none visible), from the whole samples'
// first visible key by global position (`key_begin` of sample b's S = 2c·CP positions).
TESSERA_HD int32_t cp_block_key_begin(const int32_t* key_begin, int q_rank, int k_rank, int cp,
                                      int64_t c, int64_t q0, int64_t k0, int64_t nk, int64_t i) {
  const int64_t g = cp_position(q_rank, cp, c, q0 + i);
  const int64_t first = cp_local_at_or_after(k_rank, cp, c, key_begin[g]) - k0;
  return static_cast<int32_t>(first < 0 ? 0 : first > nk ? nk : first);
}

// Ring step `step` of CP rank `rank` (0 <= step < CP) holds the K/V of rank (rank − step) mod CP
// (the owner) and computes, by Transformer Engine's schedule, query rows [q0, q0 + nq) of its 2c
// against the owner's key rows [k0, k0 + nk):
//   step 0          its own block: both local chunks against both, causal (the diagonal);
//   0 < step <= r   an earlier owner: all 2c queries against the owner's first chunk, no mask
//                   (the owner's second chunk is later than both of r's chunks);
//   step > r        a later owner: r's second chunk of queries (its first is earlier than both
//                   of the owner's chunks) against both of the owner's chunks, no mask.
// Every step after the first computes 2c² scores on every rank.
struct CpStepBlock {
  int owner;
  int64_t q0, nq, k0, nk;
  bool causal;
};
TESSERA_HD CpStepBlock cp_step_block(int rank, int cp, int step, int64_t c) {
  const int owner = ((rank - step) % cp + cp) % cp;
  if (step == 0) return {owner, 0, 2 * c, 0, 2 * c, true};
  if (step <= rank) return {owner, 0, 2 * c, 0, c, false};
  return {owner, c, c, 0, 2 * c, false};
}

// One block of ring attention as the backends take it (Backend::ring_block_forward): query rows
// [q0, q0 + nq) of CP rank q_rank against key rows [k0, k0 + nk) of CP rank k_rank, each rank
// holding T = 2c rows of a cp·T-token sequence; heads and kv_heads are this TP rank's (kv_heads
// 0: as many as heads). Dropout and ALiBi null when off. Documents (null when off): tables of the
// whole samples, (B, cp*T) int32 indexed by global position (core/documents.hpp).
struct RingBlockSpec {
  int64_t heads = 0, kv_heads = 0;
  int64_t q0 = 0, nq = 0, k0 = 0, nk = 0;
  bool causal = false;
  int q_rank = 0, k_rank = 0, cp = 1;
  const AttentionDropout* dropout = nullptr;
  const AttentionAlibi* alibi = nullptr;
  const AttentionDocuments* docs = nullptr;
};

// The block of ring step `s` of CP rank `rank` as the backends take it.
inline RingBlockSpec ring_block_spec(const CpStepBlock& s, int rank, int cp, int64_t heads,
                                     int64_t kv_heads, const AttentionDropout* dropout = nullptr,
                                     const AttentionAlibi* alibi = nullptr,
                                     const AttentionDocuments* docs = nullptr) {
  RingBlockSpec b;
  b.heads = heads;
  b.kv_heads = kv_heads;
  b.q0 = s.q0;
  b.nq = s.nq;
  b.k0 = s.k0;
  b.nk = s.nk;
  b.causal = s.causal;
  b.q_rank = rank;
  b.k_rank = s.owner;
  b.cp = cp;
  b.dropout = dropout;
  b.alibi = alibi;
  b.docs = docs;
  return b;
}

}  // namespace tessera
