// context_parallel.cpp: context parallelism in the model (docs/parallelism.md, "Context
// parallelism"). Each CP rank holds T = 2c of a sample's cp·T tokens, chunks r and 2·CP−1−r
// (core/context_parallel.hpp); every per-token op runs on them as on any T-token micro-batch,
// with the global positions where a position matters: RoPE (a position tensor), the learned
// position embedding (its rows gathered per chunk), hidden and attention dropout (keyed by global
// sample and position, so every CP size draws the same masks) and ALiBi. Attention runs around
// the ring of CP ranks: each rank's K/V heads (only the key/value heads with grouped-query
// attention) travel to the next rank while the block in hand is computed (cp_step_block's
// schedule), each block's partial output merges by its log-sum-exp, and the backward replays the
// ring with the final output and log-sum-exp, dK/dV travelling with their K/V back to their owner.
#include <algorithm>
#include <memory>

#include "core/context_parallel.hpp"
#include "core/test_hooks.hpp"
#include "model/part_services.hpp"

namespace tessera {

namespace {

constexpr int kTagKv = 3001, kTagDkv = 3002;

}  // namespace

void PartServices::attention_core_forward(int l, Activations& a, LayerActivations& la) {
  if (a.inference) {  // generation: the new rows' keys and values into the layer's KV cache
    InferenceContext& c = *a.inference;
    const size_t li = static_cast<size_t>(shard_.local_index(l));
    const int64_t n = int64_t(a.B) * a.T;
    Tensor& kc = (*c.k_cache)[li];
    Tensor& vc = (*c.v_cache)[li];
    Tensor att = la.att.reshape({n, la.att.numel() / n});
    const Tensor qkv = la.qkv.reshape({n, la.qkv.numel() / n});
    if (c.decode)
      be_.kv_decode(att, qkv, kc, vc, c.table, c.context, heads_local_, kv_heads_local_, alibi());
    else
      be_.kv_attention(att, qkv, kc, vc, *c.segments, heads_local_, kv_heads_local_, alibi());
    return;
  }
  if (shard_.cp_size > 1) {
    ring_attention_forward(l, a, la);
    return;
  }
  be_.attention_forward(la.att, la.lse, la.qkv, heads_local_, attention_dropout(l, a),
                        kv_heads_local_, alibi(), documents(a));
}

void PartServices::attention_core_backward(int l, Activations& a, LayerActivations& la) {
  if (shard_.cp_size > 1) {
    ring_attention_backward(l, a, la);
    return;
  }
  be_.attention_backward(a.dqkv, a.datt, la.qkv, la.att, la.lse, heads_local_,
                         attention_dropout(l, a), kv_heads_local_, alibi(), documents(a));
}

void PartServices::ring_attention_forward(int l, Activations& a, LayerActivations& la) {
  const int P = shard_.cp_size, r = shard_.cp_rank;
  TESSERA_CHECK(cp_ && cp_->size() == P && cp_->rank() == r,
                "context parallelism: the model has no ring of ", P,
                " ranks (PartServices::set_context_comm)");
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  const int64_t c = a.T / 2, hl = heads_local_ * cfg_.head_dim(), kvl = a.cp_kv[0].dim(2);
  const AttentionDropout* drop = attention_dropout(l, a);
  // This rank's key and value heads start the ring.
  be_.copy_columns(a.cp_kv[0], 0, la.qkv, hl, kvl);
  for (int i = 0; i < P; ++i) {
    Tensor& kv = a.cp_kv[i % 2];
    std::unique_ptr<PendingOp> arriving;  // the next step's block, sent on while this one runs
    if (i + 1 < P) arriving = cp_->send_recv_async(kv, next, a.cp_kv[(i + 1) % 2], prev, kTagKv);
    const CpStepBlock s = cp_step_block(r, P, i, c);
    const Backend::RingBlock blk =
        ring_block_spec(s, r, P, heads_local_, kv_heads_local_, drop, alibi(), documents(a));
    if (i == 0) {  // the diagonal block: every local row, the output's first value
      be_.ring_block_forward(la.att, la.lse, la.qkv, kv, blk);
    } else {
      Tensor part = a.cp_out.view(0, {a.B, s.nq, hl});
      Tensor part_lse = a.cp_lse.view(0, {a.B, heads_local_, s.nq});
      be_.ring_block_forward(part, part_lse, la.qkv, kv, blk);
      if (test_hooks::cp_no_lse_merge()) be_.scale(part_lse, 0.f);
      be_.attention_merge(la.att, la.lse, part, part_lse, s.q0);
    }
    if (arriving) arriving->wait_device();
  }
}

void PartServices::ring_attention_backward(int l, Activations& a, LayerActivations& la) {
  const int P = shard_.cp_size, r = shard_.cp_rank;
  TESSERA_CHECK(cp_ && cp_->size() == P, "context parallelism: no ring of ", P,
                " ranks (PartServices::set_context_comm)");
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  const int64_t c = a.T / 2, hl = heads_local_ * cfg_.head_dim(), kvl = a.cp_kv[0].dim(2);
  const AttentionDropout* drop = attention_dropout(l, a);
  be_.zero(a.dqkv);  // dQ adds up over the steps; dK/dV come back from the ring at the end
  be_.copy_columns(a.cp_kv[0], 0, la.qkv, hl, kvl);
  // Step i holds the K/V of owner r − i and receives the dK/dV its earlier holders (owner ..
  // r − 1) added up; it adds this rank's part and sends the sum on. The transfer of step i's sum
  // runs during step i + 1's block (its part goes into a buffer of its own, added when the sum
  // has arrived). After the last step the sum for owner r + 1 is complete and goes to it; this
  // rank's own arrives from r − 1.
  std::unique_ptr<PendingOp> sums;  // step i's sum leaving, step i + 1's partial arriving
  for (int i = 0; i < P; ++i) {
    Tensor& kv = a.cp_kv[i % 2];
    Tensor& sum = a.cp_dkv[i % 2];
    std::unique_ptr<PendingOp> arriving;
    if (i + 1 < P) arriving = cp_->send_recv_async(kv, next, a.cp_kv[(i + 1) % 2], prev, kTagKv);
    const CpStepBlock s = cp_step_block(r, P, i, c);
    Tensor& mine = i == 0 ? sum : a.cp_dkv_mine;  // step 0 starts the owner's sum
    be_.zero(mine);
    be_.ring_block_backward(
        a.dqkv, mine, a.datt, la.qkv, kv, la.att, la.lse,
        ring_block_spec(s, r, P, heads_local_, kv_heads_local_, drop, alibi(), documents(a)));
    if (arriving) arriving->wait_device();
    if (i > 0) {
      sums->wait_device();  // the partial sum for this owner is in `sum`
      be_.add(sum, sum, mine);
    }
    sums = cp_->send_recv_async(sum, next, a.cp_dkv[(i + 1) % 2], prev, kTagDkv);
  }
  sums->wait_device();
  be_.copy_columns(a.dqkv, hl, a.cp_dkv[P % 2], 0, kvl);
}

void PartServices::apply_hidden_dropout(Tensor& out, const Tensor& in, const DropoutSpec& d,
                                        const Activations& a) {
  if (shard_.cp_size == 1) {
    be_.dropout(out, in, d, dropout_row_begin(a), a.T);
    return;
  }
  // Local row (b, t) is position cp_position(t) of sample b of a cp·T-token sequence: one call per
  // run of rows inside one chunk of one sample.
  const int64_t C = cfg_.hidden_size, T = a.T, c = T / 2, S = T * shard_.cp_size;
  const int64_t begin = dropout_row_begin(a), n = out.numel() / C;
  for (int64_t row = begin; row < begin + n;) {
    const int64_t b = row / T, t = row % T;
    const int64_t run = std::min(begin + n, b * T + (t < c ? c : T)) - row;
    DropoutSpec piece = d;
    piece.sample_begin = d.sample_begin + b;
    Tensor o = out.view((row - begin) * C, {run, C});
    const Tensor x = in.view((row - begin) * C, {run, C});
    be_.dropout(o, x, piece, cp_position(shard_.cp_rank, shard_.cp_size, c, t), S);
    row += run;
  }
}

const Tensor* PartServices::rope_positions(const Activations& a) const {
  if (a.doc_positions.defined()) return &a.doc_positions;  // model/documents.cpp
  return shard_.cp_size > 1 && a.cp_positions.defined() ? &a.cp_positions : nullptr;
}

}  // namespace tessera
