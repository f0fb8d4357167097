// gpt.cpp: the model's plumbing on one rank's shard (DESIGN.md invariant 3): the embedding, the
// block around its parts (the residual stream, the norms, the TP/SP reductions of the parts'
// outputs and input gradients, the dropout sites, recomputation), the head and its loss. What
// varies between families is in the parts (model/parts.hpp), chosen once per layer.
#include "model/gpt.hpp"

#include <algorithm>
#include <string>

#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"
#include "core/test_hooks.hpp"
#include "model/parts.hpp"

namespace tessera {

namespace {
// Layer l's norms from the flat buffers; the parts bind their own weights. Absent parameters
// (norm biases with RMSNorm) stay undefined tensors.
LayerWeights layer_tensors(const ParamStore& ps, int l, bool grads, const AttentionPart& attention,
                           const MlpPart& mlp) {
  LayerWeights w;
  w.ln1_w = ModelPart::param(ps, l, "ln1.weight", grads);
  w.ln1_b = ModelPart::param(ps, l, "ln1.bias", grads);
  w.ln2_w = ModelPart::param(ps, l, "ln2.weight", grads);
  w.ln2_b = ModelPart::param(ps, l, "ln2.bias", grads);
  attention.bind(ps, l, grads, w);
  mlp.bind(ps, l, grads, w);
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
  padded_vocab_ = cfg_.padded_vocab_size(shard.tp_size);
  vocab_local_ = padded_vocab_ / shard.tp_size;
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
  hidden_local_ = heads_local_ * cfg.head_dim();
  ffn_local_ = cfg.ffn() / shard.tp_size;
  sp_ = shard.sequence_parallel && shard.tp_size > 1;
  {
    const std::vector<LayerSpec> all = build_layer_specs(cfg_);
    for (int l : shard_.layers()) {
      specs_.push_back(all[static_cast<size_t>(l)]);
      attention_.push_back(make_attention_part(specs_.back(), cfg_, shard_, this));
      mlp_.push_back(make_mlp_part(specs_.back(), cfg_, shard_, this));
    }
    if (!all.empty()) activation_ = all[0].activation;
    swiglu_ = activation_ == MlpActivation::SwiGLU;
  }
  init_moe();
  init_mtp();
  TESSERA_CHECK(!sp_ || cfg.seq_length % shard.tp_size == 0, "sequence parallelism needs ",
                "--seq-length divisible by the tensor-parallel size");
  {
    AllocationLabel label("the parameters and gradients of this rank's shard");
    params_ = std::make_unique<ParamStore>(build_param_specs(cfg_, shard_), backend.allocator(),
                                           compute, layout);
  }
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
  moe_stats_.resize(static_cast<size_t>(shard_.num_layers()));
  mtp_losses_.assign(static_cast<size_t>(shard_.mtp_count), MtpLoss{});
  step_tokens_.resize(static_cast<size_t>(shard_.num_layers()));
  logged_tokens_.resize(static_cast<size_t>(shard_.num_layers()));
  expert_bias_.resize(static_cast<size_t>(shard_.num_layers()));
  for (int l : shard_.layers())
    if (moe_layer(l) && cfg_.moe_router_enable_expert_bias)  // starts at zero
      expert_bias_[static_cast<size_t>(shard_.local_index(l))].assign(
          static_cast<size_t>(cfg_.num_experts), 0.f);
  for (int l : shard_.layers()) {
    const size_t li = static_cast<size_t>(shard_.local_index(l));
    weights_.push_back(layer_tensors(*params_, l, false, *attention_[li], *mlp_[li]));
    grads_.push_back(layer_tensors(*params_, l, true, *attention_[li], *mlp_[li]));
    range_names_.push_back("layer-" + std::to_string(l) + "-forward");
    range_names_.push_back("layer-" + std::to_string(l) + "-backward");
  }
}

void GPTModel::init_parameters(uint64_t seed, const ParamSink& master_sink) {
  // Drawn on the host (the counter-based RNG defines the values), then copied to the device one
  // parameter at a time so the staging buffer stays small. Bucket padding is zero.
  const bool master = params_->has_master();
  TESSERA_CHECK(master || master_sink, "init_parameters: no master weights here and no sink");
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

std::vector<std::vector<int>> GPTModel::pieces_of_params() const {
  return param_pieces(params_->specs(), shard_);
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
  // shard at the step's start (train/fsdp.hpp).
  if (params_->layout().units_only_grads) return;
  TESSERA_PHASE("zero-grads");
  be_.zero(params_->flat_grads());
}

LayerActivations& GPTModel::acts_of(int layer, Activations& a) const {
  return a.layers[layer - shard_.chunks[a.chunk].begin];
}

DropoutSpec GPTModel::hidden_dropout(int layer, DropoutKind kind, const Activations& a) const {
  const DropoutContext& c = a.dropout;
  if (!c.training || cfg_.hidden_dropout <= 0) return {};
  return make_dropout_spec(cfg_.hidden_dropout, c.seed, c.iteration, layer, kind, c.sample_begin);
}

const AttentionDropout* GPTModel::attention_dropout(int layer, const Activations& a) {
  const DropoutContext& c = a.dropout;
  if (!c.training || cfg_.attention_dropout <= 0) return nullptr;
  attn_drop_.spec = make_dropout_spec(cfg_.attention_dropout, c.seed, c.iteration, layer,
                                      DropoutKind::Attention, c.sample_begin);
  attn_drop_.head_begin =
      test_hooks::dropout_ignore_tp_offset() ? 0 : heads_local_ * shard_.tp_rank;
  attn_drop_.heads_total = cfg_.num_attention_heads;
  return &attn_drop_;
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

Tensor& GPTModel::activation_backward(PhaseSequence& phase, Tensor& dact, Tensor& dfc1_swiglu,
                                      const Tensor& fc1) {
  phase(mlp_activation_phase(activation_, true));
  return mlp_activation_backward(be_, activation_, dact, dfc1_swiglu, fc1);
}

void GPTModel::activation_forward(PhaseSequence& phase, LayerActivations& la) {
  phase(mlp_activation_phase(activation_, false));
  mlp_activation(la.gelu, la.fc1);
}

void GPTModel::mlp_activation(Tensor& out, const Tensor& fc1) {
  mlp_activation_forward(be_, activation_, out, fc1);
}

const Tensor& GPTModel::norm_weight(const Tensor& w) {
  if (!cfg_.apply_layernorm_1p) return w;
  // (1 + w) formed just before each use: the stored weight stays what the optimizer updates, and
  // its gradient is the gradient of (1 + w). The hidden norms are C wide, the q/k norms hd.
  norm_w1p_view_ = norm_w1p_.view(0, {w.numel()});
  be_.add(norm_w1p_view_, w, norm_ones_.view(0, {w.numel()}));
  return norm_w1p_view_;
}

void GPTModel::norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                            const Tensor& weight, const Tensor& b) {
  const Tensor& w = norm_weight(weight);
  if (cfg_.rmsnorm())
    be_.rmsnorm_forward(out, rstd, inp, w, cfg_.layernorm_epsilon);
  else
    be_.layernorm_forward(out, mean, rstd, inp, w, b, cfg_.layernorm_epsilon);
}

void GPTModel::add_norm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd,
                                const Tensor& a, const Tensor& b, const Tensor& weight,
                                const Tensor& bias) {
  const Tensor& w = norm_weight(weight);
  if (cfg_.rmsnorm())
    be_.add_rmsnorm_forward(sum, out, rstd, a, b, w, cfg_.layernorm_epsilon);
  else
    be_.add_layernorm_forward(sum, out, mean, rstd, a, b, w, bias, cfg_.layernorm_epsilon);
}

void GPTModel::norm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout,
                             const Tensor& inp, const Tensor& weight, const Tensor& mean,
                             const Tensor& rstd) {
  const Tensor& w = norm_weight(weight);
  if (cfg_.rmsnorm())
    be_.rmsnorm_backward(dinp, dw, dout, inp, w, rstd);
  else
    be_.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd);
}

