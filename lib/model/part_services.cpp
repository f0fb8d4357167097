// part_services.cpp: what the parts and the block's plumbing share (model/part_services.hpp):
// the FP8 GEMMs, the norms, the sequence-parallel rows and their TP reductions, dropout, the
// vocabulary-parallel cross-entropy. The attention core and context parallelism's ring are in
// model/context_parallel.cpp.
#include "model/part_services.hpp"

#include <algorithm>

#include "core/phase_timer.hpp"
#include "core/test_hooks.hpp"

namespace tessera {

PartServices::PartServices(const GPTConfig& cfg, const ModelShard& shard, Backend& backend,
                           Communicator& tp, DType compute)
    : cfg_(cfg), shard_(shard), be_(backend), tp_(tp), compute_(compute), weight_grads_(backend) {
  const int64_t padded_vocab = cfg_.padded_vocab_size(shard.tp_size);
  vocab_local_ = padded_vocab / shard.tp_size;
  vocab_begin_ = vocab_local_ * shard.tp_rank;
  valid_cols_ =
      std::max<int64_t>(0, std::min<int64_t>(vocab_local_, cfg_.vocab_size - vocab_begin_));
  heads_local_ = cfg.num_attention_heads / shard.tp_size;
  kv_heads_local_ = cfg.kv_heads() / shard.tp_size;
  rope_.heads = heads_local_;
  rope_.kv_heads = kv_heads_local_;
  rope_.head_dim = cfg.head_dim();
  rope_.rot_dim = cfg.rotary_dim();
  rope_.base = cfg.rotary_base;
  rope_.interleaved = cfg.rotary_interleaved;
  alibi_.head_begin = heads_local_ * shard.tp_rank;
  alibi_.heads_total = cfg.num_attention_heads;
  if (cfg.use_rope_scaling)
    rope_.scaling =
        RopeScaling{cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
                    cfg.rope_scaling_high_freq_factor, cfg.rope_scaling_original_max_positions};
  if (cfg.yarn()) {  // YaRN (MLA): the factor over the original context, the beta ramp
    rope_.scaling.factor = cfg.rotary_scaling_factor;
    rope_.scaling.original_max_positions = cfg.original_max_position_embeddings;
    rope_.scaling.yarn = true;
    rope_.scaling.beta_fast = cfg.beta_fast;
    rope_.scaling.beta_slow = cfg.beta_slow;
  }
  sp_ = shard.sequence_parallel && shard.tp_size > 1;
  if (cfg_.apply_layernorm_1p) {  // the constant 1 of (1 + w), and where (1 + w) is formed
    AllocationLabel label("the (1 + w) norm weights of --apply-layernorm-1p");
    const int64_t width = std::max<int64_t>(cfg_.hidden_size, cfg_.head_dim());  // q/k norms: hd
    const std::vector<float> ones(static_cast<size_t>(width), 1.f);
    Tensor host_ones({width}, DType::F32, backend.allocator());
    be_.copy_from_host(host_ones, ones.data());
    norm_w1p_ = Tensor({width}, compute, backend.allocator());
    norm_ones_ = host_ones;
    if (compute != DType::F32) {
      norm_ones_ = Tensor({width}, compute, backend.allocator());
      be_.cast(norm_ones_, host_ones);
    }
  }
}

void PartServices::rope(Tensor& qkv, const Activations& a, bool backward) {
  be_.rope(qkv, rope_spec(a.T), rope_positions(a), backward);
}

DropoutSpec PartServices::hidden_dropout(int layer, DropoutKind kind, const Activations& a) const {
  const DropoutContext& c = a.dropout;
  if (!c.training || cfg_.hidden_dropout <= 0) return {};
  return make_dropout_spec(cfg_.hidden_dropout, c.seed, c.iteration, layer, kind, c.sample_begin);
}

const AttentionDropout* PartServices::attention_dropout(int layer, const Activations& a) {
  const DropoutContext& c = a.dropout;
  if (!c.training || cfg_.attention_dropout <= 0) return nullptr;
  attn_drop_.spec = make_dropout_spec(cfg_.attention_dropout, c.seed, c.iteration, layer,
                                      DropoutKind::Attention, c.sample_begin);
  attn_drop_.head_begin =
      test_hooks::dropout_ignore_tp_offset() ? 0 : heads_local_ * shard_.tp_rank;
  attn_drop_.heads_total = cfg_.num_attention_heads;
  return &attn_drop_;
}

const Tensor& PartServices::norm_weight(const Tensor& w) {
  if (!cfg_.apply_layernorm_1p) return w;
  // (1 + w) formed just before each use: the stored weight stays what the optimizer updates, and
  // its gradient is the gradient of (1 + w). The hidden norms are C wide, the q/k norms hd.
  norm_w1p_view_ = norm_w1p_.view(0, {w.numel()});
  be_.add(norm_w1p_view_, w, norm_ones_.view(0, {w.numel()}));
  return norm_w1p_view_;
}

void PartServices::norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                const Tensor& weight, const Tensor& b) {
  const Tensor& w = norm_weight(weight);
  if (cfg_.rmsnorm())
    be_.rmsnorm_forward(out, rstd, inp, w, cfg_.layernorm_epsilon);
  else
    be_.layernorm_forward(out, mean, rstd, inp, w, b, cfg_.layernorm_epsilon);
}

