// gpt.cpp: GPT-2 forward and backward on one rank's shard.
#include "model/gpt.hpp"

#include <algorithm>
#include <string>

#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"
#include "core/test_hooks.hpp"

namespace tessera {

namespace {
// Absent parameters (biases without bias, LayerNorm biases with RMSNorm) stay undefined tensors.
LayerWeights layer_tensors(const ParamStore& ps, int l, bool grads, const GPTConfig& cfg,
                           const ModelShard& shard) {
  const std::string p = "layers." + std::to_string(l) + ".";
  auto get = [&](const std::string& n) {
    const std::string name = p + n;
    if (!ps.has(name)) return Tensor();
    return grads ? ps.grad(name) : ps.compute_param(name);
  };
  auto fused = [&](const char* a, const char* b) {
    if (!ps.has(p + a)) return Tensor();
    return grads ? ps.grad_fused(p + a, p + b) : ps.compute_fused(p + a, p + b);
  };
  LayerWeights w;
  w.ln1_w = get("ln1.weight");
  w.ln1_b = get("ln1.bias");
  w.qkv_w = get("attn.qkv.weight");
  w.qkv_b = get("attn.qkv.bias");
  w.proj_w = get("attn.proj.weight");
  w.proj_b = get("attn.proj.bias");
  w.ln2_w = get("ln2.weight");
  w.ln2_b = get("ln2.bias");
  w.fc1_w = get("mlp.fc1.weight");
  w.fc1_b = get("mlp.fc1.bias");
  w.fc2_w = get("mlp.fc2.weight");
  w.fc2_b = get("mlp.fc2.bias");
  w.q_down_w = get("attn.q_down.weight");  // multi-latent attention
  w.q_down_norm_w = get("attn.q_down_norm.weight");
  w.q_down_norm_b = get("attn.q_down_norm.bias");
  w.q_up_w = ps.has(p + "attn.q_up.weight") ? get("attn.q_up.weight") : get("attn.q_proj.weight");
  w.kv_down_w = get("attn.kv_down.weight");
  w.kv_down_norm_w = get("attn.kv_down_norm.weight");
  w.kv_down_norm_b = get("attn.kv_down_norm.bias");
  w.kv_up_w = get("attn.kv_up.weight");
  w.q_norm_w = get("attn.q_norm.weight");  // --qk-layernorm
  w.q_norm_b = get("attn.q_norm.bias");
  w.k_norm_w = get("attn.k_norm.weight");
  w.k_norm_b = get("attn.k_norm.bias");
  if (ps.has(p + "attn.q.weight")) {  // grouped-query attention: [q | k | v] as one GEMM
    w.qkv_w = fused("attn.q.weight", "attn.kv.weight");
    w.qkv_b = fused("attn.q.bias", "attn.kv.bias");
  }
  if (cfg.is_moe_layer(l)) {
    w.router_w = get("mlp.router.weight");
    const std::string s = "mlp.shared_expert.";  // the dense MLP's slots hold the shared expert
    w.fc1_w = get(s + "fc1.weight");
    w.fc1_b = get(s + "fc1.bias");
    w.fc2_w = get(s + "fc2.weight");
    w.fc2_b = get(s + "fc2.bias");
    const int e0 = shard.experts_begin(cfg.num_experts);
    for (int e = e0; e < e0 + shard.experts_local(cfg.num_experts); ++e) {
      const std::string x = "mlp.experts." + std::to_string(e) + ".";
      w.experts.push_back(
          {get(x + "fc1.weight"), get(x + "fc1.bias"), get(x + "fc2.weight"), get(x + "fc2.bias")});
    }
  }
  return w;
}

}  // namespace

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
  if (cfg_.moe()) {
    TESSERA_CHECK(cfg_.num_experts % shard.ep_size == 0, "--num-experts=", cfg_.num_experts,
                  " does not divide over the expert-parallel size ", shard.ep_size);
    TESSERA_CHECK(cfg_.moe_ffn() % shard.tp_size == 0 &&
                      cfg_.moe_shared_expert_intermediate_size % shard.tp_size == 0,
                  "the expert widths must divide by the tensor-parallel size");
    TESSERA_CHECK(shard.tp_size == 1 || cfg_.seq_length % shard.tp_size == 0,
                  "MoE with tensor parallelism needs --seq-length divisible by the "
                  "tensor-parallel size (each TP rank routes its share of the tokens)");
    routing_.experts = cfg_.num_experts;
    routing_.topk = cfg_.moe_router_topk;
    routing_.sigmoid = cfg_.moe_router_score_function == "sigmoid";
    routing_.pre_softmax = cfg_.moe_router_pre_softmax;
    routing_.scaling = cfg_.moe_router_topk_scaling_factor;
    routing_.capacity_factor = cfg_.moe_expert_capacity_factor;
    routing_.drop_by_position = cfg_.moe_token_drop_policy == "position";
    routing_.groups = cfg_.moe_router_num_groups;
    routing_.group_topk = cfg_.moe_router_group_topk;
    routing_.group_score = cfg_.moe_router_num_groups > 0 ? cfg_.moe_group_score_experts() : 0;
    test_logit_bias_ = test_hooks::moe_logit_bias(cfg_.num_experts);  // testing: edge cases
    fault_wrong_rank_ = test_hooks::moe_dispatch_wrong_rank();        // testing: a mutation
    fault_bias_in_weights_ = test_hooks::router_bias_in_weights();    // testing: mutations
    fault_no_group_limit_ = test_hooks::router_no_group_limit();
  }
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
    if (cfg_.is_moe_layer(l) && cfg_.moe_router_enable_expert_bias)  // starts at zero
      expert_bias_[static_cast<size_t>(shard_.local_index(l))].assign(
          static_cast<size_t>(cfg_.num_experts), 0.f);
  for (int l : shard_.layers()) {
    weights_.push_back(layer_tensors(*params_, l, false, cfg_, shard_));
    grads_.push_back(layer_tensors(*params_, l, true, cfg_, shard_));
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
  if (compute_ != DType::F32) be_.zero(params_->flat_compute());
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
  std::vector<std::vector<int>> out;
  for (const ParamSpec& s : params_->specs()) {
    std::vector<int> pieces;
    if (s.name == "wte") {
      if (shard_.has_head) pieces.push_back(kHeadPiece);
      if (shard_.has_embedding) pieces.push_back(kEmbedPiece);
    } else if (s.name == "wpe") {
      pieces.push_back(kEmbedPiece);
    } else if (s.name.rfind("lnf.", 0) == 0 || s.name == "lm_head" ||
               s.name.rfind("mtp.", 0) == 0) {
      pieces.push_back(kHeadPiece);
    } else {  // "layers.<l>.…" (multi-token prediction's layers run in the head piece)
      const int l = std::stoi(s.name.substr(7, s.name.find('.', 7) - 7));
      pieces.push_back(shard_.is_mtp_layer(l) ? kHeadPiece : l);
    }
    out.push_back(std::move(pieces));
  }
  return out;
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
  TESSERA_PHASE("zero-grads");
  be_.zero(params_->flat_grads());
}

namespace {

// A rank's activation dimensions and the allocation of each group of its activation buffers.
struct SlotBuilder {
  SlotBuilder(const GPTConfig& config, const ModelShard& model_shard, int batch, int seq,
              DType dtype, Allocator& alloc)
      : cfg(config), shard(model_shard), B(batch), T(seq), compute(dtype), al(alloc) {
    for (int l : shard.layers()) {
      fl_max = std::max(fl_max, width(l));
      any_moe |= cfg.is_moe_layer(l);
    }
  }