// ---------------------------------------------------------------------------------------------
// forward

// Phases (core/phase_timer.hpp, docs/profiling.md): one per op kind, each also an NVTX range. The
// TP collectives inside a layer are a phase of their own ("tp-all-reduce") where TP > 1.

void GPTModel::embed_forward(Activations& a) {
  notify(&PassObserver::before_forward, kEmbedPiece);
  TESSERA_CHECK(embeds(a), "embed_forward on a stage (or model chunk) without the embedding");
  PhaseSequence phase;
  phase("embedding-forward");
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  if (sp_) {
    // Each TP rank fills the rows of its vocabulary shard (zeros elsewhere) and rank 0 adds the
    // positions; the reduce-scatter sums them (wpe and one embedding row per element, the rest
    // zeros: the all-reduce path's sum, bit for bit) and leaves each rank its rows.
    Tensor full = a.tmp_c;
    be_.embedding_forward(full, a.ids, params_->compute_param("wte"), vocab_begin_);
    if (shard_.tp_rank == 0 && cfg_.learned_positions()) {
      Tensor btc = full.reshape({a.B, a.T, C});
      add_position_embedding(btc, a);
    }
    const Tensor mine = reduce_rows(phase, full, a);
    phase("embedding-forward");
    be_.cast(a.input, mine);  // a copy
  } else {
    Tensor x = a.input.reshape({N, C});
    be_.embedding_forward(x, a.ids, params_->compute_param("wte"), vocab_begin_);
    tp_.all_reduce(a.input, ReduceOp::Sum);  // each TP rank filled the rows of its vocab shard
    if (cfg_.learned_positions()) add_position_embedding(a.input, a);
  }
  if (const DropoutSpec d = hidden_dropout(0, DropoutKind::Embedding, a); d.active()) {
    phase("dropout");
    apply_hidden_dropout(a.input, a.input, d, a);
  }
  notify(&PassObserver::after_forward, kEmbedPiece);
}

