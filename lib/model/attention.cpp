// attention.cpp: standard self-attention as a part of a layer (model/parts.hpp): multi-head or
// grouped-query attention (glued query and key/value projections), with optional per-head q/k
// norms (Qwen3's --qk-layernorm). Column-parallel QKV over this rank's heads, RoPE, the attention
// core (fused, or the context-parallel ring), the row-parallel output projection.
#include "core/phase_timer.hpp"
#include "model/slots.hpp"

namespace tessera {

Tensor ModelPart::param(const ParamStore& ps, int l, const std::string& name, bool grads) {
  const std::string full = "layers." + std::to_string(l) + "." + name;
  if (!ps.has(full)) return Tensor();
  return grads ? ps.grad(full) : ps.compute_param(full);
}

namespace {

// --qk-layernorm: the query and key heads of a layer's qkv before their norm, (N, Hl*hd) and
// (N, Gl*hd), and the norm's statistics (N*Hl), (N*Gl) (the means with LayerNorm only); the
// norms' scratch (N, Hl*hd), shared by the layers.
struct QkNormBuffers {
  Tensor q_raw, k_raw, q_mean, q_rstd, k_mean, k_rstd;
};
struct QkNormScratch {
  Tensor tmp;
};

class StandardAttention final : public AttentionPart {
 public:
  using AttentionPart::AttentionPart;

  // The query, key and value projections (glued: one GEMM), the optional q/k norms, the output
  // projection.
  void add_params(ParamSpecBuilder& b, int l) const override {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int64_t h = b.cfg.hidden_size, heads = b.cfg.num_attention_heads, hd = b.cfg.head_dim();
    const int64_t groups = b.cfg.kv_heads();
    const double std = b.cfg.init_method_std;
    const bool qkv_bias = b.cfg.qkv_bias();
    if (b.cfg.group_query_attention) {
      // Query heads and key/value groups split over TP separately; glued so one GEMM reads them
      // as [H/TP query | G/TP key | G/TP value] heads.
      b.add(p + "attn.q.weight", {heads, hd, h}, 0, ParamInit::Normal, std, true);
      b.specs.back().glue_next = true;
      b.add(p + "attn.kv.weight", {2, groups, hd, h}, 1, ParamInit::Normal, std, true);
      if (qkv_bias) {
        b.add(p + "attn.q.bias", {heads, hd}, 0, ParamInit::Zeros, 0, false);
        b.specs.back().glue_next = true;
        b.add(p + "attn.kv.bias", {2, groups, hd}, 1, ParamInit::Zeros, 0, false);
      }
    } else {
      b.add(p + "attn.qkv.weight", {3, heads, hd, h}, 1, ParamInit::Normal, std, true);
      if (qkv_bias) b.add(p + "attn.qkv.bias", {3, heads, hd}, 1, ParamInit::Zeros, 0, false);
    }
    if (spec_.qk_norm)  // one norm of hd features for the query heads, one for the keys
      for (const char* qk : {"attn.q_norm", "attn.k_norm"}) b.norm(p + qk, hd);
    b.add(p + "attn.proj.weight", {h, heads * hd}, 1, ParamInit::Normal, b.out_std(), true);
    if (b.cfg.add_bias_linear) b.add(p + "attn.proj.bias", {h}, -1, ParamInit::Zeros, 0, false);
  }

  void bind(const ParamStore& ps, int l) override {
    w_ = weights_of(ps, l, false);
    g_ = weights_of(ps, l, true);
  }

  void core_buffers(const SlotBuilder& sb, LayerActivations& la) const override {
    if (la.att.defined()) return;
    la.att = sb.f({sb.B, sb.T, sb.hl});
    la.lse = sb.f32({sb.B, sb.heads_l, sb.T});
  }

  void kept_buffers(const SlotBuilder& sb, LayerActivations& la) const override {
    if (la.qkv.defined()) return;
    la.qkv = sb.f({sb.B, sb.T, sb.qkvl});
    if (!spec_.qk_norm) return;
    // The q/k heads before their norms, and the norms' statistics.
    const int64_t N = sb.N, kv_l = kv_heads_local(), hd = cfg_.head_dim();
    QkNormBuffers& qk = la.parts.get<QkNormBuffers>();
    qk.q_raw = sb.f({N, sb.hl});
    qk.k_raw = sb.f({N, kv_l * hd});
    qk.q_rstd = sb.f32({N * sb.heads_l});
    qk.k_rstd = sb.f32({N * kv_l});
    if (!cfg_.rmsnorm()) {
      qk.q_mean = sb.f32({N * sb.heads_l});
      qk.k_mean = sb.f32({N * kv_l});
    }
  }