  const GPTConfig& cfg;
  const ModelShard& shard;
  const int B, T;
  const DType compute;
  Allocator& al;
  const int64_t N = int64_t(B) * T, C = cfg.hidden_size;
  // Sequence parallelism: the LayerNorm/dropout/residual tensors (and the LayerNorm statistics)
  // hold this rank's Nl of the N token rows; the LayerNorm outputs stay whole (gathered for the
  // GEMMs that read them).
  const bool sp = shard.sequence_parallel && shard.tp_size > 1;
  const int64_t Nl = sp ? N / shard.tp_size : N;
  const int64_t heads_l = cfg.num_attention_heads / shard.tp_size;
  const int64_t hl = heads_l * cfg.head_dim();
  // qkv holds the rank's query heads and its key and value groups; fc1 SwiGLU's gate and up.
  const int64_t qkvl = hl + 2 * (cfg.kv_heads() / shard.tp_size) * cfg.head_dim();
  const int64_t vl = cfg.padded_vocab_size(shard.tp_size) / shard.tp_size;
  const int glu = cfg.swiglu ? 2 : 1;
  // MoE: N*K token copies leave a rank; its experts receive R rows: the same ones without expert
  // parallelism, else at most N*min(K, local experts) from each of the EP ranks.
  const int64_t E = cfg.num_experts, K = cfg.moe_router_topk, NK = N * K;
  const int ep = shard.ep_size;
  const int64_t R = (ep > 1) ? ep * N * std::min<int64_t>(K, E / ep) : NK;
  const bool allgather = ep > 1 && cfg.moe_token_dispatcher_type == "allgather";
  const int64_t efl = cfg.moe() ? cfg.moe_ffn() / shard.tp_size : 0;
  int64_t fl_max = 0;  // the widest MLP of this rank's layers
  bool any_moe = false;

