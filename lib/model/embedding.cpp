// embedding.cpp: the embedding piece of GPTModel (the first stage): the vocabulary-parallel word
// embedding summed over TP (reduce-scattered with sequence parallelism), the learned position
// embedding and the embedding dropout, and their backward; the positions of documents inside a
// micro-batch's samples and of context parallelism's chunks.
//
// Documents inside a sample (run/sample_layout.hpp, docs/data.md, "Documents inside a sample"):
// the trainer hands each micro-batch's tables over before its forward; they stay in the
// activation slot for the backward (and its recomputation). The position ids replace the row
// index everywhere a position is read: RoPE's angle, the learned position embedding's row (a
// gather, whose gradient scatters back) and ALiBi's distance; the first visible key of each row
// masks the other documents in the attention kernels (core/documents.hpp). With context
// parallelism the attention's tables are the whole samples' (a document may span chunks and
// ranks; the ring's blocks read them by global position).
#include <vector>

#include "core/context_parallel.hpp"
#include "core/phase_timer.hpp"
#include "core/test_hooks.hpp"
#include "model/gpt.hpp"
#include "model/part_services.hpp"

namespace tessera {

void GPTModel::embed_forward(Activations& a) {
  notify(&PassObserver::before_forward, kEmbedPiece);
  TESSERA_CHECK(embeds(a), "embed_forward on a stage (or model chunk) without the embedding");
  PhaseSequence phase;
  phase("embedding-forward");
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  if (services_->sequence_parallel()) {
    // Each TP rank fills the rows of its vocabulary shard (zeros elsewhere) and rank 0 adds the
    // positions; the reduce-scatter sums them (wpe and one embedding row per element, the rest
    // zeros: the all-reduce path's sum, bit for bit) and leaves each rank its rows.
    Tensor full = a.tmp_c;
    be_.embedding_forward(full, a.ids, params_->compute_param("wte"), services_->vocab_begin());
    if (shard_.tp_rank == 0 && cfg_.learned_positions()) {
      Tensor btc = full.reshape({a.B, a.T, C});
      add_position_embedding(btc, a);
    }
    const Tensor mine = services_->reduce_rows(phase, full, a);
    phase("embedding-forward");
    be_.cast(a.input, mine);  // a copy
  } else {
    Tensor x = a.input.reshape({N, C});
    be_.embedding_forward(x, a.ids, params_->compute_param("wte"), services_->vocab_begin());
    tp_.all_reduce(a.input, ReduceOp::Sum);  // each TP rank filled the rows of its vocab shard
    if (cfg_.learned_positions()) add_position_embedding(a.input, a);
  }
  if (const DropoutSpec d = services_->hidden_dropout(0, DropoutKind::Embedding, a); d.active()) {
    phase("dropout");
    services_->apply_hidden_dropout(a.input, a.input, d, a);
  }
  notify(&PassObserver::after_forward, kEmbedPiece);
}

void GPTModel::embed_backward(Activations& a) {
  notify(&PassObserver::before_backward, kEmbedPiece);
  Tensor dwte = params_->grad("wte");
  // d (wte[ids] + wpe): dres through the embedding dropout's mask, all rows (gathered over TP
  // with sequence parallelism): every TP rank needs every row for its vocabulary shard, and
  // computes the whole (replicated) position-embedding gradient.
  PhaseSequence phase;
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  const Tensor& demb =
      services_->branch_grad(phase, a, services_->hidden_dropout(0, DropoutKind::Embedding, a));
  phase("embedding-backward");
  services_->embedding_grad(dwte, demb.reshape({N, C}), a.ids, services_->vocab_begin());
  if (cfg_.learned_positions()) position_embedding_grad(demb.reshape({a.B, a.T, C}), a);
}

void GPTModel::add_position_embedding(Tensor& btc, Activations& a) {
  const Tensor wpe = params_->compute_param("wpe");
  if (a.doc_positions.defined()) {  // each row's own position (model/documents.cpp)
    add_document_positions(btc, wpe, a);
    return;
  }
  if (shard_.cp_size == 1) {
    be_.position_embedding_forward(btc, wpe);
    return;
  }
  const int64_t C = cfg_.hidden_size, c = a.T / 2;
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t p0 = cp_position(shard_.cp_rank, shard_.cp_size, c, half * c);
    Tensor rows = a.cp_wpe.view(half * c * C, {c, C});
    be_.cast(rows, wpe.view(p0 * C, {c, C}));  // a copy
  }
  be_.position_embedding_forward(btc, a.cp_wpe);
}

