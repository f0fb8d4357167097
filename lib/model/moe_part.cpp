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

int64_t MoeMlp::deferred_elements(const SlotBuilder& sb) const {
  const Dims d = dims(sb);
  const int64_t router = sb.N / shard_.tp_size * (sb.C + d.E);  // this TP rank's routed rows
  const int64_t experts = d.NK * (sb.C + d.efl * d.glu) + d.NK * (d.efl + sb.C);
  // The shared expert (a dense MLP of its width; a planning instance has no DenseMlp made).
  const int64_t fl = dense_width();
  const int64_t shared = fl > 0 ? sb.N * (sb.C + fl * d.glu) + sb.N * (fl + sb.C) : 0;
  return router + experts + shared;
}

void MoeMlp::recomputed_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  dense_mlp_buffers(sb, la, width, spec_.activation, false);
  if (mb.x.defined()) return;
  const Dims d = dims(sb);
  mb.x = sb.f({d.NK, sb.C});
  mb.act = sb.f({d.R, d.efl});
}

void MoeMlp::kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  dense_mlp_buffers(sb, la, width, spec_.activation, true);
  if (mb.logits.defined()) return;
  const Dims d = dims(sb);
  const int64_t N = sb.N;
  mb.logits = sb.f32({N, d.E});
  mb.expert = sb.i32({N, d.K});
  mb.row = sb.i32({N, d.K});
  mb.weight = sb.f32({N, d.K});
  mb.fc1 = sb.f({d.R, d.glu * d.efl});
  mb.out = sb.f({d.NK, sb.C});
  if (d.ep > 1) mb.xe = sb.f({d.R, sb.C});
  if (d.allgather) {
    mb.ag_weight = sb.f32({d.ep * N, d.K});
    mb.ag_row = sb.i32({d.ep * N, d.K});
    mb.oute = sb.f({d.R, sb.C});
  }
}

void MoeMlp::shared_buffers(const SlotBuilder& sb, Activations& shared) const {
  MoeScratch& ms = shared.part_scratch.get<MoeScratch>();
  dense_mlp_shared(sb, shared, spec_.activation);
  const Dims d = dims(sb);
  const int64_t N = sb.N, C = sb.C;
  if (sb.inference) {  // the forward's scratch alone: the shared expert's output, the logits
    if (ms.tmp.defined()) return;
    ms.tmp = sb.f({N, C});
    if (sb.compute != DType::F32) ms.logits_c = sb.f({N, d.E});
    return;
  }
  if (ms.dout.defined()) return;
  ms.dout = sb.f({d.NK, C});
  if (d.ep > 1) {
    if (!d.allgather) ms.oute = sb.f({d.R, C});
    ms.doute = sb.f({d.R, C});
  }
  if (d.allgather) {
    ms.ag_x = sb.f({d.ep * N, C});
    ms.ag_y = sb.f({d.ep * N, C});
    ms.ag_logits = sb.f32({d.ep * N, d.E});
    ms.ag_expert = sb.i32({d.ep * N, d.K});
    ms.ag_dweight = sb.f32({d.ep * N, d.K});
  }
  ms.dact = sb.f({d.R, d.efl});
  if (d.glu == 2) ms.dfc1 = sb.f({d.R, d.glu * d.efl});
  ms.dweight = sb.f32({N, d.K});
  ms.dlogits = sb.f32({N, d.E});
  ms.dx = sb.f({N, C});
  ms.tmp = sb.f({N, C});
  if (sb.compute != DType::F32) ms.logits_c = sb.f({N, d.E});
}

void MoeMlp::fit(const SlotBuilder& sb, LayerActivations& la) const {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  dense_mlp_fit(sb, la, dense_width(), spec_.activation);
  if (shard_.ep_size == 1 && mb.x.defined()) mb.xe = mb.x;  // the expert side
}

void MoeMlp::recompute(PhaseSequence& phase, int, Activations&, LayerActivations& la) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  if (la.gelu.defined()) {  // the shared expert
    phase(mlp_activation_phase(spec_.activation, false));
    activation(la.gelu, la.fc1);
  }
  if (shard_.ep_size == 1) {  // the experts' inputs from the kept routing (else kept whole)
    phase("moe-permute");
    be().moe_permute(mb.x, la.ln2, mb.row);
  }
  const int64_t R = mb.act.dim(0), efl = mb.act.dim(1);
  int64_t row = 0;
  for (int64_t rows : mb.rows) {
    if (rows > 0) {
      Tensor act = mb.act.view(row * efl, {rows, efl});
      activation(act, mb.fc1.view(row * mb.fc1.dim(1), {rows, mb.fc1.dim(1)}));
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
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  TESSERA_CHECK(shard_.ep_size == 1,
                "generation with expert parallelism (every rank runs its own "
                "experts only); generate at --expert-model-parallel-size 1");
  const Tensor& ln = la.ln2;
  const int64_t n = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  Tensor logits = mb.logits, lc = compute() == DType::F32 ? logits : ms.logits_c;
  be().matmul_forward(lc, ln, router_w_, nullptr);
  if (compute() != DType::F32) be().cast(logits, lc);
  tp().broadcast(logits, 0);  // every TP rank routes as rank 0 does
  MoERouting r = current_routing();
  r.capacity_factor = 0;
  std::vector<int64_t> routed, kept;
  be().moe_route(mb.expert, mb.weight, mb.row, logits, r, n, routed, kept);
  be().moe_permute(mb.x, ln, mb.row);
  const int64_t efc1 = mb.fc1.dim(1), efl = mb.act.dim(1);
  const int e0 = shard_.experts_begin(cfg_.num_experts);
  int64_t at = 0;
  for (size_t j = 0; j < experts_w_.size(); ++j) {
    const int64_t rows = kept[static_cast<size_t>(e0) + j];
    if (rows == 0) continue;
    const MlpWeights& ew = experts_w_[j];
    Tensor xe = mb.x.view(at * C, {rows, C}), fc1 = mb.fc1.view(at * efc1, {rows, efc1});
    Tensor act = mb.act.view(at * efl, {rows, efl}), y = mb.out.view(at * C, {rows, C});
    be().matmul_forward(fc1, xe, ew.fc1_w, opt(ew.fc1_b));
    activation(act, fc1);
    be().matmul_forward(y, act, ew.fc2_w, bias_here() ? opt(ew.fc2_b) : nullptr);
    at += rows;
  }
  be().moe_unpermute(out, mb.out, mb.row, mb.weight);
  if (shared_) {  // the shared expert
    const MlpWeights& w = shared_->weights();
    be().matmul_forward(la.fc1, ln, w.fc1_w, opt(w.fc1_b));
    activation(la.gelu, la.fc1);
    be().matmul_forward(ms.tmp, la.gelu, w.fc2_w, bias_here() ? opt(w.fc2_b) : nullptr);
    be().add(out, out, ms.tmp);
  }
}

std::unique_ptr<MlpPart> make_moe_mlp(const LayerSpec& spec, const GPTConfig& cfg,
                                      const ModelShard& shard, PartServices* services) {
  return std::make_unique<MoeMlp>(cfg, shard, spec, services);
}

}  // namespace tessera