  // The MLP of layer l: the width of its dense MLP (the shared expert's in a MoE layer, 0 without
  // one) on this rank, and whether it is MoE. MoE layers permute R = N*K token copies.
  int64_t width(int l) const {
    return (cfg.is_moe_layer(l) ? cfg.moe_shared_expert_intermediate_size : cfg.ffn()) /
           shard.tp_size;
  }
  Tensor f(Shape s) const { return Tensor(std::move(s), compute, al); }       // activations
  Tensor f32(Shape s) const { return Tensor(std::move(s), DType::F32, al); }  // statistics
  Tensor i32(Shape s) const { return Tensor(std::move(s), DType::I32, al); }
  // A residual-stream tensor: (B,T,C), or this rank's (Nl,C) rows under sequence parallelism.
  Tensor res() const { return sp ? f({Nl, C}) : f({B, T, C}); }
  // The first LayerNorm's output and statistics.
  void ln1(LayerActivations& la) const {
    la.ln1 = f({N, C});
    if (!cfg.rmsnorm()) la.ln1_mean = f32({Nl});  // RMSNorm keeps no mean
    la.ln1_rstd = f32({Nl});
  }
  // The recomputable MLP tensors for an MLP of width fl (and MoE's when moe).
  void ln2_gelu(LayerActivations& la, int64_t fl, bool moe) const {
    la.ln2 = f({N, C});
    if (!cfg.rmsnorm()) la.ln2_mean = f32({Nl});
    la.ln2_rstd = f32({Nl});
    if (fl > 0) la.gelu = f({N, fl});
    if (moe) {
      la.moe_x = f({NK, C});
      la.moe_act = f({R, efl});
    }
  }
  // The attention core's output and statistics.
  void core(LayerActivations& la) const {
    la.att = f({B, T, hl});
    la.lse = f32({B, heads_l, T});
    if (cfg.mla()) la.mla.att_v = f({N, heads_l * cfg.v_head_dim});
  }
  // MLA's latents (kept with the GEMM outputs).
  void mla_kept(LayerActivations& la) const {
    const int64_t qr = cfg.q_lora_rank, kvr = cfg.kv_lora_rank;
    MlaTensors& m = la.mla;
    if (qr > 0) {
      m.q_lat = f({N, qr});
      m.q_lat_n = cfg.qk_layernorm ? f({N, qr}) : m.q_lat;
      if (cfg.qk_layernorm) {
        if (!cfg.rmsnorm()) m.q_mean = f32({N});
        m.q_rstd = f32({N});
      }
    }
    m.c = f({N, kvr});
    m.c_n = cfg.qk_layernorm ? f({N, kvr}) : m.c;
    m.k_pe = f({N, cfg.qk_pos_emb_head_dim});
    if (cfg.qk_layernorm) {
      if (!cfg.rmsnorm()) m.c_mean = f32({N});
      m.c_rstd = f32({N});
    }
  }
  // What selective recomputation keeps.
  void kept(LayerActivations& la, bool res2, int64_t fl, bool moe) const {
    la.qkv = f({B, T, qkvl});
    if (cfg.mla()) mla_kept(la);
    if (cfg.qk_layernorm && !cfg.mla()) {  // the q/k heads before their norms, and statistics
      const int64_t kv_l = cfg.kv_heads() / shard.tp_size;
      la.qk.q_raw = f({N, hl});
      la.qk.k_raw = f({N, kv_l * cfg.head_dim()});
      la.qk.q_rstd = f32({N * heads_l});
      la.qk.k_rstd = f32({N * kv_l});
      if (!cfg.rmsnorm()) {
        la.qk.q_mean = f32({N * heads_l});
        la.qk.k_mean = f32({N * kv_l});
      }
    }
    la.res1 = res();
    if (fl > 0) la.fc1 = f({N, glu * fl});
    if (res2) la.res2 = res();
    if (moe) {
      la.moe_logits = f32({N, E});
      la.moe_expert = i32({N, K});
      la.moe_row = i32({N, K});
      la.moe_weight = f32({N, K});
      la.moe_fc1 = f({R, glu * efl});
      la.moe_out = f({NK, C});
      if (ep > 1) la.moe_xe = f({R, C});
      if (allgather) {
        la.moe_ag_weight = f32({ep * N, K});
        la.moe_ag_row = i32({ep * N, K});
        la.moe_oute = f({R, C});
      }
    }
  }
  // Without expert parallelism the expert side is the token side.
  void expert_side(LayerActivations& la) const {
    if (ep == 1 && la.moe_x.defined()) la.moe_xe = la.moe_x;
  }
  // A set allocated for the widest layer, cut to layer l's MLP (views of the same buffers).
  LayerActivations fit(LayerActivations la, int l) const {
    const int64_t fl = width(l);
    la.gelu = fl > 0 && la.gelu.defined() ? la.gelu.view(0, {N, fl}) : Tensor();
    la.fc1 = fl > 0 && la.fc1.defined() ? la.fc1.view(0, {N, glu * fl}) : Tensor();
    if (!cfg.is_moe_layer(l)) {
      for (Tensor* t : {&la.moe_x, &la.moe_xe, &la.moe_act, &la.moe_logits, &la.moe_expert,
                        &la.moe_row, &la.moe_weight, &la.moe_fc1, &la.moe_out, &la.moe_ag_weight,
                        &la.moe_ag_row, &la.moe_oute})
        *t = Tensor();
    }
    return la;
  }
  // Shared: the scratch of the passes, then the recompute working set.
  Activations shared_buffers() const {
    Activations shared;
    shared.tmp_c = f({N, C});
    shared.dln = f({N, C});
    shared.dqkv = f({B, T, qkvl});
    shared.datt = f({B, T, hl});
    if (cfg.qk_layernorm && !cfg.mla()) shared.qk_tmp = f({N, hl});
    if (cfg.mla()) {
      const int64_t dr = cfg.qk_pos_emb_head_dim;
      shared.mla_q = f({N, hl});
      shared.mla_kv = f({N, heads_l * (cfg.qk_head_dim + cfg.v_head_dim)});
      if (cfg.q_lora_rank > 0) {
        shared.mla_dq_n = f({N, cfg.q_lora_rank});
        shared.mla_dq_lat = f({N, cfg.q_lora_rank});
      }
      shared.mla_dc_n = f({N, cfg.kv_lora_rank});
      shared.mla_dc = f({N, cfg.kv_lora_rank});
      shared.mla_dk_pe = f({N, dr});
      shared.mla_tmp_pe = f({N, dr});
      shared.mla_dln = f({N, C});
      shared.datt_v = f({N, heads_l * cfg.v_head_dim});
    }
    if (fl_max > 0) shared.dfc = f({N, fl_max});
    if (cfg.swiglu && fl_max > 0) shared.dfc1 = f({N, glu * fl_max});
    if (any_moe) {
      shared.moe_dout = f({NK, C});
      if (ep > 1) {
        if (!allgather) shared.moe_oute = f({R, C});
        shared.moe_doute = f({R, C});
      }
      if (allgather) {
        shared.moe_ag_x = f({ep * N, C});
        shared.moe_ag_y = f({ep * N, C});
        shared.moe_ag_logits = f32({ep * N, E});
        shared.moe_ag_expert = i32({ep * N, K});
        shared.moe_ag_dweight = f32({ep * N, K});
      }
      shared.moe_dact = f({R, efl});
      if (cfg.swiglu) shared.moe_dfc1 = f({R, glu * efl});
      shared.moe_dweight = f32({N, K});
      shared.moe_dlogits = f32({N, E});
      shared.moe_dx = f({N, C});
      shared.moe_tmp = f({N, C});
      if (compute != DType::F32) shared.moe_logits_c = f({N, E});
    }
    if (shard.cp_size > 1) {  // context parallelism's ring (model/context_parallel.cpp)
      const int64_t kvl = qkvl - hl;
      for (int i = 0; i < 2; ++i) {
        shared.cp_kv[i] = f({B, T, kvl});
        shared.cp_dkv[i] = f({B, T, kvl});
      }
      shared.cp_dkv_mine = f({B, T, kvl});
      shared.cp_out = f({B, T, hl});
      shared.cp_lse = f32({B, heads_l, T});
      if (cfg.rope()) shared.cp_positions = i32({N});
      if (cfg.learned_positions() && shard.has_embedding) {
        shared.cp_wpe = f({T, C});
        shared.cp_dwpe = f32({T, C});
      }
    }
    return shared;
  }
  // Multi-token prediction's depths: each layer keeps everything (no recomputation), and its
  // embedding, norms, projection, final norm, logits and losses; the scratch once per slot set.
  void mtp_buffers(Activations& a, Activations& shared) const {
    if (shard.mtp_count == 0) return;
    for (int k = 0; k < shard.mtp_count; ++k) {
      const int l = shard.mtp_begin + k;
      const bool moe = cfg.is_moe_layer(l);
      LayerActivations la;
      ln1(la);
      ln2_gelu(la, width(l), moe);
      core(la);
      kept(la, true, width(l), moe);
      expert_side(la);
      a.layers.push_back(std::move(la));
      MtpActivations m;
      m.ids = i32({B, T});
      m.targets = i32({B, T});
      m.emb = res();
      m.e_n = res();
      m.h_n = res();
      if (!cfg.rmsnorm()) m.e_mean = f32({Nl}), m.h_mean = f32({Nl}), m.lnf_mean = f32({Nl});
      m.e_rstd = f32({Nl});
      m.h_rstd = f32({Nl});
      m.cat = f({Nl, 2 * C});
      m.x = res();
      m.lnf = f({N, C});
      m.lnf_rstd = f32({Nl});
      m.logits = f({N, vl});
      m.losses = f32({N});
      a.mtp.push_back(std::move(m));
    }
    if (!shared.mtp_dmain.defined()) {
      shared.mtp_dmain = res();
      shared.mtp_dh = res();
      shared.mtp_demb = f({N, C});
      shared.mtp_dcat = f({Nl, 2 * C});
      shared.mtp_de = f({Nl, C});
      shared.mtp_dhn = f({Nl, C});
    }
    a.mtp_dmain = shared.mtp_dmain;
    a.mtp_dh = shared.mtp_dh;
    a.mtp_demb = shared.mtp_demb;
    a.mtp_dcat = shared.mtp_dcat;
    a.mtp_de = shared.mtp_de;
    a.mtp_dhn = shared.mtp_dhn;
  }
  // The head's buffers: the final LayerNorm, the logits and the loss statistics.
  void head_buffers(Activations& a) const {
    a.lnf = f({N, C});
    if (!cfg.rmsnorm()) a.lnf_mean = f32({Nl});
    a.lnf_rstd = f32({Nl});
    a.logits = f({N, vl});
    a.losses = f32({N});
    a.rowmax = f32({N});
    a.sumexp = f32({N});
    a.target_logit = f32({N});
  }
};

// Builds the activation buffers of `count` micro-batch slots on `al`: the shared scratch and
// recompute working set first, then each slot's own buffers. The one place that decides what is
// allocated, for the model (make_activation_slots) and the estimate (activation_footprint).
std::vector<Activations> build_activation_slots(const GPTConfig& cfg, const ModelShard& shard,
                                                const std::vector<LayerRecompute>& plan, int B,
                                                int T, DType compute, Allocator& al,
                                                const std::vector<int>& counts) {
  const SlotBuilder sb(cfg, shard, B, T, compute, al);
  Activations shared = sb.shared_buffers();
  size_t max_chunk = 0;
  bool selective = false;
  for (const LayerRecompute& p : plan) {
    if (p.kind == RecomputeGranularity::Full)
      max_chunk = std::max(max_chunk, static_cast<size_t>(p.chunk_end - p.chunk_begin));
    selective |= p.kind == RecomputeGranularity::Selective;
  }
  // Full: position j of a chunk uses work[j]; the output of a chunk's last layer is the next
  // chunk's input and is kept per micro-batch, so the last position needs no res2 here.
  std::vector<LayerActivations> work(max_chunk);
  for (size_t j = 0; j < max_chunk; ++j) {
    sb.ln1(work[j]);
    sb.ln2_gelu(work[j], sb.fl_max, sb.any_moe);
    sb.core(work[j]);
    sb.kept(work[j], j + 1 < max_chunk, sb.fl_max, sb.any_moe);
  }
  LayerActivations sel;  // selective: one set, refilled before each layer's backward
  if (selective) {
    sb.ln1(sel);
    sb.ln2_gelu(sel, sb.fl_max, sb.any_moe);
    sb.core(sel);
  }
  std::vector<Activations> slots;
  TESSERA_CHECK(static_cast<int>(counts.size()) == shard.num_chunks(),
                "activation slots: one count per model chunk");
  for (int c = 0; c < shard.num_chunks(); ++c)
    for (int k = 0; k < counts[c]; ++k) {
      Activations a = shared;
      a.B = B;
      a.T = T;
      a.chunk = c;
      const LayerRange& chunk = shard.chunks[c];
      a.ids = Tensor({B, T}, DType::I32, al);
      a.targets = Tensor({B, T}, DType::I32, al);
      a.input = sb.res();
      a.dres = sb.res();
      for (int l = chunk.begin; l < chunk.end; ++l) {
        const LayerRecompute& p = plan[static_cast<size_t>(shard.local_index(l))];
        const bool moe = cfg.is_moe_layer(l);
        LayerActivations la;
        switch (p.kind) {
          case RecomputeGranularity::None:
            sb.ln1(la);
            sb.ln2_gelu(la, sb.width(l), moe);
            sb.core(la);
            sb.kept(la, true, sb.width(l), moe);
            break;
          case RecomputeGranularity::Selective:
            la = sb.fit(sel, l);
            sb.kept(la, true, sb.width(l), moe);
            break;
          case RecomputeGranularity::Full:
            la = sb.fit(work[static_cast<size_t>(l - p.chunk_begin)], l);
            if (p.chunk_last(l)) la.res2 = sb.res();
            break;
        }
        sb.expert_side(la);
        a.layers.push_back(std::move(la));
      }
      if (shard.has_head && c == shard.num_chunks() - 1) {
        sb.head_buffers(a);
        sb.mtp_buffers(a, shared);  // multi-token prediction's layers (kept whole) and tensors
      }
      slots.push_back(std::move(a));
    }
  return slots;
}

// Hands out no memory; counts the bytes asked for.
class CountingAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    bytes_ += static_cast<double>(bytes);
    return &dummy_;
  }
  void deallocate(void*, size_t) override {}
  Device device() const override { return Device::CPU; }
  double bytes() const { return bytes_; }

