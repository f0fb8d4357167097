// gpt.cpp: the model's plumbing on one rank's shard (DESIGN.md invariant 3): the block around its
// parts (the residual stream, the norms, the TP/SP reductions of the parts' outputs and input
// gradients, the dropout sites, recomputation), the head and its loss; the embedding is in
// model/embedding.cpp. What varies between families is in the parts (model/parts.hpp), chosen
// once per layer; what they share with the plumbing is PartServices (model/part_services.hpp).
#include "model/gpt.hpp"

#include <algorithm>
#include <string>

#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"
#include "model/mtp.hpp"
#include "model/part_services.hpp"
#include "model/parts.hpp"

namespace tessera {

namespace {
// Layer l's norms from the flat buffers; the parts bind their own weights. Absent parameters
// (norm biases with RMSNorm) stay undefined tensors.
LayerWeights norms(const ParamStore& ps, int l, bool grads) {
  LayerWeights w;
  w.ln1_w = ModelPart::param(ps, l, "ln1.weight", grads);
  w.ln1_b = ModelPart::param(ps, l, "ln1.bias", grads);
  w.ln2_w = ModelPart::param(ps, l, "ln2.weight", grads);
  w.ln2_b = ModelPart::param(ps, l, "ln2.bias", grads);
  return w;
}

}  // namespace

GPTModel::~GPTModel() = default;

GPTModel::GPTModel(const GPTConfig& cfg, const ModelShard& shard, Backend& backend,
                   Communicator& tp, DType compute, const RecomputeConfig& recompute,
                   const FlatLayout& layout)
    : cfg_(cfg), shard_(shard), be_(backend), tp_(tp), compute_(compute), recompute_(recompute) {
  cfg_.validate();
  plan_ = plan_recompute(recompute_, shard_);
  TESSERA_CHECK(tp.size() == shard.tp_size && tp.rank() == shard.tp_rank,
                "tensor-parallel communicator does not match the model shard");
  TESSERA_CHECK(cfg.num_attention_heads % shard.tp_size == 0 && cfg.ffn() % shard.tp_size == 0 &&
                    cfg.kv_heads() % shard.tp_size == 0,
                "heads, query groups and ffn width must divide by the tensor-parallel size");
  TESSERA_CHECK(
      !shard.sequence_parallel || shard.tp_size == 1 || cfg.seq_length % shard.tp_size == 0,
      "sequence parallelism needs --seq-length divisible by the tensor-parallel size");
  padded_vocab_ = cfg_.padded_vocab_size(shard.tp_size);
  services_ = std::make_unique<PartServices>(cfg_, shard_, backend, tp, compute);
  const std::vector<LayerSpec> all = build_layer_specs(cfg_);
  for (int l : shard_.layers()) {
    specs_.push_back(all[static_cast<size_t>(l)]);
    attention_.push_back(make_attention_part(specs_.back(), cfg_, shard_, services_.get()));
    mlp_.push_back(make_mlp_part(specs_.back(), cfg_, shard_, services_.get()));
  }
  {
    AllocationLabel label("the parameters and gradients of this rank's shard");
    params_ = std::make_unique<ParamStore>(build_param_specs(cfg_, shard_), backend.allocator(),
                                           compute, layout);
  }
  if (shard_.mtp_count > 0) mtp_ = std::make_unique<MtpHead>(cfg_, shard_, *services_, *params_);
  for (int l : shard_.layers()) {
    const size_t li = static_cast<size_t>(shard_.local_index(l));
    attention_[li]->bind(*params_, l);
    mlp_[li]->bind(*params_, l);
    weights_.push_back(norms(*params_, l, false));
    grads_.push_back(norms(*params_, l, true));
    range_names_.push_back("layer-" + std::to_string(l) + "-forward");
    range_names_.push_back("layer-" + std::to_string(l) + "-backward");
  }
}

void GPTModel::init_parameters(uint64_t seed, const ParamSink& master_sink) {
  // Drawn on the host (the counter-based RNG defines the values), then copied to the device one
  // parameter at a time so the staging buffer stays small. Bucket padding is zero.
  const bool master = params_->has_master();
  TESSERA_CHECK(master || master_sink, "init_parameters: no master weights here and no sink");
  if (!be_.computes()) return;  // shapes only: no values to draw
  if (master) be_.zero(params_->flat_params());
  if (compute_ != DType::F32 && !params_->layout().units_only_compute)
    be_.zero(params_->flat_compute());
  std::vector<float> host;
  for (const ParamSpec& s : params_->specs()) {
    host.resize(static_cast<size_t>(s.numel()));
    init_param(s, seed, host.data());
    if (master) {
      Tensor p = params_->param(s);
      be_.copy_from_host(p, host.data());
    } else {
      master_sink(s, host.data());
    }
  }
  if (master) sync_compute_weights();
  zero_grads();
}

void GPTModel::sync_compute_weights() {
  if (compute_ == DType::F32) return;
  TESSERA_CHECK(params_->has_master(),
                "sync_compute_weights without master weights: the "
                "distributed optimizer refreshes the compute copy");
  TESSERA_PHASE("weights-cast");
  be_.cast(params_->flat_compute(), params_->flat_params());
}

void GPTModel::zero_grads() {
  // Megatron-FSDP's sharded gradients: each unit's are zeroed when bound for a backward, the
  // shard at the step's start (step/fsdp.hpp).
  if (params_->layout().units_only_grads) return;
  TESSERA_PHASE("zero-grads");
  be_.zero(params_->flat_grads());
}

const Tensor& GPTModel::layer_input(int layer, const Activations& a) const {
  if (shard_.is_mtp_layer(layer)) return a.mtp[static_cast<size_t>(layer - shard_.mtp_begin)].x;
  const int begin = shard_.chunks[a.chunk].begin;
  return layer == begin ? a.input : a.layers[layer - 1 - begin].res2;
}

Tensor& GPTModel::stage_output(Activations& a) {
  const int n = chunk_layers(a).size();  // the chunk's last layer (MTP's come after it)
  return n == 0 ? a.input : a.layers[static_cast<size_t>(n - 1)].res2;
}

void GPTModel::set_expert_comm(Communicator& ep) {
  services_->set_expert_comm(ep);
}

void GPTModel::set_context_comm(Communicator& cp) {
  services_->set_context_comm(cp);
}

void GPTModel::set_fp8(const Fp8Config& c) {
  services_->set_fp8(c);
}

Fp8Scaling* GPTModel::fp8() const {
  return services_->fp8();
}

std::vector<StepHook*> GPTModel::step_hooks() const {
  std::vector<StepHook*> hooks;
  auto add = [&](StepHook* h) {
    if (h && std::find(hooks.begin(), hooks.end(), h) == hooks.end()) hooks.push_back(h);
  };
  add(services_->fp8());
  for (const auto& m : mlp_) add(m->step_hook());  // the MoE layers' one
  for (const auto& at : attention_) add(at->step_hook());
  add(mtp_.get());
  return hooks;
}

// ---------------------------------------------------------------------------------------------
// forward

// Phases (core/phase_timer.hpp, docs/profiling.md): one per op kind, each also an NVTX range. The
// TP collectives inside a layer are a phase of their own ("tp-all-reduce") where TP > 1.

void GPTModel::block_forward(int l, Activations& a) {
  if (!shard_.is_mtp_layer(l)) notify(&PassObserver::before_forward, l);  // MTP's: the head piece's
  const int li = shard_.local_index(l);
  TESSERA_CHECK(li >= 0 && shard_.chunk_of(l) == a.chunk, "layer ", l,
                " is not in the activations' model chunk");
  NvtxRange range(range_names_[2 * li].c_str());
  const LayerWeights& w = weights_[li];
  LayerActivations& la = services_->acts(l, a);
  const Tensor& x = layer_input(l, a);
  PhaseSequence phase;
  phase("layernorm-forward");
  PartServices& s = *services_;
  Tensor ln1 = s.own_rows(la.ln1, a);
  s.norm_forward(ln1, la.ln1_mean, la.ln1_rstd, x, w.ln1_w, w.ln1_b);
  s.gather_rows(phase, la.ln1);
  attention_[static_cast<size_t>(li)]->forward(phase, l, a, la, a.tmp_c);
  Tensor branch = s.reduce_rows(phase, a.tmp_c, a);
  if (const DropoutSpec d = s.hidden_dropout(l, DropoutKind::AttnOut, a); d.active()) {
    phase("dropout");
    s.apply_hidden_dropout(branch, branch, d, a);
  }
  phase("layernorm-forward");  // fused with the residual add
  Tensor ln2 = s.own_rows(la.ln2, a);
  s.add_norm_forward(la.res1, ln2, la.ln2_mean, la.ln2_rstd, x, branch, w.ln2_w, w.ln2_b);
  s.gather_rows(phase, la.ln2);
  mlp_[static_cast<size_t>(li)]->forward(phase, l, a, la, a.tmp_c);
  branch = s.reduce_rows(phase, a.tmp_c, a);
  if (const DropoutSpec d = s.hidden_dropout(l, DropoutKind::MlpOut, a); d.active()) {
    phase("dropout");
    s.apply_hidden_dropout(branch, branch, d, a);
  }
  phase("residual-add");
  be_.add(la.res2, la.res1, branch);
  if (!shard_.is_mtp_layer(l)) notify(&PassObserver::after_forward, l);
}

double GPTModel::head_forward(Activations& a, float grad_scale) {
  head_forward(a, grad_scale, a.losses);
  if (a.inference) return 0.0;  // generation: the logits are the result
  // Token losses come back to the host and are summed in double, in order (any layout, any
  // backend: the same sum).
  host_losses_.resize(static_cast<size_t>(a.losses.numel()));
  be_.copy_to_host(host_losses_.data(), a.losses);
  double sum = 0;
  for (float l : host_losses_) sum += l;
  return sum;
}

void GPTModel::head_forward(Activations& a, float grad_scale, Tensor& losses_out) {
  notify(&PassObserver::before_forward, kHeadPiece);
  NVTX_RANGE("head-forward-loss");
  TESSERA_CHECK(ends_in_head(a),
                "head_forward on a stage (or model chunk) without the output layer");
  const Tensor& h = stage_output(a);
  InferenceContext* gen = a.inference;
  if (gen) {  // generation: the output rows alone (each sequence's last new token, or every row)
    const int64_t C = cfg_.hidden_size;
    be_.embedding_forward(gen->rows_x, gen->out_rows, h.reshape({h.numel() / C, C}), 0);
  }
  PhaseSequence phase;
  phase("layernorm-forward");
  PartServices& s = *services_;
  Tensor lnf = s.own_rows(a.lnf, a);
  s.norm_forward(lnf, a.lnf_mean, a.lnf_rstd, gen ? gen->rows_x : h,
                 params_->compute_param("lnf.weight"),
                 cfg_.rmsnorm() ? Tensor() : params_->compute_param("lnf.bias"));
  s.gather_rows(phase, a.lnf);
  phase("lm-head-gemm-forward");
  be_.matmul_forward(a.logits, a.lnf, params_->compute_param(output_weight_name()), nullptr);
  if (gen) {  // the logits in f32 over the whole (padded) vocabulary: every TP rank's shard
    Tensor logits = a.logits;
    if (logits.dtype() != DType::F32) {
      be_.cast(gen->logits_f32, logits);
      logits = gen->logits_f32;
    }
    gen->logits = logits.reshape({logits.numel()});
    if (tp_.size() > 1) {
      tp_.all_gather(gen->gathered, gen->logits);
      gen->logits = gen->gathered;
    }
    notify(&PassObserver::after_forward, kHeadPiece);
    return;
  }
  phase("cross-entropy");  // with its TP all-reduces of the row statistics
  s.cross_entropy(a.losses, a.logits, a.targets, a, grad_scale);
  if (losses_out.raw() != a.losses.raw()) be_.cast(losses_out, a.losses);  // a device copy
  if (mtp_ && a.dropout.training)  // its loss joins the gradient, logged apart
    mtp_->forward(a, grad_scale, h, [this](int l, Activations& x) { block_forward(l, x); });
  notify(&PassObserver::after_forward, kHeadPiece);
}

void GPTModel::mtp_forward(Activations& a, float grad_scale) {
  notify(&PassObserver::before_forward, kHeadPiece);
  if (a.dropout.training)
    mtp_->forward(a, grad_scale, stage_output(a),
                  [this](int l, Activations& x) { block_forward(l, x); });
  notify(&PassObserver::after_forward, kHeadPiece);
}

double GPTModel::forward(Activations& a, float grad_scale) {
  if (embeds(a)) embed_forward(a);
  for (int l = chunk_layers(a).begin; l < chunk_layers(a).end; ++l) block_forward(l, a);
  if (ends_in_mtp(a)) mtp_forward(a, grad_scale);
  return ends_in_head(a) ? head_forward(a, grad_scale) : 0.0;
}

// ---------------------------------------------------------------------------------------------
// backward

void GPTModel::head_backward(Activations& a) {
  notify(&PassObserver::before_backward, kHeadPiece);
  NVTX_RANGE("head-backward");
  // logits now hold dlogits. dlnf = dlogits * W (the output weight) is a partial sum over
  // vocabulary shards.
  Tensor dw = params_->grad(output_weight_name());
  PhaseSequence phase;
  phase("lm-head-gemm-backward");
  services_->gemm_backward(&a.dln, dw, nullptr, a.logits, a.lnf,
                           params_->compute_param(output_weight_name()));
  const Tensor dlnf = services_->reduce_rows(phase, a.dln, a);
  phase("layernorm-backward");
  be_.zero(a.dres);
  Tensor dlnf_w = params_->grad("lnf.weight");
  Tensor dlnf_b = cfg_.rmsnorm() ? Tensor() : params_->grad("lnf.bias");
  services_->norm_backward(a.dres, dlnf_w, dlnf_b, dlnf, stage_output(a),
                           params_->compute_param("lnf.weight"), a.lnf_mean, a.lnf_rstd);
  if (mtp_ && a.dropout.training)  // adds the MTP chain's gradient
    mtp_->backward(a, stage_output(a), [this](int l, Activations& x) { block_backward(l, x); });
}

void GPTModel::mtp_backward(Activations& a) {
  notify(&PassObserver::before_backward, kHeadPiece);
  if (a.dropout.training)  // a.dres: the next stage's gradient of this stage's output
    mtp_->backward(a, stage_output(a), [this](int l, Activations& x) { block_backward(l, x); });
}

void GPTModel::recompute_for_backward(int l, Activations& a) {
  const LayerRecompute& p = plan_[static_cast<size_t>(shard_.local_index(l))];
  if (p.kind == RecomputeGranularity::Full && p.chunk_last(l)) {
    // The chunk's forward again from its kept input: every buffer of the chunk (the working set)
    // is refilled, and the kept output is rewritten with the same bits.
    NVTX_RANGE("recompute-full");
    services_->set_recomputing(true);
    for (int k = p.chunk_begin; k < p.chunk_end; ++k) block_forward(k, a);
    services_->set_recomputing(false);
  } else if (p.kind == RecomputeGranularity::Selective) {
    // The LayerNorm outputs (with their statistics), the attention core's output and lse, and
    // the GELU output, from the kept layer input, qkv, res1 and fc1 output: the same kernels on
    // the same inputs as the forward.
    NVTX_RANGE("recompute-selective");
    const LayerWeights& w = weights_[shard_.local_index(l)];
    PartServices& s = *services_;
    LayerActivations& la = s.acts(l, a);
    PhaseSequence phase;
    phase("layernorm-forward");
    Tensor ln1 = s.own_rows(la.ln1, a), ln2 = s.own_rows(la.ln2, a);
    s.norm_forward(ln1, la.ln1_mean, la.ln1_rstd, layer_input(l, a), w.ln1_w, w.ln1_b);
    s.norm_forward(ln2, la.ln2_mean, la.ln2_rstd, la.res1, w.ln2_w, w.ln2_b);
    s.gather_rows(phase, la.ln1);  // the gathers of the forward again (sequence parallelism)
    s.gather_rows(phase, la.ln2);
    attention_part(l).recompute(phase, l, a, la);
    mlp_part(l).recompute(phase, l, a, la);
  }
}

void GPTModel::block_backward(int l, Activations& a) {
  if (!shard_.is_mtp_layer(l))
    notify(&PassObserver::before_backward, l);  // MTP's: the head piece's
  recompute_for_backward(l, a);
  const int li = shard_.local_index(l);
  NvtxRange range(range_names_[2 * li + 1].c_str());
  const LayerWeights& w = weights_[li];
  LayerWeights& g = grads_[li];
  PartServices& s = *services_;
  LayerActivations& la = s.acts(l, a);
  const Tensor& x = layer_input(l, a);
  PhaseSequence phase;
  // MLP: res2 = res1 + drop(fc2(gelu(fc1(ln2(res1))))); dres holds d res2 and becomes d res1.
  // The branch's gradient is dres through the forward's mask, gathered over TP with sequence
  // parallelism (branch_grad).
  const Tensor& dmlp = s.branch_grad(phase, a, s.hidden_dropout(l, DropoutKind::MlpOut, a));
  mlp_part(l).backward(phase, l, a, la, dmlp);
  Tensor dln = s.reduce_rows(phase, a.dln, a);  // column-parallel input gradient
  phase("layernorm-backward");
  s.norm_backward(a.dres, g.ln2_w, g.ln2_b, dln, la.res1, w.ln2_w, la.ln2_mean, la.ln2_rstd);
  // Attention: res1 = x + drop(proj(attn(qkv(ln1(x))))); dres becomes d x.
  const Tensor& dattn = s.branch_grad(phase, a, s.hidden_dropout(l, DropoutKind::AttnOut, a));
  attention_part(l).backward(phase, l, a, la, dattn);
  dln = s.reduce_rows(phase, a.dln, a);
  phase("layernorm-backward");
  s.norm_backward(a.dres, g.ln1_w, g.ln1_b, dln, x, w.ln1_w, la.ln1_mean, la.ln1_rstd);
}

void GPTModel::remove_observer(PassObserver* o) {
  observers_.erase(std::remove(observers_.begin(), observers_.end(), o), observers_.end());
}

void GPTModel::backward(Activations& a, bool weights_later) {
  WeightGradStore& store = services_->weight_grads();
  if (weights_later) store.begin_pass();
  auto begin = [&](int piece) {
    if (weights_later) store.begin_piece(piece);
  };
  auto ready = [&](int piece) {
    if (!weights_later) notify(&PassObserver::grads_ready, piece);  // else after its W pass
    notify(&PassObserver::after_backward, piece);
  };
  if (ends_in_head(a)) {
    begin(kHeadPiece);
    head_backward(a);
    ready(kHeadPiece);
  } else if (ends_in_mtp(a)) {
    begin(kHeadPiece);
    mtp_backward(a);
    ready(kHeadPiece);
  }
  for (int l = chunk_layers(a).end - 1; l >= chunk_layers(a).begin; --l) {
    begin(l);
    block_backward(l, a);
    ready(l);
  }
  if (embeds(a)) {
    begin(kEmbedPiece);
    embed_backward(a);
    ready(kEmbedPiece);
  }
  if (weights_later) store.end_pass();
}

void GPTModel::weight_backward() {
  services_->weight_grads().run_oldest(
      [this](int piece) { notify(&PassObserver::grads_ready, piece); });
}

void GPTModel::reduce_sequence_parallel_grads(int piece) {
  if (piece == kHeadPiece && mtp_) {  // multi-token prediction's layers complete with the head
    for (int k = 0; k < shard_.mtp_count; ++k) reduce_sequence_parallel_grads(shard_.mtp_begin + k);
    mtp_->reduce_tp_grads();  // and its norms and projection
  }
  if (piece >= 0) {  // each part's partial sums over TP (the router; q/k norms, MLA's latents)
    mlp_part(piece).reduce_tp_grads(piece);
    attention_part(piece).reduce_tp_grads(piece);
  }
  if (!services_->sequence_parallel()) return;
  TESSERA_PHASE("sp-grad-all-reduce");
  auto reduce = [&](const std::string& name) {
    Tensor g = params_->grad(name);
    tp_.all_reduce(g, ReduceOp::Sum);
  };
  if (piece == kHeadPiece && shard_.has_head) {
    reduce("lnf.weight");
    if (!cfg_.rmsnorm()) reduce("lnf.bias");
  } else if (piece >= 0) {
    LayerWeights& g = grads_[shard_.local_index(piece)];
    for (Tensor* t : {&g.ln1_w, &g.ln1_b, &g.ln2_w, &g.ln2_b})
      if (t->defined()) tp_.all_reduce(*t, ReduceOp::Sum);
  }
}

}  // namespace tessera
