// moe_part.cpp: the MoE layer's parameters, weights and buffers (model/moe.hpp), selective
// recomputation of the routed experts, and its forward in generation (dropless, every TP rank
// routing as rank 0 does).
#include <algorithm>

#include "core/phase_timer.hpp"
#include "model/moe.hpp"
#include "model/slots.hpp"

namespace tessera {

void MoeMlp::add_params(ParamSpecBuilder& b, int l) const {
  const std::string p = "layers." + std::to_string(l) + ".mlp.";
  b.add(p + "router.weight", {b.cfg.num_experts, b.cfg.hidden_size}, -1, ParamInit::Normal,
        b.cfg.init_method_std, true);
  const int e0 = b.shard.experts_begin(b.cfg.num_experts);
  const int local = b.shard.experts_local(b.cfg.num_experts);
  for (int e = e0; e < e0 + (b.one_expert ? std::min(local, 1) : local); ++e) {
    const size_t first = b.specs.size();
    dense_mlp_params(b, p + "experts." + std::to_string(e) + ".", b.cfg.moe_ffn(),
                     spec_.activation);
    for (size_t k = first; k < b.specs.size(); ++k) b.specs[k].expert = true;
  }
  if (spec_.dense_width > 0)
    dense_mlp_params(b, p + "shared_expert.", spec_.dense_width, spec_.activation);
}

void MoeMlp::bind(const ParamStore& ps, int l) {
  router_w_ = param(ps, l, "mlp.router.weight", false);
  router_g_ = param(ps, l, "mlp.router.weight", true);
  if (shared_) shared_->bind(ps, l);
  experts_w_.clear();
  experts_g_.clear();
  const int e0 = shard_.experts_begin(cfg_.num_experts);
  for (int e = e0; e < e0 + shard_.experts_local(cfg_.num_experts); ++e) {
    const std::string x = "mlp.experts." + std::to_string(e) + ".";
    experts_w_.push_back(dense_mlp_bind(ps, l, false, x));
    experts_g_.push_back(dense_mlp_bind(ps, l, true, x));
  }
}

void MoeMlp::reduce_tp_grads(int) {
  if (tp().size() == 1) return;
  // Each TP rank routed its share of the tokens: the router's gradient is a partial sum.
  TESSERA_PHASE("moe-router-grad-all-reduce");
  tp().all_reduce(router_g_, ReduceOp::Sum);
}

MoeMlp::Dims MoeMlp::dims(const SlotBuilder& sb) const {
  Dims d;
  d.E = cfg_.num_experts;
  d.K = cfg_.moe_router_topk;
  d.NK = sb.N * d.K;
  d.ep = shard_.ep_size;
  d.R = sb.inference ? d.NK : cfg_.moe_received_rows(sb.N, d.ep);  // generation: dropless
  d.allgather = d.ep > 1 && cfg_.moe_token_dispatcher_type == "allgather";
  d.efl = cfg_.moe_ffn() / shard_.tp_size;
  d.glu = spec_.activation == MlpActivation::SwiGLU ? 2 : 1;
  return d;
}

void MoeMlp::recomputed_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const {
  dense_mlp_buffers(sb, la, width, spec_.activation, false);
  if (la.moe_x.defined()) return;
  const Dims d = dims(sb);
  la.moe_x = sb.f({d.NK, sb.C});
  la.moe_act = sb.f({d.R, d.efl});
}

void MoeMlp::kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const {
  dense_mlp_buffers(sb, la, width, spec_.activation, true);
  if (la.moe_logits.defined()) return;
  const Dims d = dims(sb);
  const int64_t N = sb.N;
  la.moe_logits = sb.f32({N, d.E});
  la.moe_expert = sb.i32({N, d.K});
  la.moe_row = sb.i32({N, d.K});
  la.moe_weight = sb.f32({N, d.K});
  la.moe_fc1 = sb.f({d.R, d.glu * d.efl});
  la.moe_out = sb.f({d.NK, sb.C});
  if (d.ep > 1) la.moe_xe = sb.f({d.R, sb.C});
  if (d.allgather) {
    la.moe_ag_weight = sb.f32({d.ep * N, d.K});
    la.moe_ag_row = sb.i32({d.ep * N, d.K});
    la.moe_oute = sb.f({d.R, sb.C});
  }
}

void MoeMlp::shared_buffers(const SlotBuilder& sb, Activations& shared) const {
  dense_mlp_shared(sb, shared, spec_.activation);
  const Dims d = dims(sb);
  const int64_t N = sb.N, C = sb.C;
  if (sb.inference) {  // the forward's scratch alone: the shared expert's output, the logits
    if (shared.moe_tmp.defined()) return;
    shared.moe_tmp = sb.f({N, C});
    if (sb.compute != DType::F32) shared.moe_logits_c = sb.f({N, d.E});
    return;
  }
  if (shared.moe_dout.defined()) return;
  shared.moe_dout = sb.f({d.NK, C});
  if (d.ep > 1) {
    if (!d.allgather) shared.moe_oute = sb.f({d.R, C});
    shared.moe_doute = sb.f({d.R, C});
  }
  if (d.allgather) {
    shared.moe_ag_x = sb.f({d.ep * N, C});
    shared.moe_ag_y = sb.f({d.ep * N, C});
    shared.moe_ag_logits = sb.f32({d.ep * N, d.E});
    shared.moe_ag_expert = sb.i32({d.ep * N, d.K});
    shared.moe_ag_dweight = sb.f32({d.ep * N, d.K});
  }
  shared.moe_dact = sb.f({d.R, d.efl});
  if (d.glu == 2) shared.moe_dfc1 = sb.f({d.R, d.glu * d.efl});
  shared.moe_dweight = sb.f32({N, d.K});
  shared.moe_dlogits = sb.f32({N, d.E});
  shared.moe_dx = sb.f({N, C});
  shared.moe_tmp = sb.f({N, C});
  if (sb.compute != DType::F32) shared.moe_logits_c = sb.f({N, d.E});
}

void MoeMlp::fit(const SlotBuilder& sb, LayerActivations& la) const {
  dense_mlp_fit(sb, la, dense_width(), spec_.activation);
  if (shard_.ep_size == 1 && la.moe_x.defined()) la.moe_xe = la.moe_x;  // the expert side
}

void MoeMlp::recompute(PhaseSequence& phase, int, Activations&, LayerActivations& la) {
  if (la.gelu.defined()) {  // the shared expert
    phase(mlp_activation_phase(spec_.activation, false));
    activation(la.gelu, la.fc1);
  }
  if (shard_.ep_size == 1) {  // the experts' inputs from the kept routing (else kept whole)
    phase("moe-permute");
    be().moe_permute(la.moe_x, la.ln2, la.moe_row);
  }
  const int64_t R = la.moe_act.dim(0), efl = la.moe_act.dim(1);
  int64_t row = 0;
  for (int64_t rows : la.moe_rows) {
    if (rows > 0) {
      Tensor act = la.moe_act.view(row * efl, {rows, efl});
      activation(act, la.moe_fc1.view(row * la.moe_fc1.dim(1), {rows, la.moe_fc1.dim(1)}));
    }
    row += rows;
  }
  TESSERA_CHECK(row <= R, "MoE rows");
}

Tensor& MoeMlp::activation_backward(PhaseSequence& phase, Tensor& dact, Tensor& dfc1_swiglu,
                                    const Tensor& fc1) const {
  phase(mlp_activation_phase(spec_.activation, true));
  return mlp_activation_backward(be(), spec_.activation, dact, dfc1_swiglu, fc1);
}

void MoeMlp::infer(Activations& a, LayerActivations& la, Tensor& out) {
  TESSERA_CHECK(shard_.ep_size == 1,
                "generation with expert parallelism (every rank runs its own "
                "experts only); generate at --expert-model-parallel-size 1");
  const Tensor& ln = la.ln2;
  const int64_t n = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  Tensor logits = la.moe_logits, lc = compute() == DType::F32 ? logits : a.moe_logits_c;
  be().matmul_forward(lc, ln, router_w_, nullptr);
  if (compute() != DType::F32) be().cast(logits, lc);
  tp().broadcast(logits, 0);  // every TP rank routes as rank 0 does
  MoERouting r = current_routing();
  r.capacity_factor = 0;
  std::vector<int64_t> routed, kept;
  be().moe_route(la.moe_expert, la.moe_weight, la.moe_row, logits, r, n, routed, kept);
  be().moe_permute(la.moe_x, ln, la.moe_row);
  const int64_t efc1 = la.moe_fc1.dim(1), efl = la.moe_act.dim(1);
  const int e0 = shard_.experts_begin(cfg_.num_experts);
  int64_t at = 0;
  for (size_t j = 0; j < experts_w_.size(); ++j) {
    const int64_t rows = kept[static_cast<size_t>(e0) + j];
    if (rows == 0) continue;
    const MlpWeights& ew = experts_w_[j];
    Tensor xe = la.moe_x.view(at * C, {rows, C}), fc1 = la.moe_fc1.view(at * efc1, {rows, efc1});
    Tensor act = la.moe_act.view(at * efl, {rows, efl}), y = la.moe_out.view(at * C, {rows, C});
    be().matmul_forward(fc1, xe, ew.fc1_w, opt(ew.fc1_b));
    activation(act, fc1);
    be().matmul_forward(y, act, ew.fc2_w, bias_here() ? opt(ew.fc2_b) : nullptr);
    at += rows;
  }
  be().moe_unpermute(out, la.moe_out, la.moe_row, la.moe_weight);
  if (shared_) {  // the shared expert
    const MlpWeights& w = shared_->weights();
    be().matmul_forward(la.fc1, ln, w.fc1_w, opt(w.fc1_b));
    activation(la.gelu, la.fc1);
    be().matmul_forward(a.moe_tmp, la.gelu, w.fc2_w, bias_here() ? opt(w.fc2_b) : nullptr);
    be().add(out, out, a.moe_tmp);
  }
}

std::unique_ptr<MlpPart> make_moe_mlp(const LayerSpec& spec, const GPTConfig& cfg,
                                      const ModelShard& shard, PartServices* services) {
  return std::make_unique<MoeMlp>(cfg, shard, spec, services);
}

}  // namespace tessera