 private:
  double bytes_ = 0;
  char dummy_ = 0;
};

}  // namespace

double activation_bytes(const GPTConfig& cfg, const ModelShard& shard, const RecomputeConfig& rc,
                        int B, int T, DType compute, const std::vector<int>& counts) {
  CountingAllocator al;
  build_activation_slots(cfg, shard, plan_recompute(rc, shard), B, T, compute, al, counts);
  return al.bytes();
}

ActivationFootprint activation_footprint(const GPTConfig& cfg, const ModelShard& shard,
                                         const RecomputeConfig& rc, int B, int T, DType compute) {
  const int V = shard.num_chunks();
  const double one = activation_bytes(cfg, shard, rc, B, T, compute, std::vector<int>(V, 1));
  const double two = activation_bytes(cfg, shard, rc, B, T, compute, std::vector<int>(V, 2));
  ActivationFootprint fp;
  fp.per_micro_batch = two - one;
  fp.shared = one - fp.per_micro_batch;
  return fp;
}

ActivationFootprint GPTModel::activation_footprint(int B, int T) const {
  return tessera::activation_footprint(cfg_, shard_, recompute_, B, T, compute_);
}

std::vector<Activations> GPTModel::make_activation_slots(int B, int T, int count) const {
  return make_activation_slots(B, T, std::vector<int>(shard_.num_chunks(), count));
}