  int64_t deferred_elements(const SlotBuilder& sb) const override {
    return sb.N * (sb.C + sb.qkvl) + sb.N * (sb.hl + sb.C);  // qkv, proj
  }
  void shared_buffers(const SlotBuilder& sb, Activations& shared) const override {
    if (spec_.qk_norm) {
      Tensor& tmp = shared.part_scratch.get<QkNormScratch>().tmp;
      if (!tmp.defined()) tmp = sb.f({sb.N, sb.hl});
    }
    if (sb.inference || shared.dqkv.defined()) return;
    shared.dqkv = sb.f({sb.B, sb.T, sb.qkvl});
    shared.datt = sb.f({sb.B, sb.T, sb.hl});
  }

  void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
               Tensor& out) override {
    const Weights& w = w_;
    phase("qkv-gemm-forward");
    s().linear_forward(l, Fp8Gemm::Qkv, la.qkv, la.ln1, w.qkv_w, opt(w.qkv_b), a);
    if (spec_.qk_norm) {
      phase("qk-norm-forward");
      qk_norm_forward(la.qkv, w, la.parts.get<QkNormBuffers>(),
                      a.part_scratch.get<QkNormScratch>().tmp);
    }
    if (cfg_.rope()) {
      phase("rope");
      s().rope(la.qkv, a, false);
    }
    phase("attention-core-forward");
    s().attention_core_forward(l, a, la);
    phase("proj-gemm-forward");
    s().linear_forward(l, Fp8Gemm::Proj, out, la.att, w.proj_w,
                       bias_here() ? opt(w.proj_b) : nullptr, a);
  }

  void recompute(PhaseSequence& phase, int l, Activations& a, LayerActivations& la) override {
    phase("attention-core-forward");  // qkv was kept with RoPE applied
    s().attention_core_forward(l, a, la);
  }

  void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                const Tensor& dout) override {
    const Weights& w = w_;
    Weights& g = g_;
    phase("proj-gemm-backward");
    s().linear_backward(l, Fp8Gemm::Proj, &a.datt, g.proj_w, opt(g.proj_b), dout, la.att, w.proj_w);
    phase("attention-core-backward");
    s().attention_core_backward(l, a, la);
    if (cfg_.rope()) {  // the rotation's transpose: rotate the gradient back
      phase("rope");
      s().rope(a.dqkv, a, true);
    }
    if (spec_.qk_norm) {  // datt is free once the attention core has read it
      phase("qk-norm-backward");
      qk_norm_backward(a.dqkv, g, w, la.parts.get<QkNormBuffers>(),
                       a.part_scratch.get<QkNormScratch>().tmp, a.datt);
    }
    phase("qkv-gemm-backward");
    s().linear_backward(l, Fp8Gemm::Qkv, &a.dln, g.qkv_w, opt(g.qkv_b), a.dqkv, la.ln1, w.qkv_w);
  }

  void reduce_tp_grads(int l) override {
    if (!spec_.qk_norm || tp().size() == 1) return;
    // Each TP rank normalized its own heads: the norms' gradients are partial sums.
    TESSERA_PHASE("qk-norm-grad-all-reduce");
    Weights& g = g_;
    for (Tensor* t : {&g.q_norm_w, &g.q_norm_b, &g.k_norm_w, &g.k_norm_b})
      if (t->defined()) tp().all_reduce(*t, ReduceOp::Sum);
  }

 private:
  // The layer's weights (or gradients); with grouped-query attention qkv_w / qkv_b view the glued
  // query and key/value parameters; absent ones (biases, the q/k norms) undefined.
  struct Weights {
    Tensor qkv_w, qkv_b, proj_w, proj_b, q_norm_w, q_norm_b, k_norm_w, k_norm_b;
  };
  static Weights weights_of(const ParamStore& ps, int l, bool grads) {
    const std::string p = "layers." + std::to_string(l) + ".";
    Weights w;
    w.qkv_w = param(ps, l, "attn.qkv.weight", grads);
    w.qkv_b = param(ps, l, "attn.qkv.bias", grads);
    if (ps.has(p + "attn.q.weight")) {  // grouped-query attention: [q | k | v] as one GEMM
      auto fused = [&](const char* a, const char* b) {
        if (!ps.has(p + a)) return Tensor();
        return grads ? ps.grad_fused(p + a, p + b) : ps.compute_fused(p + a, p + b);
      };
      w.qkv_w = fused("attn.q.weight", "attn.kv.weight");
      w.qkv_b = fused("attn.q.bias", "attn.kv.bias");
    }
    w.proj_w = param(ps, l, "attn.proj.weight", grads);
    w.proj_b = param(ps, l, "attn.proj.bias", grads);
    w.q_norm_w = param(ps, l, "attn.q_norm.weight", grads);
    w.q_norm_b = param(ps, l, "attn.q_norm.bias", grads);
    w.k_norm_w = param(ps, l, "attn.k_norm.weight", grads);
    w.k_norm_b = param(ps, l, "attn.k_norm.bias", grads);
    return w;
  }