void PartServices::add_norm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd,
                                    const Tensor& a, const Tensor& b, const Tensor& weight,
                                    const Tensor& bias) {
  const Tensor& w = norm_weight(weight);
  if (cfg_.rmsnorm())
    be_.add_rmsnorm_forward(sum, out, rstd, a, b, w, cfg_.layernorm_epsilon);
  else
    be_.add_layernorm_forward(sum, out, mean, rstd, a, b, w, bias, cfg_.layernorm_epsilon);
}

void PartServices::norm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout,
                                 const Tensor& inp, const Tensor& weight, const Tensor& mean,
                                 const Tensor& rstd) {
  const Tensor& w = norm_weight(weight);
  if (cfg_.rmsnorm())
    be_.rmsnorm_backward(dinp, dw, dout, inp, w, rstd);
  else
    be_.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd);
}

void PartServices::linear_forward(int l, Fp8Gemm g, Tensor& out, const Tensor& inp, const Tensor& w,
                                  const Tensor* bias, const Activations& a, int expert) {
  if (!fp8_layer(l)) {
    be_.matmul_forward(out, inp, w, bias);
    return;
  }
  const int li = shard_.local_index(l);
  const bool record = a.dropout.training && !recomputing_;  // a training step's first forward
  const Backend::Fp8Operand x = fp8_->operand(li, g, Fp8Role::Input, inp, record, expert);
  const Backend::Fp8Operand wq = fp8_->operand(li, g, Fp8Role::Weight, w, record, expert);
  if (inp.dim(0) > 0) be_.fp8_matmul_forward(out, inp, w, bias, x, wq);
}

void PartServices::linear_backward(int l, Fp8Gemm g, Tensor* dinp, Tensor& dw, Tensor* dbias,
                                   const Tensor& dout, const Tensor& inp, const Tensor& w,
                                   int expert) {
  if (!fp8_layer(l)) {
    gemm_backward(dinp, dw, dbias, dout, inp, w);
    return;
  }
  // FP8's GEMMs run whole in a zero-bubble B pass (their W half reads quantized operands).
  // The input and weight quantized again as in the forward (the same scales, so the same values);
  // the output gradient's amax joins the step's (a backward is always a training step's).
  const int li = shard_.local_index(l);
  const Backend::Fp8Operand go = fp8_->operand(li, g, Fp8Role::GradOutput, dout, true, expert);
  const Backend::Fp8Operand x = fp8_->operand(li, g, Fp8Role::Input, inp, false, expert);
  const Backend::Fp8Operand wq = fp8_->operand(li, g, Fp8Role::Weight, w, false, expert);
  if (inp.dim(0) > 0) be_.fp8_matmul_backward(dinp, dw, dbias, dout, inp, w, go, x, wq);
}

void PartServices::gemm_backward(Tensor* dinp, Tensor& dw, Tensor* dbias, const Tensor& dout,
                                 const Tensor& inp, const Tensor& w) {
  if (!weight_grads_.recording()) {
    be_.matmul_backward(dinp, dw, dbias, dout, inp, w);
    return;
  }
  Tensor none;
  if (dinp) be_.matmul_backward(dinp, none, nullptr, dout, inp, w);
  weight_grads_.defer(dw, dbias, dout, inp, w);
}

void PartServices::gemm_gelu_backward(Tensor& dpre, Tensor& dw, Tensor* dbias, const Tensor& dout,
                                      const Tensor& inp, const Tensor& w, const Tensor& pre) {
  if (!weight_grads_.recording()) {
    be_.matmul_gelu_backward(dpre, dw, dbias, dout, inp, w, pre);
    return;
  }
  Tensor none;
  be_.matmul_gelu_backward(dpre, none, nullptr, dout, inp, w, pre);
  weight_grads_.defer(dw, dbias, dout, inp, w);
}