std::vector<Activations> GPTModel::make_activation_slots(int B, int T,
                                                         const std::vector<int>& counts) const {
  TESSERA_CHECK(T <= cfg_.max_positions(), "sequence of ", T, " tokens exceeds the ",
                cfg_.max_positions(), " positions of the model");
  int count = 0;
  for (int c : counts) count += c;
  AllocationLabel label(
      count == 1 ? detail::concat("the activations of one micro-batch (", B, " x ", T, " tokens)")
                 : detail::concat("the activations of ", count, " micro-batches in flight (", B,
                                  " x ", T, " tokens each)"));
  std::vector<Activations> slots =
      build_activation_slots(cfg_, shard_, plan_, B, T, compute_, be_.allocator(), counts);
  if (!slots.empty() && slots[0].cp_positions.defined()) {  // shared by every slot
    TESSERA_CHECK(T % 2 == 0, "context parallelism: ", T, " tokens per rank is odd");
    std::vector<int32_t> pos(static_cast<size_t>(B) * T);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        pos[static_cast<size_t>(b) * T + t] =
            static_cast<int32_t>(cp_position(shard_.cp_rank, shard_.cp_size, T / 2, t));
    be_.copy_from_host(slots[0].cp_positions, pos.data());
  }
  return slots;
}

LayerActivations& GPTModel::acts_of(int layer, Activations& a) const {
  return a.layers[layer - shard_.chunks[a.chunk].begin];
}

