// documents.cpp: documents inside a micro-batch's samples (run/sample_layout.hpp, docs/data.md,
// "Documents inside a sample"). The trainer hands each micro-batch's tables over before its
// forward; they stay in the activation slot for the backward (and its recomputation). The position
// ids replace the row index everywhere a position is read: RoPE's angle, the learned position
// embedding's row (a gather, whose gradient scatters back) and ALiBi's distance; the first visible
// key of each row masks the other documents in the attention kernels (core/documents.hpp). With
// context parallelism the attention's tables are the whole samples' (a document may span chunks
// and ranks; the ring's blocks read them by global position).
#include <vector>

#include "core/context_parallel.hpp"
#include "core/logging.hpp"
#include "core/test_hooks.hpp"
#include "model/gpt.hpp"

namespace tessera {

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

const AttentionDocuments* GPTModel::documents(const Activations& a) {
  documents_ = AttentionDocuments{};
  if (a.doc_key_begin.defined()) documents_.key_begin = &a.doc_key_begin;
  if (cfg_.alibi()) {  // the whole samples' position ids (by global position under CP)
    const Tensor& p = shard_.cp_size > 1 ? a.doc_positions_all : a.doc_positions;
    if (p.defined()) documents_.positions = &p;
  }
  return documents_.active() ? &documents_ : nullptr;
}

void GPTModel::add_document_positions(Tensor& btc, const Tensor& wpe, Activations& a) {
  const int64_t N = int64_t(a.B) * a.T;
  be_.embedding_forward(a.doc_wpe, a.doc_positions, wpe, 0);
  Tensor x = btc.reshape({N, int64_t(cfg_.hidden_size)});
  be_.add(x, x, a.doc_wpe);
}

}  // namespace tessera