void PartServices::grouped_gemm_backward(const std::vector<Backend::GroupedGemm>& groups) {
  if (!weight_grads_.recording()) {
    be_.grouped_matmul_backward(groups);
    return;
  }
  std::vector<Backend::GroupedGemm> inputs;
  for (Backend::GroupedGemm g : groups)
    if (g.out) {
      g.dweight = nullptr;
      inputs.push_back(g);
    }
  if (!inputs.empty()) be_.grouped_matmul_backward(inputs);
  weight_grads_.defer_grouped(groups);
}

void PartServices::embedding_grad(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                  int64_t row_begin) {
  if (weight_grads_.recording() && cfg_.tied_head())
    weight_grads_.defer_embedding(dtable, dout, ids, row_begin);
  else
    be_.embedding_backward(dtable, dout, ids, row_begin);
}

void PartServices::set_fp8(const Fp8Config& c) {
  fp8_.reset();
  if (!c.enabled) return;
  TESSERA_CHECK(shard_.cp_size == 1 || cp_, "set_fp8 before set_context_comm");
  fp8_ = std::make_unique<Fp8Scaling>(c, shard_.layers(), cfg_.num_layers, cfg_.num_experts, be_,
                                      tp_, shard_.cp_size > 1 ? cp_ : nullptr);
}

int64_t PartServices::dropout_row_begin(const Activations& a) const {
  // Testing (the layout-equivalence test's mutation check): TESSERA_FAULT_DROPOUT_KEY.
  return test_hooks::dropout_ignore_tp_offset() ? 0 : row_begin(a);
}

int64_t PartServices::local_rows(const Activations& a) const {
  const int64_t N = int64_t(a.B) * a.T;
  return sp_ ? N / shard_.tp_size : N;
}

int64_t PartServices::row_begin(const Activations& a) const {
  return sp_ ? local_rows(a) * shard_.tp_rank : 0;
}

Tensor PartServices::own_rows(const Tensor& full, const Activations& a) const {
  const int64_t C = cfg_.hidden_size;
  return sp_ ? full.view(row_begin(a) * C, {local_rows(a), C}) : full;
}

Tensor PartServices::reduce_rows(PhaseSequence& phase, Tensor& full, const Activations& a) {
  if (!sp_) {
    tp_reduce(phase, full);
    return full;
  }
  phase("sp-reduce-scatter");
  tp_.reduce_scatter_async(full)->wait_device();
  return own_rows(full, a);
}

void PartServices::gather_rows(PhaseSequence& phase, Tensor& full) {
  if (!sp_) return;
  phase("sp-all-gather");
  tp_.all_gather_async(full)->wait_device();
}

const Tensor& PartServices::branch_grad(PhaseSequence& phase, Activations& a,
                                        const DropoutSpec& site) {
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

void PartServices::tp_reduce(PhaseSequence& phase, Tensor& t) {
  if (tp_.size() > 1) phase("tp-all-reduce");  // TP 1: a no-op, no phase
  tp_.all_reduce(t, ReduceOp::Sum);
}

void PartServices::cross_entropy(Tensor& losses, Tensor& logits, const Tensor& targets,
                                 Activations& a, float grad_scale) {
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

void PartServices::cp_sum(std::vector<int64_t>& counts) {
  TESSERA_CHECK(cp_ && cp_->size() == shard_.cp_size,
                "context parallelism: no ring (PartServices::set_context_comm)");
  std::vector<double> d(counts.begin(), counts.end());  // exact integers in doubles
  cp_->all_reduce_f64(d.data(), static_cast<int64_t>(d.size()), ReduceOp::Sum);
  for (size_t i = 0; i < d.size(); ++i) counts[i] = static_cast<int64_t>(d[i]);
}

void PartServices::set_expert_comm(Communicator& ep) {
  TESSERA_CHECK(ep.size() == shard_.ep_size && ep.rank() == shard_.ep_rank,
                "expert-parallel communicator does not match the model shard");
  ep_ = &ep;
}

const AttentionDocuments* PartServices::documents(const Activations& a) {
  documents_ = AttentionDocuments{};
  if (a.doc_key_begin.defined()) documents_.key_begin = &a.doc_key_begin;
  if (cfg_.alibi()) {  // the whole samples' position ids (by global position under CP)
    const Tensor& p = shard_.cp_size > 1 ? a.doc_positions_all : a.doc_positions;
    if (p.defined()) documents_.positions = &p;
  }
  return documents_.active() ? &documents_ : nullptr;
}

}  // namespace tessera