int64_t GPTModel::dropout_row_begin(const Activations& a) const {
  // Testing (the layout-equivalence test's mutation check): TESSERA_FAULT_DROPOUT_KEY.
  return test_hooks::dropout_ignore_tp_offset() ? 0 : row_begin(a);
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
  if (piece >= 0 && cfg_.is_moe_layer(piece) && tp_.size() > 1) {
    // Each TP rank routed its share of the tokens: the router's gradient is a partial sum.
    TESSERA_PHASE("moe-router-grad-all-reduce");
    tp_.all_reduce(grads_[shard_.local_index(piece)].router_w, ReduceOp::Sum);
  }
  if (piece >= 0 && (cfg_.qk_layernorm || cfg_.mla()) && tp_.size() > 1) {
    // Each TP rank normalized its own heads (--qk-layernorm), or (MLA) back-propagated its own
    // heads into the replicated latents: those parameters' gradients are partial sums.
    TESSERA_PHASE("qk-norm-grad-all-reduce");
    LayerWeights& g = grads_[shard_.local_index(piece)];
    for (Tensor* t :
         {&g.q_norm_w, &g.q_norm_b, &g.k_norm_w, &g.k_norm_b, &g.q_down_w, &g.q_down_norm_w,
          &g.q_down_norm_b, &g.kv_down_w, &g.kv_down_norm_w, &g.kv_down_norm_b})
      if (t->defined()) tp_.all_reduce(*t, ReduceOp::Sum);
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

Tensor& GPTModel::activation_backward(PhaseSequence& phase, Tensor& dact, Tensor& dfc1_swiglu,
                                      const Tensor& fc1) {
  if (cfg_.swiglu) {
    phase("swiglu-backward");
    be_.swiglu_backward(dfc1_swiglu, fc1, dact);
    return dfc1_swiglu;
  }
  if (cfg_.squared_relu) {
    phase("squared-relu-backward");
    be_.squared_relu_backward(dact, fc1, dact);
  } else {
    phase("gelu-backward");
    be_.gelu_backward(dact, fc1, dact);
  }
  return dact;
}

void GPTModel::activation_forward(PhaseSequence& phase, LayerActivations& la) {
  phase(cfg_.swiglu         ? "swiglu-forward"
        : cfg_.squared_relu ? "squared-relu-forward"
                            : "gelu-forward");
  mlp_activation(la.gelu, la.fc1);
}

void GPTModel::mlp_activation(Tensor& out, const Tensor& fc1) {
  if (cfg_.swiglu)
    be_.swiglu_forward(out, fc1);
  else if (cfg_.squared_relu)
    be_.squared_relu_forward(out, fc1);
  else
    be_.gelu_forward(out, fc1);
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

void GPTModel::qk_norm_forward(Tensor& qkv, const LayerWeights& w, QkNormTensors& keep,
                               Tensor& tmp) {
  const int64_t hd = cfg_.head_dim(), width = qkv.dim(qkv.ndim() - 1), n = qkv.numel() / width;
  Tensor rows = qkv.reshape({n, width});
  // The query heads at columns [0, Hl*hd), the key heads after them: each copied out whole (the
  // heads before the norm, for the backward), normalized per head into tmp, and copied back.
  // `keep` may hold more rows than qkv (generation's buffers): the first n are used.
  auto one = [&](int64_t col, int64_t heads, const Tensor& raw_all, const Tensor& mean_all,
                 const Tensor& rstd_all, const Tensor& nw, const Tensor& nb) {
    Tensor raw = raw_all.view(0, {n, heads * hd}), rstd = rstd_all.view(0, {n * heads});
    Tensor mean = mean_all.defined() ? mean_all.view(0, {n * heads}) : Tensor();
    be_.copy_columns(raw, 0, rows, col, heads * hd);
    Tensor out = tmp.view(0, {n * heads, hd});
    norm_forward(out, mean, rstd, raw.reshape({n * heads, hd}), nw, nb);
    be_.copy_columns(rows, col, tmp.view(0, {n, heads * hd}), 0, heads * hd);
  };
  one(0, heads_local_, keep.q_raw, keep.q_mean, keep.q_rstd, w.q_norm_w, w.q_norm_b);
  one(heads_local_ * hd, kv_heads_local_, keep.k_raw, keep.k_mean, keep.k_rstd, w.k_norm_w,
      w.k_norm_b);
}

void GPTModel::qk_norm_backward(Tensor& dqkv, LayerWeights& g, const LayerWeights& w,
                                const QkNormTensors& keep, Tensor& tmp, Tensor& tmp2) {
  const int64_t hd = cfg_.head_dim(), width = dqkv.dim(dqkv.ndim() - 1), n = dqkv.numel() / width;
  Tensor rows = dqkv.reshape({n, width});
  auto one = [&](int64_t col, int64_t heads, const Tensor& raw, const Tensor& mean,
                 const Tensor& rstd, const Tensor& nw, Tensor& dw, Tensor& db) {
    Tensor dy = tmp.view(0, {n, heads * hd}), dx = tmp2.view(0, {n, heads * hd});
    be_.copy_columns(dy, 0, rows, col, heads * hd);
    be_.zero(dx);  // the norm's backward accumulates
    Tensor dx_heads = dx.reshape({n * heads, hd});
    norm_backward(dx_heads, dw, db, dy.reshape({n * heads, hd}), raw.reshape({n * heads, hd}), nw,
                  mean, rstd);
    be_.copy_columns(rows, col, dx, 0, heads * hd);
  };
  one(0, heads_local_, keep.q_raw, keep.q_mean, keep.q_rstd, w.q_norm_w, g.q_norm_w, g.q_norm_b);
  one(heads_local_ * hd, kv_heads_local_, keep.k_raw, keep.k_mean, keep.k_rstd, w.k_norm_w,
      g.k_norm_w, g.k_norm_b);
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
  if (before_forward) before_forward(kEmbedPiece);
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
}

void GPTModel::block_forward(int l, Activations& a) {
  if (before_forward && !shard_.is_mtp_layer(l)) before_forward(l);  // MTP's: the head piece's
  const int li = shard_.local_index(l);
  TESSERA_CHECK(li >= 0 && shard_.chunk_of(l) == a.chunk, "layer ", l,
                " is not in the activations' model chunk");
  NvtxRange range(range_names_[2 * li].c_str());
  const LayerWeights& w = weights_[li];
  LayerActivations& la = acts_of(l, a);
  const Tensor& x = layer_input(l, a);
  const bool bias_here = shard_.tp_rank == 0;  // row-parallel bias: added once across the group
  PhaseSequence phase;
  phase("layernorm-forward");
  Tensor ln1 = own_rows(la.ln1, a);
  norm_forward(ln1, la.ln1_mean, la.ln1_rstd, x, w.ln1_w, w.ln1_b);
  gather_rows(phase, la.ln1);
  phase("qkv-gemm-forward");
  if (cfg_.mla())
    mla_qkv_forward(la.qkv, la.ln1, w, la.mla, a.mla_q, a.mla_kv);
  else
    linear_forward(l, Fp8Gemm::Qkv, la.qkv, la.ln1, w.qkv_w, opt(w.qkv_b), a);
  if (cfg_.qk_layernorm && !cfg_.mla()) {
    phase("qk-norm-forward");
    qk_norm_forward(la.qkv, w, la.qk, a.qk_tmp);
  }
  if (cfg_.rope()) {
    phase("rope");
    be_.rope(la.qkv, rope_spec(a.T), rope_positions(a), false);
  }
  phase("attention-core-forward");
  attention_core_forward(l, a, la);
  if (cfg_.mla()) mla_values(la.mla.att_v, la.att);
  phase("proj-gemm-forward");
  linear_forward(l, Fp8Gemm::Proj, a.tmp_c, cfg_.mla() ? la.mla.att_v : la.att, w.proj_w,
                 bias_here ? opt(w.proj_b) : nullptr, a);
  Tensor branch = reduce_rows(phase, a.tmp_c, a);
  if (const DropoutSpec d = hidden_dropout(l, DropoutKind::AttnOut, a); d.active()) {
    phase("dropout");
    apply_hidden_dropout(branch, branch, d, a);
  }
  phase("layernorm-forward");  // fused with the residual add
  Tensor ln2 = own_rows(la.ln2, a);
  add_norm_forward(la.res1, ln2, la.ln2_mean, la.ln2_rstd, x, branch, w.ln2_w, w.ln2_b);
  gather_rows(phase, la.ln2);
  if (cfg_.is_moe_layer(l)) {
    moe_forward(phase, l, a, a.tmp_c);
  } else {
    phase("fc1-gemm-forward");
    linear_forward(l, Fp8Gemm::Fc1, la.fc1, la.ln2, w.fc1_w, opt(w.fc1_b), a);
    activation_forward(phase, la);
    phase("fc2-gemm-forward");
    linear_forward(l, Fp8Gemm::Fc2, a.tmp_c, la.gelu, w.fc2_w, bias_here ? opt(w.fc2_b) : nullptr,
                   a);
  }
  branch = reduce_rows(phase, a.tmp_c, a);
  if (const DropoutSpec d = hidden_dropout(l, DropoutKind::MlpOut, a); d.active()) {
    phase("dropout");
    apply_hidden_dropout(branch, branch, d, a);
  }
  phase("residual-add");
  be_.add(la.res2, la.res1, branch);
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

void GPTModel::fp8_end_step(Communicator* grad_group) {
  if (fp8_) fp8_->end_step(grad_group);
}

void GPTModel::fp8_restart_step() {
  if (fp8_) fp8_->restart_step();
}

void GPTModel::tp_reduce(PhaseSequence& phase, Tensor& t) {
  if (tp_.size() > 1) phase("tp-all-reduce");  // TP 1: a no-op, no phase
  tp_.all_reduce(t, ReduceOp::Sum);
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
  if (before_forward) before_forward(kHeadPiece);
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
  be_.xent_row_max(a.rowmax, a.logits, valid_cols_);
  tp_.all_reduce(a.rowmax, ReduceOp::Max);
  be_.xent_row_sums(a.sumexp, a.target_logit, a.logits, a.rowmax, a.targets, valid_cols_,
                    vocab_begin_);
  tp_.all_reduce(a.sumexp, ReduceOp::Sum);
  tp_.all_reduce(a.target_logit, ReduceOp::Sum);
  be_.xent_loss_and_grad(a.losses, a.logits, a.rowmax, a.sumexp, a.target_logit, a.targets,
                         valid_cols_, vocab_begin_, grad_scale);
  if (losses_out.raw() != a.losses.raw()) be_.cast(losses_out, a.losses);  // a device copy
  if (cfg_.mtp() && a.dropout.training) {  // its loss joins the gradient, logged apart
    if (!a.mtp_staged) mtp_prepare(a);
    mtp_forward(a, grad_scale);
  }
}

double GPTModel::forward(Activations& a, float grad_scale) {
  if (embeds(a)) embed_forward(a);
  for (int l = chunk_layers(a).begin; l < chunk_layers(a).end; ++l) block_forward(l, a);
  return ends_in_head(a) ? head_forward(a, grad_scale) : 0.0;
}

// ---------------------------------------------------------------------------------------------
// backward

void GPTModel::head_backward(Activations& a) {
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
    phase("attention-core-forward");  // qkv was kept with RoPE applied
    attention_core_forward(l, a, la);
    if (cfg_.mla()) mla_values(la.mla.att_v, la.att);
    if (la.gelu.defined()) activation_forward(phase, la);
    if (cfg_.is_moe_layer(l)) {   // the experts' inputs and activations from the kept routing
      if (shard_.ep_size == 1) {  // else the received rows were kept
        phase("moe-permute");
        be_.moe_permute(la.moe_x, la.ln2, la.moe_row);
      }
      const int64_t R = la.moe_act.dim(0), efl = la.moe_act.dim(1);
      int64_t row = 0;
      for (int64_t rows : la.moe_rows) {
        if (rows > 0) {
          Tensor act = la.moe_act.view(row * efl, {rows, efl});
          mlp_activation(act, la.moe_fc1.view(row * la.moe_fc1.dim(1), {rows, la.moe_fc1.dim(1)}));
        }
        row += rows;
      }
      TESSERA_CHECK(row <= R, "MoE rows");
    }
  }
}

void GPTModel::block_backward(int l, Activations& a) {
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
  if (cfg_.is_moe_layer(l)) {
    moe_backward(phase, l, a, dmlp);
  } else {
    phase("fc2-gemm-backward");
    const bool gelu = !cfg_.swiglu && !cfg_.squared_relu;
    if (gelu &&
        !fp8_layer(l)) {  // GELU's backward in the GEMM's epilogue where the backend has one
      be_.matmul_gelu_backward(a.dfc, g.fc2_w, opt(g.fc2_b), dmlp, la.gelu, w.fc2_w, la.fc1);
    } else {
      linear_backward(l, Fp8Gemm::Fc2, &a.dfc, g.fc2_w, opt(g.fc2_b), dmlp, la.gelu, w.fc2_w);
      if (gelu) be_.gelu_backward(a.dfc, la.fc1, a.dfc);
    }
    const Tensor& dfc1 = gelu ? a.dfc : activation_backward(phase, a.dfc, a.dfc1, la.fc1);
    phase("fc1-gemm-backward");
    linear_backward(l, Fp8Gemm::Fc1, &a.dln, g.fc1_w, opt(g.fc1_b), dfc1, la.ln2, w.fc1_w);
  }
  Tensor dln = reduce_rows(phase, a.dln, a);  // column-parallel input gradient
  phase("layernorm-backward");
  norm_backward(a.dres, g.ln2_w, g.ln2_b, dln, la.res1, w.ln2_w, la.ln2_mean, la.ln2_rstd);
  // Attention: res1 = x + drop(proj(attn(qkv(ln1(x))))); dres becomes d x.
  const Tensor& dattn = branch_grad(phase, a, hidden_dropout(l, DropoutKind::AttnOut, a));
  phase("proj-gemm-backward");
  if (cfg_.mla()) {
    linear_backward(l, Fp8Gemm::Proj, &a.datt_v, g.proj_w, opt(g.proj_b), dattn, la.mla.att_v,
                    w.proj_w);
    mla_expand(a.datt, a.datt_v);
  } else {
    linear_backward(l, Fp8Gemm::Proj, &a.datt, g.proj_w, opt(g.proj_b), dattn, la.att, w.proj_w);
  }
  phase("attention-core-backward");
  attention_core_backward(l, a, la);
  if (cfg_.rope()) {  // the rotation's transpose: rotate the gradient back
    phase("rope");
    be_.rope(a.dqkv, rope_spec(a.T), rope_positions(a), true);
  }
  if (cfg_.qk_layernorm && !cfg_.mla()) {  // datt is free once the attention core has read it
    phase("qk-norm-backward");
    qk_norm_backward(a.dqkv, g, w, la.qk, a.qk_tmp, a.datt);
  }
  phase("qkv-gemm-backward");
  if (cfg_.mla())
    mla_qkv_backward(l, a, la);
  else
    linear_backward(l, Fp8Gemm::Qkv, &a.dln, g.qkv_w, opt(g.qkv_b), a.dqkv, la.ln1, w.qkv_w);
  dln = reduce_rows(phase, a.dln, a);
  phase("layernorm-backward");
  norm_backward(a.dres, g.ln1_w, g.ln1_b, dln, x, w.ln1_w, la.ln1_mean, la.ln1_rstd);
}

void GPTModel::embed_backward(Activations& a) {
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

void GPTModel::backward(Activations& a) {
  auto ready = [this](int piece) {
    if (on_grads_ready) on_grads_ready(piece);
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