  Weights w_, g_;

  // Normalizes the query and key heads of qkv (n rows of (Hl+2Gl)*hd, the values untouched) in
  // place, each head over its hd features with the layer's q_norm / k_norm, keeping the heads
  // before the norm and its statistics in `keep` (which may hold more rows: generation's
  // buffers) for the backward; `tmp` (at least n*Hl*hd elements) is scratch.
  void qk_norm_forward(Tensor& qkv, const Weights& w, QkNormBuffers& keep, Tensor& tmp) const {
    const int64_t hd = cfg_.head_dim(), width = qkv.dim(qkv.ndim() - 1), n = qkv.numel() / width;
    Tensor rows = qkv.reshape({n, width});
    // The query heads at columns [0, Hl*hd), the key heads after them: each copied out whole,
    // normalized per head into tmp, and copied back.
    auto one = [&](int64_t col, int64_t heads, const Tensor& raw_all, const Tensor& mean_all,
                   const Tensor& rstd_all, const Tensor& nw, const Tensor& nb) {
      Tensor raw = raw_all.view(0, {n, heads * hd}), rstd = rstd_all.view(0, {n * heads});
      Tensor mean = mean_all.defined() ? mean_all.view(0, {n * heads}) : Tensor();
      be().copy_columns(raw, 0, rows, col, heads * hd);
      Tensor o = tmp.view(0, {n * heads, hd});
      s().norm_forward(o, mean, rstd, raw.reshape({n * heads, hd}), nw, nb);
      be().copy_columns(rows, col, tmp.view(0, {n, heads * hd}), 0, heads * hd);
    };
    one(0, heads_local(), keep.q_raw, keep.q_mean, keep.q_rstd, w.q_norm_w, w.q_norm_b);
    one(heads_local() * hd, kv_heads_local(), keep.k_raw, keep.k_mean, keep.k_rstd, w.k_norm_w,
        w.k_norm_b);
  }

  // The backward: dqkv's query and key gradients (after the norm) become those before it, the
  // norms' weight gradients accumulate into g; tmp and tmp2 (each n*Hl*hd) are scratch.
  void qk_norm_backward(Tensor& dqkv, Weights& g, const Weights& w, const QkNormBuffers& keep,
                        Tensor& tmp, Tensor& tmp2) const {
    const int64_t hd = cfg_.head_dim(), width = dqkv.dim(dqkv.ndim() - 1);
    const int64_t n = dqkv.numel() / width;
    Tensor rows = dqkv.reshape({n, width});
    auto one = [&](int64_t col, int64_t heads, const Tensor& raw, const Tensor& mean,
                   const Tensor& rstd, const Tensor& nw, Tensor& dw, Tensor& db) {
      Tensor dy = tmp.view(0, {n, heads * hd}), dx = tmp2.view(0, {n, heads * hd});
      be().copy_columns(dy, 0, rows, col, heads * hd);
      be().zero(dx);  // the norm's backward accumulates
      Tensor dx_heads = dx.reshape({n * heads, hd});
      s().norm_backward(dx_heads, dw, db, dy.reshape({n * heads, hd}), raw.reshape({n * heads, hd}),
                        nw, mean, rstd);
      be().copy_columns(rows, col, dx, 0, heads * hd);
    };
    one(0, heads_local(), keep.q_raw, keep.q_mean, keep.q_rstd, w.q_norm_w, g.q_norm_w, g.q_norm_b);
    one(heads_local() * hd, kv_heads_local(), keep.k_raw, keep.k_mean, keep.k_rstd, w.k_norm_w,
        g.k_norm_w, g.k_norm_b);
  }
};

}  // namespace

std::unique_ptr<AttentionPart> make_standard_attention(const LayerSpec& spec, const GPTConfig& cfg,
                                                       const ModelShard& shard,
                                                       PartServices* services) {
  return std::make_unique<StandardAttention>(cfg, shard, spec, services);
}

}  // namespace tessera
