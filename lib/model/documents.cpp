// documents.cpp: documents inside a micro-batch's samples (train/sample_layout.hpp, docs/data.md,
// "Documents inside a sample"). The trainer hands each micro-batch's tables over before its
// forward; they stay in the activation slot for the backward (and its recomputation). The position
// ids replace the row index everywhere a position is read: RoPE's angle, the learned position
// embedding's row (a gather, whose gradient scatters back) and ALiBi's distance; the first visible
// key of each row masks the other documents in the attention kernels (core/documents.hpp).
#include <vector>

#include "core/logging.hpp"
#include "core/test_hooks.hpp"
#include "model/gpt.hpp"

namespace tessera {

void GPTModel::set_documents(Activations& a, const int32_t* positions, const int32_t* key_begin) {
  const int64_t N = int64_t(a.B) * a.T;
  TESSERA_CHECK(!(positions || key_begin) || shard_.cp_size == 1,
                "documents inside samples (--reset-position-ids / --reset-attention-mask) do not "
                "run with context parallelism yet");
  auto stage = [&](Tensor& t, const int32_t* host) {
    if (!host) {
      t = Tensor();
      return;
    }
    if (!t.defined()) {
      AllocationLabel label("the document tables of a micro-batch");
      t = Tensor({N}, DType::I32, be_.allocator());
    }
    be_.copy_from_host(t, host);
  };
  stage(a.doc_positions, positions);
  if (key_begin && test_hooks::doc_mask_leak()) {  // testing: one cross-document attention
    std::vector<int32_t> leaky(key_begin, key_begin + N);
    for (int32_t& k : leaky)
      if (k > 0) {
        --k;
        break;
      }
    stage(a.doc_key_begin, leaky.data());
  } else {
    stage(a.doc_key_begin, key_begin);
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
  if (a.doc_positions.defined() && cfg_.alibi()) documents_.positions = &a.doc_positions;
  return documents_.active() ? &documents_ : nullptr;
}

void GPTModel::add_document_positions(Tensor& btc, const Tensor& wpe, Activations& a) {
  const int64_t N = int64_t(a.B) * a.T;
  be_.embedding_forward(a.doc_wpe, a.doc_positions, wpe, 0);
  Tensor x = btc.reshape({N, int64_t(cfg_.hidden_size)});
  be_.add(x, x, a.doc_wpe);
}

}  // namespace tessera
