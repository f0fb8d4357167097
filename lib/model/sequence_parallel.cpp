// sequence_parallel.cpp: the TP/SP plumbing of GPTModel's block: which token rows this rank holds
// in the norm/dropout/residual regions, the reductions of a row-parallel output (all-reduce, or
// reduce-scatter with sequence parallelism) and the gathers before a column-parallel GEMM, the
// branch gradients through their dropout masks, the once-a-step reductions of TP-partial
// gradients, and the vocabulary-parallel cross-entropy of the head and multi-token prediction.
#include "core/phase_timer.hpp"
#include "core/test_hooks.hpp"
#include "model/parts.hpp"

namespace tessera {

int64_t GPTModel::dropout_row_begin(const Activations& a) const {
  // Testing (the layout-equivalence test's mutation check): TESSERA_FAULT_DROPOUT_KEY.
  return test_hooks::dropout_ignore_tp_offset() ? 0 : row_begin(a);
}

int64_t GPTModel::local_rows(const Activations& a) const {
  const int64_t N = int64_t(a.B) * a.T;
  return sp_ ? N / shard_.tp_size : N;
}

int64_t GPTModel::row_begin(const Activations& a) const {
  return sp_ ? local_rows(a) * shard_.tp_rank : 0;
}

Tensor GPTModel::own_rows(const Tensor& full, const Activations& a) const {
  const int64_t C = cfg_.hidden_size;
  return sp_ ? full.view(row_begin(a) * C, {local_rows(a), C}) : full;
}

Tensor GPTModel::reduce_rows(PhaseSequence& phase, Tensor& full, const Activations& a) {
  if (!sp_) {
    tp_reduce(phase, full);
    return full;
  }
  phase("sp-reduce-scatter");
  tp_.reduce_scatter_async(full)->wait_device();
  return own_rows(full, a);
}

void GPTModel::gather_rows(PhaseSequence& phase, Tensor& full) {
  if (!sp_) return;
  phase("sp-all-gather");
  tp_.all_gather_async(full)->wait_device();
}

const Tensor& GPTModel::branch_grad(PhaseSequence& phase, Activations& a, const DropoutSpec& site) {
  if (!sp_ && !site.active()) return a.dres;
  Tensor out = own_rows(a.tmp_c, a);  // a view: writes land in tmp_c
  if (site.active()) {
    phase("dropout");
    apply_hidden_dropout(out, a.dres, site, a);
  } else {
    be_.cast(out, a.dres);  // a copy
  }
  gather_rows(phase, a.tmp_c);
  return a.tmp_c;
}

void GPTModel::reduce_sequence_parallel_grads(int piece) {
  if (piece == kHeadPiece)  // multi-token prediction's layers complete with the head piece
    for (int k = 0; k < shard_.mtp_count; ++k) reduce_sequence_parallel_grads(shard_.mtp_begin + k);
  if (piece == kHeadPiece && sp_) {  // and its norms and projection saw this rank's rows
    TESSERA_PHASE("sp-grad-all-reduce");
    for (int k = 0; k < shard_.mtp_count; ++k)
      for (const char* n : {"enorm.weight", "enorm.bias", "hnorm.weight", "hnorm.bias",
                            "eh_proj.weight", "final_norm.weight", "final_norm.bias"}) {
        const std::string name = "mtp." + std::to_string(k) + "." + n;
        if (!params_->has(name)) continue;
        Tensor g = params_->grad(name);
        tp_.all_reduce(g, ReduceOp::Sum);
      }
  }
  if (piece >= 0) {  // each part's partial sums over TP (the router; q/k norms, MLA's latents)
    mlp_part(piece).reduce_tp_grads(piece);
    attention_part(piece).reduce_tp_grads(piece);
  }
  if (!sp_) return;
  TESSERA_PHASE("sp-grad-all-reduce");
  auto reduce = [&](const std::string& name) {
    Tensor g = params_->grad(name);
    tp_.all_reduce(g, ReduceOp::Sum);
  };
  if (piece == kHeadPiece) {
    reduce("lnf.weight");
    if (!cfg_.rmsnorm()) reduce("lnf.bias");
  } else if (piece >= 0) {
    LayerWeights& g = grads_[shard_.local_index(piece)];
    for (Tensor* t : {&g.ln1_w, &g.ln1_b, &g.ln2_w, &g.ln2_b})
      if (t->defined()) tp_.all_reduce(*t, ReduceOp::Sum);
  }
}

void GPTModel::tp_reduce(PhaseSequence& phase, Tensor& t) {
  if (tp_.size() > 1) phase("tp-all-reduce");  // TP 1: a no-op, no phase
  tp_.all_reduce(t, ReduceOp::Sum);
}

void GPTModel::cross_entropy(Tensor& losses, Tensor& logits, const Tensor& targets, Activations& a,
                             float grad_scale) {
  // Each TP rank holds a vocabulary shard of the logits: the row maxima, the sums of exponentials
  // and the target logits are reduced over TP (scratch rows of a), then each rank forms the token
  // losses and its shard of the logits' gradient in place.
  be_.xent_row_max(a.rowmax, logits, valid_cols_);
  tp_.all_reduce(a.rowmax, ReduceOp::Max);
  be_.xent_row_sums(a.sumexp, a.target_logit, logits, a.rowmax, targets, valid_cols_, vocab_begin_);
  tp_.all_reduce(a.sumexp, ReduceOp::Sum);
  tp_.all_reduce(a.target_logit, ReduceOp::Sum);
  be_.xent_loss_and_grad(losses, logits, a.rowmax, a.sumexp, a.target_logit, targets, valid_cols_,
                         vocab_begin_, grad_scale);
}

}  // namespace tessera