void GPTModel::block_forward(int l, Activations& a) {
  if (!shard_.is_mtp_layer(l)) notify(&PassObserver::before_forward, l);  // MTP's: the head piece's
  const int li = shard_.local_index(l);
  TESSERA_CHECK(li >= 0 && shard_.chunk_of(l) == a.chunk, "layer ", l,
                " is not in the activations' model chunk");
  NvtxRange range(range_names_[2 * li].c_str());
  const LayerWeights& w = weights_[li];
  LayerActivations& la = acts_of(l, a);
  const Tensor& x = layer_input(l, a);
  PhaseSequence phase;
  phase("layernorm-forward");
  Tensor ln1 = own_rows(la.ln1, a);
  norm_forward(ln1, la.ln1_mean, la.ln1_rstd, x, w.ln1_w, w.ln1_b);
  gather_rows(phase, la.ln1);
  attention_[static_cast<size_t>(li)]->forward(phase, l, a, la, a.tmp_c);
  Tensor branch = reduce_rows(phase, a.tmp_c, a);
  if (const DropoutSpec d = hidden_dropout(l, DropoutKind::AttnOut, a); d.active()) {
    phase("dropout");
    apply_hidden_dropout(branch, branch, d, a);
  }
  phase("layernorm-forward");  // fused with the residual add
  Tensor ln2 = own_rows(la.ln2, a);
  add_norm_forward(la.res1, ln2, la.ln2_mean, la.ln2_rstd, x, branch, w.ln2_w, w.ln2_b);
  gather_rows(phase, la.ln2);
  mlp_[static_cast<size_t>(li)]->forward(phase, l, a, la, a.tmp_c);
  branch = reduce_rows(phase, a.tmp_c, a);
  if (const DropoutSpec d = hidden_dropout(l, DropoutKind::MlpOut, a); d.active()) {
    phase("dropout");
    apply_hidden_dropout(branch, branch, d, a);
  }
  phase("residual-add");
  be_.add(la.res2, la.res1, branch);
  if (!shard_.is_mtp_layer(l)) notify(&PassObserver::after_forward, l);
}

