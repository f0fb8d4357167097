// moe_part.cpp: the MoE layer as a part of a layer (model/parts.hpp): its parameters, weights and
// buffers, its passes (GPTModel's moe_* functions, model/moe.cpp), selective recomputation of the
// routed experts, and generation's MoE MLP (dropless, every TP rank routing as rank 0 does).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <sstream>

#include "core/phase_timer.hpp"
#include "model/slots.hpp"

namespace tessera {

GPTModel::MoEScratch GPTModel::make_moe_scratch(int64_t rows) const {
  MoEScratch s;
  AllocationLabel label("the MoE buffers of generation");
  Allocator& al = be_.allocator();
  const int64_t C = cfg_.hidden_size, E = cfg_.num_experts, K = cfg_.moe_router_topk;
  const int64_t efl = cfg_.moe_ffn() / shard_.tp_size, glu = swiglu_ ? 2 : 1;
  const int64_t sfl = cfg_.moe_shared_expert_intermediate_size / shard_.tp_size;
  auto f = [&](Shape sh) { return Tensor(std::move(sh), compute_, al); };
  s.rows = rows;
  s.logits = Tensor({rows, E}, DType::F32, al);
  s.logits_c = compute_ == DType::F32 ? s.logits : f({rows, E});
  s.expert = Tensor({rows, K}, DType::I32, al);
  s.row = Tensor({rows, K}, DType::I32, al);
  s.weight = Tensor({rows, K}, DType::F32, al);
  s.x = f({rows * K, C});
  s.fc1 = f({rows * K, glu * efl});
  s.act = f({rows * K, efl});
  s.out = f({rows * K, C});
  if (sfl > 0) {
    s.sfc1 = f({rows, glu * sfl});
    s.sact = f({rows, sfl});
    s.tmp = f({rows, C});
  }
  return s;
}

void GPTModel::moe_mlp(int layer, const Tensor& ln, Tensor& out, MoEScratch& s) {
  const LayerWeights& w = weights_[shard_.local_index(layer)];
  const int64_t n = ln.dim(0), C = cfg_.hidden_size, E = cfg_.num_experts;
  const int64_t K = cfg_.moe_router_topk;
  TESSERA_CHECK(n <= s.rows, "moe_mlp: ", n, " rows for a scratch of ", s.rows);
  const bool bias_here = shard_.tp_rank == 0;
  Tensor lc = s.logits_c.view(0, {n, E}), logits = s.logits.view(0, {n, E});
  be_.matmul_forward(lc, ln, w.router_w, nullptr);
  if (compute_ != DType::F32) be_.cast(logits, lc);
  tp_.broadcast(logits, 0);  // every TP rank routes as rank 0 does
  Tensor expert = s.expert.view(0, {n, K}), weight = s.weight.view(0, {n, K});
  Tensor row = s.row.view(0, {n, K});
  MoERouting r = routing_of(layer);
  r.capacity_factor = 0;
  std::vector<int64_t> routed, kept;
  be_.moe_route(expert, weight, row, logits, r, n, routed, kept);
  Tensor x = s.x.view(0, {n * K, C});
  be_.moe_permute(x, ln, row);
  const int64_t efc1 = s.fc1.dim(1), efl = s.act.dim(1);
  const int e0 = shard_.experts_begin(cfg_.num_experts);
  int64_t at = 0;
  for (size_t j = 0; j < w.experts.size(); ++j) {
    const int64_t rows = kept[static_cast<size_t>(e0) + j];
    if (rows == 0) continue;
    const ExpertWeights& ew = w.experts[j];
    Tensor xe = x.view(at * C, {rows, C}), fc1 = s.fc1.view(at * efc1, {rows, efc1});
    Tensor act = s.act.view(at * efl, {rows, efl}), y = s.out.view(at * C, {rows, C});
    be_.matmul_forward(fc1, xe, ew.fc1_w, opt(ew.fc1_b));
    mlp_activation(act, fc1);
    be_.matmul_forward(y, act, ew.fc2_w, bias_here ? opt(ew.fc2_b) : nullptr);
    at += rows;
  }
  be_.moe_unpermute(out, s.out.view(0, {n * K, C}), row, weight);
  if (w.fc1_w.defined()) {  // the shared expert
    Tensor sfc1 = s.sfc1.view(0, {n, s.sfc1.dim(1)}), sact = s.sact.view(0, {n, s.sact.dim(1)});
    Tensor tmp = s.tmp.view(0, {n, C});
    be_.matmul_forward(sfc1, ln, w.fc1_w, opt(w.fc1_b));
    mlp_activation(sact, sfc1);
    be_.matmul_forward(tmp, sact, w.fc2_w, bias_here ? opt(w.fc2_b) : nullptr);
    be_.add(out, out, tmp);
  }
}

void GPTModel::moe_recompute(PhaseSequence& phase, LayerActivations& la) {
  if (shard_.ep_size == 1) {  // the experts' inputs from the kept routing (else kept whole)
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

namespace {

// The MoE layer as a part (model/parts.hpp): the router, the routed experts (this rank's, with
// expert parallelism), the dispatch and combine, and the shared expert (a dense MLP in the dense
// MLP's slots). Its passes are GPTModel's moe_* functions above.
class MoeMlp final : public MlpPart {
 public:
  using MlpPart::MlpPart;

  // The router (replicated; every TP rank routes its own rows), this rank's experts by their
  // global index (layout-free names), and the shared expert.
  void add_params(ParamSpecBuilder& b, int l) const override { moe_mlp_params(spec_, b, l); }

  void bind(const ParamStore& ps, int l, bool grads, LayerWeights& w) const override {
    w.router_w = param(ps, l, "mlp.router.weight", grads);
    dense_mlp_bind(ps, l, grads, "mlp.shared_expert.", w);  // the dense MLP's slots
    const int e0 = shard_.experts_begin(cfg_.num_experts);
    for (int e = e0; e < e0 + shard_.experts_local(cfg_.num_experts); ++e) {
      const std::string x = "mlp.experts." + std::to_string(e) + ".";
      w.experts.push_back(
          {param(ps, l, x + "fc1.weight", grads), param(ps, l, x + "fc1.bias", grads),
           param(ps, l, x + "fc2.weight", grads), param(ps, l, x + "fc2.bias", grads)});
    }
  }
  int64_t dense_width() const override { return spec_.dense_width / shard_.tp_size; }

  // N*K token copies leave a rank; its experts receive R rows: the same ones without expert
  // parallelism, else at most N*min(K, local experts) from each of the EP ranks, or their
  // capacity (GPTConfig::moe_received_rows).
  struct Dims {
    int64_t E, K, NK, R, efl, glu;
    int ep;
    bool allgather;
  };
  Dims dims(const SlotBuilder& sb) const {
    Dims d;
    d.E = cfg_.num_experts;
    d.K = cfg_.moe_router_topk;
    d.NK = sb.N * d.K;
    d.ep = shard_.ep_size;
    d.R = cfg_.moe_received_rows(sb.N, d.ep);
    d.allgather = d.ep > 1 && cfg_.moe_token_dispatcher_type == "allgather";
    d.efl = cfg_.moe_ffn() / shard_.tp_size;
    d.glu = spec_.activation == MlpActivation::SwiGLU ? 2 : 1;
    return d;
  }

  void recomputed_buffers(const SlotBuilder& sb, LayerActivations& la,
                          int64_t width) const override {
    dense_mlp_buffers(sb, la, width, spec_.activation, false);
    if (la.moe_x.defined()) return;
    const Dims d = dims(sb);
    la.moe_x = sb.f({d.NK, sb.C});
    la.moe_act = sb.f({d.R, d.efl});
  }

  void kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const override {
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

  void shared_buffers(const SlotBuilder& sb, Activations& shared) const override {
    dense_mlp_shared(sb, shared, spec_.activation);
    if (shared.moe_dout.defined()) return;
    const Dims d = dims(sb);
    const int64_t N = sb.N, C = sb.C;
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

  void fit(const SlotBuilder& sb, LayerActivations& la) const override {
    dense_mlp_fit(sb, la, dense_width(), spec_.activation);
    if (shard_.ep_size == 1 && la.moe_x.defined()) la.moe_xe = la.moe_x;  // the expert side
  }

  void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations&,
               Tensor& out) override {
    moe_forward(phase, l, a, out);
  }

  void recompute(PhaseSequence& phase, int, Activations&, LayerActivations& la) override {
    if (la.gelu.defined()) {  // the shared expert
      phase(mlp_activation_phase(spec_.activation, false));
      mlp_activation_forward(be(), spec_.activation, la.gelu, la.fc1);
    }
    moe_recompute(phase, la);
  }

  void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations&,
                const Tensor& dout) override {
    moe_backward(phase, l, a, dout);
  }

  void reduce_tp_grads(int l) override {
    if (tp().size() == 1) return;
    // Each TP rank routed its share of the tokens: the router's gradient is a partial sum.
    TESSERA_PHASE("moe-router-grad-all-reduce");
    tp().all_reduce(grads(l).router_w, ReduceOp::Sum);
  }

  void decode_buffers(DecodeBuffers& d) const override {
    if (d.moe.rows == 0) d.moe = m().make_moe_scratch(d.rows);
  }

  void decode(int l, const Tensor& ln, Tensor& out, DecodeBuffers& d) override {
    m().moe_mlp(l, ln, out, d.moe);
  }
};

}  // namespace

std::unique_ptr<MlpPart> make_moe_mlp(const LayerSpec& spec, const GPTConfig& cfg,
                                      const ModelShard& shard, GPTModel* model) {
  return std::make_unique<MoeMlp>(cfg, shard, spec, model);
}

}  // namespace tessera