void GPTModel::position_embedding_grad(const Tensor& dbtc, Activations& a) {
  Tensor dwpe = params_->grad("wpe");
  if (a.doc_positions.defined()) {
    const int64_t N = int64_t(a.B) * a.T;
    be_.embedding_backward(dwpe, dbtc.reshape({N, cfg_.hidden_size}), a.doc_positions, 0);
    return;
  }
  if (shard_.cp_size == 1) {
    be_.position_embedding_backward(dwpe, dbtc);
    return;
  }
  const int64_t C = cfg_.hidden_size, c = a.T / 2;
  be_.zero(a.cp_dwpe);
  be_.position_embedding_backward(a.cp_dwpe, dbtc);
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t p0 = cp_position(shard_.cp_rank, shard_.cp_size, c, half * c);
    Tensor g = dwpe.view(p0 * C, {c, C});
    be_.add(g, g, a.cp_dwpe.view(half * c * C, {c, C}));
  }
}

void GPTModel::set_documents(Activations& a, const int32_t* positions, const int32_t* key_begin) {
  const int cp = shard_.cp_size;
  const int64_t N = int64_t(a.B) * a.T, S = int64_t(a.T) * cp, NS = int64_t(a.B) * S;
  auto stage = [&](Tensor& t, const int32_t* host, int64_t n, const char* what) {
    if (!host) {
      t = Tensor();
      return;
    }
    if (!t.defined()) {
      AllocationLabel label(what);
      t = Tensor({n}, DType::I32, be_.allocator());
    }
    be_.copy_from_host(t, host);
  };
  // This rank's rows' position ids: its chunks of each sample under context parallelism.
  std::vector<int32_t> local;
  const int32_t* mine = positions;
  if (positions && cp > 1) {
    local.resize(static_cast<size_t>(N));
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t t = 0; t < a.T; ++t)
        local[static_cast<size_t>(b * a.T + t)] =
            positions[b * S + cp_position(shard_.cp_rank, cp, a.T / 2, t)];
    mine = local.data();
  }
  stage(a.doc_positions, mine, N, "the document position ids of a micro-batch");
  stage(a.doc_positions_all, cp > 1 && cfg_.alibi() ? positions : nullptr, NS,
        "the document position ids of a micro-batch's whole samples");
  const char* kb = "the documents' first visible keys of a micro-batch";
  if (key_begin && test_hooks::doc_mask_leak()) {  // testing: one cross-document attention
    std::vector<int32_t> leaky(key_begin, key_begin + NS);
    for (int32_t& k : leaky)
      if (k > 0) {
        --k;
        break;
      }
    stage(a.doc_key_begin, leaky.data(), NS, kb);
  } else {
    stage(a.doc_key_begin, key_begin, NS, kb);
  }
  if (!positions || !cfg_.learned_positions() || !embeds(a)) {
    a.doc_wpe = Tensor();
  } else if (!a.doc_wpe.defined()) {
    AllocationLabel label("the position-embedding rows of a micro-batch's documents");
    a.doc_wpe = Tensor({N, int64_t(cfg_.hidden_size)}, compute_, be_.allocator());
  }
}

void GPTModel::add_document_positions(Tensor& btc, const Tensor& wpe, Activations& a) {
  const int64_t N = int64_t(a.B) * a.T;
  be_.embedding_forward(a.doc_wpe, a.doc_positions, wpe, 0);
  Tensor x = btc.reshape({N, int64_t(cfg_.hidden_size)});
  be_.add(x, x, a.doc_wpe);
}

}  // namespace tessera