void GPTModel::linear_forward(int l, Fp8Gemm g, Tensor& out, const Tensor& inp, const Tensor& w,
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

void GPTModel::linear_backward(int l, Fp8Gemm g, Tensor* dinp, Tensor& dw, Tensor* dbias,
                               const Tensor& dout, const Tensor& inp, const Tensor& w, int expert) {
  if (!fp8_layer(l)) {
    be_.matmul_backward(dinp, dw, dbias, dout, inp, w);
    return;
  }
  // The input and weight quantized again as in the forward (the same scales, so the same values);
  // the output gradient's amax joins the step's (a backward is always a training step's).
  const int li = shard_.local_index(l);
  const Backend::Fp8Operand go = fp8_->operand(li, g, Fp8Role::GradOutput, dout, true, expert);
  const Backend::Fp8Operand x = fp8_->operand(li, g, Fp8Role::Input, inp, false, expert);
  const Backend::Fp8Operand wq = fp8_->operand(li, g, Fp8Role::Weight, w, false, expert);
  if (inp.dim(0) > 0) be_.fp8_matmul_backward(dinp, dw, dbias, dout, inp, w, go, x, wq);
}

void GPTModel::set_fp8(const Fp8Config& c) {
  fp8_.reset();
  if (!c.enabled) return;
  TESSERA_CHECK(shard_.cp_size == 1 || cp_comm_, "set_fp8 before set_context_comm");
  fp8_ = std::make_unique<Fp8Scaling>(c, shard_.layers(), cfg_.num_layers, cfg_.num_experts, be_,
                                      tp_, shard_.cp_size > 1 ? cp_comm_ : nullptr);
}

std::vector<StepHook*> GPTModel::step_hooks() const {
  std::vector<StepHook*> hooks;
  for (StepHook* h : {static_cast<StepHook*>(fp8_.get()), routing_hook_.get(), mtp_hook_.get()})
    if (h) hooks.push_back(h);
  return hooks;
}

double GPTModel::head_forward(Activations& a, float grad_scale) {
  head_forward(a, grad_scale, a.losses);
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
  PhaseSequence phase;
  phase("layernorm-forward");
  Tensor lnf = own_rows(a.lnf, a);
  norm_forward(lnf, a.lnf_mean, a.lnf_rstd, h, params_->compute_param("lnf.weight"),
               cfg_.rmsnorm() ? Tensor() : params_->compute_param("lnf.bias"));
  gather_rows(phase, a.lnf);
  phase("lm-head-gemm-forward");
  be_.matmul_forward(a.logits, a.lnf, params_->compute_param(output_weight_name()), nullptr);
  phase("cross-entropy");  // with its TP all-reduces of the row statistics
  cross_entropy(a.losses, a.logits, a.targets, a, grad_scale);
  if (losses_out.raw() != a.losses.raw()) be_.cast(losses_out, a.losses);  // a device copy
  if (cfg_.mtp() && a.dropout.training) {  // its loss joins the gradient, logged apart
    if (!a.mtp_staged) mtp_prepare(a);
    mtp_forward(a, grad_scale);
  }
  notify(&PassObserver::after_forward, kHeadPiece);
}

double GPTModel::forward(Activations& a, float grad_scale) {
  if (embeds(a)) embed_forward(a);
  for (int l = chunk_layers(a).begin; l < chunk_layers(a).end; ++l) block_forward(l, a);
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
  be_.matmul_backward(&a.dln, dw, nullptr, a.logits, a.lnf,
                      params_->compute_param(output_weight_name()));
  const Tensor dlnf = reduce_rows(phase, a.dln, a);
  phase("layernorm-backward");
  be_.zero(a.dres);
  Tensor dlnf_w = params_->grad("lnf.weight");
  Tensor dlnf_b = cfg_.rmsnorm() ? Tensor() : params_->grad("lnf.bias");
  norm_backward(a.dres, dlnf_w, dlnf_b, dlnf, stage_output(a), params_->compute_param("lnf.weight"),
                a.lnf_mean, a.lnf_rstd);
  if (cfg_.mtp() && a.dropout.training) mtp_backward(a);  // adds the MTP chain's gradient
}

void GPTModel::recompute_for_backward(int l, Activations& a) {
  const LayerRecompute& p = plan_[static_cast<size_t>(shard_.local_index(l))];
  if (p.kind == RecomputeGranularity::Full && p.chunk_last(l)) {
    // The chunk's forward again from its kept input: every buffer of the chunk (the working set)
    // is refilled, and the kept output is rewritten with the same bits.
    NVTX_RANGE("recompute-full");
    recomputing_ = true;
    for (int k = p.chunk_begin; k < p.chunk_end; ++k) block_forward(k, a);
    recomputing_ = false;
  } else if (p.kind == RecomputeGranularity::Selective) {
    // The LayerNorm outputs (with their statistics), the attention core's output and lse, and
    // the GELU output, from the kept layer input, qkv, res1 and fc1 output: the same kernels on
    // the same inputs as the forward.
    NVTX_RANGE("recompute-selective");
    const LayerWeights& w = weights_[shard_.local_index(l)];
    LayerActivations& la = acts_of(l, a);
    PhaseSequence phase;
    phase("layernorm-forward");
    Tensor ln1 = own_rows(la.ln1, a), ln2 = own_rows(la.ln2, a);
    norm_forward(ln1, la.ln1_mean, la.ln1_rstd, layer_input(l, a), w.ln1_w, w.ln1_b);
    norm_forward(ln2, la.ln2_mean, la.ln2_rstd, la.res1, w.ln2_w, w.ln2_b);
    gather_rows(phase, la.ln1);  // the gathers of the forward again (sequence parallelism)
    gather_rows(phase, la.ln2);
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
  LayerActivations& la = acts_of(l, a);
  const Tensor& x = layer_input(l, a);
  PhaseSequence phase;
  // MLP: res2 = res1 + drop(fc2(gelu(fc1(ln2(res1))))); dres holds d res2 and becomes d res1.
  // The branch's gradient is dres through the forward's mask, gathered over TP with sequence
  // parallelism (branch_grad).
  const Tensor& dmlp = branch_grad(phase, a, hidden_dropout(l, DropoutKind::MlpOut, a));
  mlp_part(l).backward(phase, l, a, la, dmlp);
  Tensor dln = reduce_rows(phase, a.dln, a);  // column-parallel input gradient
  phase("layernorm-backward");
  norm_backward(a.dres, g.ln2_w, g.ln2_b, dln, la.res1, w.ln2_w, la.ln2_mean, la.ln2_rstd);
  // Attention: res1 = x + drop(proj(attn(qkv(ln1(x))))); dres becomes d x.
  const Tensor& dattn = branch_grad(phase, a, hidden_dropout(l, DropoutKind::AttnOut, a));
  attention_part(l).backward(phase, l, a, la, dattn);
  dln = reduce_rows(phase, a.dln, a);
  phase("layernorm-backward");
  norm_backward(a.dres, g.ln1_w, g.ln1_b, dln, x, w.ln1_w, la.ln1_mean, la.ln1_rstd);
}

void GPTModel::embed_backward(Activations& a) {
  notify(&PassObserver::before_backward, kEmbedPiece);
  Tensor dwte = params_->grad("wte");
  // d (wte[ids] + wpe): dres through the embedding dropout's mask, all rows (gathered over TP
  // with sequence parallelism): every TP rank needs every row for its vocabulary shard, and
  // computes the whole (replicated) position-embedding gradient.
  PhaseSequence phase;
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  const Tensor& demb = branch_grad(phase, a, hidden_dropout(0, DropoutKind::Embedding, a));
  phase("embedding-backward");
  be_.embedding_backward(dwte, demb.reshape({N, C}), a.ids, vocab_begin_);
  if (cfg_.learned_positions()) position_embedding_grad(demb.reshape({a.B, a.T, C}), a);
}

void GPTModel::remove_observer(PassObserver* o) {
  observers_.erase(std::remove(observers_.begin(), observers_.end(), o), observers_.end());
}

void GPTModel::backward(Activations& a) {
  auto ready = [this](int piece) {
    notify(&PassObserver::grads_ready, piece);
    notify(&PassObserver::after_backward, piece);
  };
  if (ends_in_head(a)) {
    head_backward(a);
    ready(kHeadPiece);
  }
  for (int l = chunk_layers(a).end - 1; l >= chunk_layers(a).begin; --l) {
    block_backward(l, a);
    ready(l);
  }
  if (embeds(a)) {
    embed_backward(a);
    ready(kEmbedPiece);
  }
}

}  // namespace tessera
