// mla.cpp: multi-latent attention (DeepSeek-V2/V3, Megatron-Core's MLA; docs/model.md) as a part
// of a layer (model/parts.hpp), on this rank's Hl heads of hd = qk_head_dim + qk_pos_emb_head_dim
// features.
//
// Forward, from the layer's normed input ln (N rows, every TP rank all of them):
//   queries: q_lat = ln W_qd^T (the latent, replicated over TP), its norm, q = q_lat_n W_qu^T
//     (this rank's heads, each [qk_head_dim without position | rope dim]); without a query latent
//     q = ln W_q^T; with YaRN q is scaled by the softmax factor mscale^2 (the attention's own
//     scale is 1/sqrt(hd));
//   keys and values: c = ln W_c^T (the latent) and k_pe = ln W_pe^T (the keys' RoPE part, one for
//     all heads; W_c and W_pe are the rows of the kv_down weight), c_n its norm,
//     kv = c_n W_kvu^T (each head [keys without position | values]);
//   qkv, as every attention kernel reads it: each query and key head [RoPE part | the rest], each
//     value head [values | zeros up to hd]. RoPE then rotates the first rope-dim features of each
//     head, and the attention output's values per head are the first v_head_dim of its hd.
// Backward: the mirror. The shared k_pe's gradient sums over the heads; each TP rank's heads give
// partial sums of the latents' gradients, which flow linearly through the latent norms and
// down-projections: the input gradient is summed over TP with the other column-parallel ones, the
// replicated weights' gradients once per step (reduce_tp_grads).
#include "core/phase_timer.hpp"
#include "model/slots.hpp"

namespace tessera {

namespace {

// What the backward reads: the query latent before and after its norm (N, q_lora_rank) with the
// norm's statistics (N); the key/value latent before and after its norm (N, kv_lora_rank) with
// its statistics, and the keys' shared RoPE part (N, rope dim) before RoPE; the attention output's
// values per head (N, Hl*v_head_dim), the output projection's input. Without the latent norms
// q_lat_n and c_n are q_lat and c.
struct MlaBuffers {
  Tensor q_lat, q_lat_n, q_mean, q_rstd, c, c_n, c_mean, c_rstd, k_pe, att_v;
};

// The scratch the layers share: the heads' queries (N, Hl*hd), keys without position and values
// (N, Hl*(qk_head_dim + v_head_dim)), the latents' gradients after and before their norms
// (N, q_lora_rank) x 2, (N, kv_lora_rank) x 2, the shared RoPE key's gradient (N, rope dim) and
// one head's (N, rope dim), a second (N,C) for the input gradient's other parts, and the output
// projection's input gradient (N, Hl*v_head_dim).
struct MlaScratch {
  Tensor q, kv, dq_n, dq_lat, dc_n, dc, dk_pe, tmp_pe, dln, datt_v;
};

class MlaAttention final : public AttentionPart {
 public:
  using AttentionPart::AttentionPart;

  // The query latent's down-projection, its norm and the up-projection to the heads (or one
  // projection from the hidden state), the key/value latent's (its last qk_pos_emb_head_dim
  // features: the keys' shared RoPE part), its norm and the up-projection to each head's keys
  // without position and values, the output projection. The latents are replicated over TP
  // (every rank computes them; their gradients are summed over TP), the up-projections split by
  // heads.
  void add_params(ParamSpecBuilder& b, int l) const override {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int64_t h = b.cfg.hidden_size, heads = b.cfg.num_attention_heads, hd = b.cfg.head_dim();
    const int64_t qr = b.cfg.q_lora_rank, kvr = b.cfg.kv_lora_rank, dr = b.cfg.qk_pos_emb_head_dim;
    const double std = b.cfg.init_method_std;
    if (qr > 0) {
      b.add(p + "attn.q_down.weight", {qr, h}, -1, ParamInit::Normal, std, true);
      if (spec_.qk_norm) b.norm(p + "attn.q_down_norm", qr);
      b.add(p + "attn.q_up.weight", {heads, hd, qr}, 0, ParamInit::Normal, std, true);
    } else {
      b.add(p + "attn.q_proj.weight", {heads, hd, h}, 0, ParamInit::Normal, std, true);
    }
    b.add(p + "attn.kv_down.weight", {kvr + dr, h}, -1, ParamInit::Normal, std, true);
    if (spec_.qk_norm) b.norm(p + "attn.kv_down_norm", kvr);
    b.add(p + "attn.kv_up.weight", {heads, b.cfg.qk_head_dim + b.cfg.v_head_dim, kvr}, 0,
          ParamInit::Normal, std, true);
    b.add(p + "attn.proj.weight", {h, heads * b.cfg.v_head_dim}, 1, ParamInit::Normal, b.out_std(),
          true);
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
    la.parts.get<MlaBuffers>().att_v = sb.f({sb.N, sb.heads_l * cfg_.v_head_dim});
  }

  // The heads, and the latents (with their norms' statistics) their backward reads.
  void kept_buffers(const SlotBuilder& sb, LayerActivations& la) const override {
    if (la.qkv.defined()) return;
    la.qkv = sb.f({sb.B, sb.T, sb.qkvl});
    const int64_t N = sb.N, qr = cfg_.q_lora_rank, kvr = cfg_.kv_lora_rank;
    const bool norm = spec_.qk_norm;
    MlaBuffers& m = la.parts.get<MlaBuffers>();
    if (qr > 0) {
      m.q_lat = sb.f({N, qr});
      m.q_lat_n = norm ? sb.f({N, qr}) : m.q_lat;
      if (norm) {
        if (!cfg_.rmsnorm()) m.q_mean = sb.f32({N});
        m.q_rstd = sb.f32({N});
      }
    }
    m.c = sb.f({N, kvr});
    m.c_n = norm ? sb.f({N, kvr}) : m.c;
    m.k_pe = sb.f({N, cfg_.qk_pos_emb_head_dim});
    if (norm) {
      if (!cfg_.rmsnorm()) m.c_mean = sb.f32({N});
      m.c_rstd = sb.f32({N});
    }
  }

  int64_t deferred_elements(const SlotBuilder& sb) const override {
    const int64_t N = sb.N, C = sb.C, H = sb.heads_l, D = cfg_.head_dim();
    const int64_t dn = cfg_.qk_head_dim, dr = cfg_.qk_pos_emb_head_dim, dv = cfg_.v_head_dim;
    const int64_t qr = cfg_.q_lora_rank, kvr = cfg_.kv_lora_rank;
    const int64_t queries = qr > 0 ? N * (C + qr) + N * (qr + H * D) : N * (C + H * D);
    // kv_down's two row blocks (the latent, the RoPE key), kv_up, proj
    return queries + N * (C + kvr) + N * (C + dr) + N * (kvr + H * (dn + dv)) + N * (H * dv + C);
  }
  void shared_buffers(const SlotBuilder& sb, Activations& shared) const override {
    const int64_t N = sb.N, dr = cfg_.qk_pos_emb_head_dim;
    MlaScratch& sc = shared.part_scratch.get<MlaScratch>();
    if (sb.inference) {  // the forward's scratch alone
      if (!sc.q.defined()) {
        sc.q = sb.f({N, sb.hl});
        sc.kv = sb.f({N, sb.heads_l * (cfg_.qk_head_dim + cfg_.v_head_dim)});
      }
      return;
    }
    if (shared.dqkv.defined()) return;
    shared.dqkv = sb.f({sb.B, sb.T, sb.qkvl});
    shared.datt = sb.f({sb.B, sb.T, sb.hl});
    sc.q = sb.f({N, sb.hl});
    sc.kv = sb.f({N, sb.heads_l * (cfg_.qk_head_dim + cfg_.v_head_dim)});
    if (cfg_.q_lora_rank > 0) {
      sc.dq_n = sb.f({N, cfg_.q_lora_rank});
      sc.dq_lat = sb.f({N, cfg_.q_lora_rank});
    }
    sc.dc_n = sb.f({N, cfg_.kv_lora_rank});
    sc.dc = sb.f({N, cfg_.kv_lora_rank});
    sc.dk_pe = sb.f({N, dr});
    sc.tmp_pe = sb.f({N, dr});
    sc.dln = sb.f({N, sb.C});
    sc.datt_v = sb.f({N, sb.heads_l * cfg_.v_head_dim});
  }

  void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
               Tensor& out) override {
    const Weights& w = w_;
    phase("qkv-gemm-forward");
    MlaScratch& sc = a.part_scratch.get<MlaScratch>();
    qkv_forward(la.qkv, la.ln1, w, la.parts.get<MlaBuffers>(), sc.q, sc.kv);
    if (cfg_.rope()) {
      phase("rope");
      s().rope(la.qkv, a, false);
    }
    phase("attention-core-forward");
    s().attention_core_forward(l, a, la);
    values(la.parts.get<MlaBuffers>().att_v, la.att);
    phase("proj-gemm-forward");
    s().linear_forward(l, Fp8Gemm::Proj, out, la.parts.get<MlaBuffers>().att_v, w.proj_w,
                       bias_here() ? opt(w.proj_b) : nullptr, a);
  }

  void recompute(PhaseSequence& phase, int l, Activations& a, LayerActivations& la) override {
    phase("attention-core-forward");  // qkv was kept with RoPE applied
    s().attention_core_forward(l, a, la);
    values(la.parts.get<MlaBuffers>().att_v, la.att);
  }

  void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                const Tensor& dout) override {
    const Weights& w = w_;
    Weights& g = g_;
    Tensor& datt_v = a.part_scratch.get<MlaScratch>().datt_v;
    phase("proj-gemm-backward");
    s().linear_backward(l, Fp8Gemm::Proj, &datt_v, g.proj_w, opt(g.proj_b), dout,
                        la.parts.get<MlaBuffers>().att_v, w.proj_w);
    expand(a.datt, datt_v);
    phase("attention-core-backward");
    s().attention_core_backward(l, a, la);
    if (cfg_.rope()) {  // the rotation's transpose: rotate the gradient back
      phase("rope");
      s().rope(a.dqkv, a, true);
    }
    phase("qkv-gemm-backward");
    qkv_backward(a, la);
  }

  void reduce_tp_grads(int l) override {
    if (tp().size() == 1) return;
    // Each TP rank back-propagated its own heads into the replicated latents: their weights'
    // gradients are partial sums.
    TESSERA_PHASE("qk-norm-grad-all-reduce");
    Weights& g = g_;
    for (Tensor* t : {&g.q_down_w, &g.q_down_norm_w, &g.q_down_norm_b, &g.kv_down_w,
                      &g.kv_down_norm_w, &g.kv_down_norm_b})
      if (t->defined()) tp().all_reduce(*t, ReduceOp::Sum);
  }

 private:
  // The layer's weights (or gradients): the latents' down-projections and norms, the
  // up-projections (q_up_w is the query projection from the hidden state when there is no query
  // latent), the output projection; absent ones undefined.
  struct Weights {
    Tensor q_down_w, q_down_norm_w, q_down_norm_b, q_up_w, kv_down_w, kv_down_norm_w,
        kv_down_norm_b, kv_up_w, proj_w, proj_b;
  };
  static Weights weights_of(const ParamStore& ps, int l, bool grads) {
    const std::string p = "layers." + std::to_string(l) + ".";
    Weights w;
    w.q_down_w = param(ps, l, "attn.q_down.weight", grads);
    w.q_down_norm_w = param(ps, l, "attn.q_down_norm.weight", grads);
    w.q_down_norm_b = param(ps, l, "attn.q_down_norm.bias", grads);
    w.q_up_w = ps.has(p + "attn.q_up.weight") ? param(ps, l, "attn.q_up.weight", grads)
                                              : param(ps, l, "attn.q_proj.weight", grads);
    w.kv_down_w = param(ps, l, "attn.kv_down.weight", grads);
    w.kv_down_norm_w = param(ps, l, "attn.kv_down_norm.weight", grads);
    w.kv_down_norm_b = param(ps, l, "attn.kv_down_norm.bias", grads);
    w.kv_up_w = param(ps, l, "attn.kv_up.weight", grads);
    w.proj_w = param(ps, l, "attn.proj.weight", grads);
    w.proj_b = param(ps, l, "attn.proj.bias", grads);
    return w;
  }

  Weights w_, g_;

  // ln (n rows) -> qkv (n rows of 3 * Hl * head_dim: each query head [RoPE part | the rest], each
  // key head [the shared RoPE key | its own], each value head [v_head_dim values | zeros]),
  // before RoPE; keeps the latents in `keep` (which may hold more rows: generation's buffers); q
  // and kv are scratch (n, Hl*hd) and (n, Hl*(qk_head_dim + v_head_dim)).
  void qkv_forward(Tensor& qkv, const Tensor& ln, const Weights& w, MlaBuffers& keep, Tensor& q,
                   Tensor& kv) const {
    const int64_t C = cfg_.hidden_size, n = ln.numel() / C, H = heads_local(), D = cfg_.head_dim();
    const int64_t dn = cfg_.qk_head_dim, dr = cfg_.qk_pos_emb_head_dim, dv = cfg_.v_head_dim;
    const int64_t qr = cfg_.q_lora_rank, kvr = cfg_.kv_lora_rank;
    const Tensor x = ln.reshape({n, C});
    // `keep` may hold more rows than ln (generation's buffers): the first n are used.
    auto rows = [&](const Tensor& t, int64_t cols) {
      return t.defined() ? t.view(0, {n, cols}) : Tensor();
    };
    auto stats = [&](const Tensor& t) { return t.defined() ? t.view(0, {n}) : Tensor(); };
    Tensor qv = rows(q, H * D);
    if (qr > 0) {
      Tensor ql = rows(keep.q_lat, qr), qn = rows(keep.q_lat_n, qr);
      be().matmul_forward(ql, x, w.q_down_w, nullptr);
      if (spec_.qk_norm) {
        Tensor mean = stats(keep.q_mean), rstd = stats(keep.q_rstd);
        s().norm_forward(qn, mean, rstd, ql, w.q_down_norm_w, w.q_down_norm_b);
      }
      be().matmul_forward(qv, qn, w.q_up_w, nullptr);
    } else {
      be().matmul_forward(qv, x, w.q_up_w, nullptr);
    }
    if (const double f = cfg_.yarn_softmax_factor(); f != 1.0)
      be().scale(qv, static_cast<float>(f));
    Tensor c = rows(keep.c, kvr), cn = rows(keep.c_n, kvr), kpe = rows(keep.k_pe, dr);
    be().matmul_forward(c, x, w.kv_down_w.view(0, {kvr, C}), nullptr);
    be().matmul_forward(kpe, x, w.kv_down_w.view(kvr * C, {dr, C}), nullptr);
    if (spec_.qk_norm) {
      Tensor mean = stats(keep.c_mean), rstd = stats(keep.c_rstd);
      s().norm_forward(cn, mean, rstd, c, w.kv_down_norm_w, w.kv_down_norm_b);
    }
    Tensor kvv = rows(kv, H * (dn + dv));
    be().matmul_forward(kvv, cn, w.kv_up_w, nullptr);
    Tensor out = qkv.reshape({n, 3 * H * D});
    be().zero(out);                                                       // the values' padding
    be().copy_column_blocks(out, 0, D, qv, dn, D, dr, H);                 // queries' RoPE part
    be().copy_column_blocks(out, dr, D, qv, 0, D, dn, H);                 // and the rest
    be().copy_column_blocks(out, H * D, D, kpe, 0, 0, dr, H);             // the shared RoPE key
    be().copy_column_blocks(out, H * D + dr, D, kvv, 0, dn + dv, dn, H);  // keys without position
    be().copy_column_blocks(out, 2 * H * D, D, kvv, dn, dn + dv, dv, H);  // values
  }

  void values(Tensor& att_v, const Tensor& att) const {
    const int64_t H = heads_local(), D = cfg_.head_dim(), dv = cfg_.v_head_dim;
    const int64_t n = att.numel() / (H * D);
    Tensor v = att_v.view(0, {n, H * dv});
    be().copy_column_blocks(v, 0, dv, att.reshape({n, H * D}), 0, D, dv, H);
  }

  void expand(Tensor& datt, const Tensor& datt_v) const {
    const int64_t H = heads_local(), D = cfg_.head_dim(), dv = cfg_.v_head_dim;
    const int64_t n = datt.numel() / (H * D);
    Tensor d = datt.reshape({n, H * D});
    be().zero(d);  // the padded values' outputs carry no gradient
    be().copy_column_blocks(d, 0, D, datt_v, 0, dv, dv, H);
  }

  void qkv_backward(Activations& a, LayerActivations& la) {
    const Weights& w = w_;
    Weights& g = g_;
    const MlaBuffers& m = la.parts.get<MlaBuffers>();
    MlaScratch& sc = a.part_scratch.get<MlaScratch>();
    const int64_t C = cfg_.hidden_size, n = int64_t(a.B) * a.T, H = heads_local();
    const int64_t D = cfg_.head_dim(), dn = cfg_.qk_head_dim, dr = cfg_.qk_pos_emb_head_dim;
    const int64_t dv = cfg_.v_head_dim, qr = cfg_.q_lora_rank, kvr = cfg_.kv_lora_rank;
    const Tensor rows = a.dqkv.reshape({n, 3 * H * D});
    // The queries' gradient in the up-projection's order ([without position | RoPE part] per head),
    // times the softmax factor the forward applied.
    Tensor dq = sc.q.view(0, {n, H * D});
    be().copy_column_blocks(dq, dn, D, rows, 0, D, dr, H);
    be().copy_column_blocks(dq, 0, D, rows, dr, D, dn, H);
    if (const double f = cfg_.yarn_softmax_factor(); f != 1.0)
      be().scale(dq, static_cast<float>(f));
    // The keys' (without position) and values' gradient per head, and the shared RoPE key's: the
    // sum of every head's.
    Tensor dkv = sc.kv.view(0, {n, H * (dn + dv)});
    be().copy_column_blocks(dkv, 0, dn + dv, rows, H * D + dr, D, dn, H);
    be().copy_column_blocks(dkv, dn, dn + dv, rows, 2 * H * D, D, dv, H);
    Tensor dkpe = sc.dk_pe, tmp = sc.tmp_pe;
    be().zero(dkpe);
    for (int64_t h = 0; h < H; ++h) {
      be().copy_columns(tmp, 0, rows, H * D + h * D, dr);
      be().add(dkpe, dkpe, tmp);
    }
    // Keys and values: the up-projection, the latent's norm, the down-projection (its two row
    // blocks: the latent and the RoPE key).
    Tensor dcn = sc.dc_n;
    s().gemm_backward(&dcn, g.kv_up_w, nullptr, dkv, m.c_n, w.kv_up_w);
    Tensor dc = dcn;
    if (spec_.qk_norm) {
      dc = sc.dc;
      be().zero(dc);  // the norm's backward accumulates
      s().norm_backward(dc, g.kv_down_norm_w, g.kv_down_norm_b, dcn, m.c, w.kv_down_norm_w,
                        m.c_mean, m.c_rstd);
    }
    Tensor gc = g.kv_down_w.view(0, {kvr, C}), gpe = g.kv_down_w.view(kvr * C, {dr, C});
    s().gemm_backward(&a.dln, gc, nullptr, dc, la.ln1, w.kv_down_w.view(0, {kvr, C}));
    s().gemm_backward(&sc.dln, gpe, nullptr, dkpe, la.ln1, w.kv_down_w.view(kvr * C, {dr, C}));
    be().add(a.dln, a.dln, sc.dln);
    // Queries: the up-projection, the latent's norm, the down-projection (or the one projection).
    if (qr > 0) {
      Tensor dqn = sc.dq_n;
      s().gemm_backward(&dqn, g.q_up_w, nullptr, dq, m.q_lat_n, w.q_up_w);
      Tensor dql = dqn;
      if (spec_.qk_norm) {
        dql = sc.dq_lat;
        be().zero(dql);
        s().norm_backward(dql, g.q_down_norm_w, g.q_down_norm_b, dqn, m.q_lat, w.q_down_norm_w,
                          m.q_mean, m.q_rstd);
      }
      s().gemm_backward(&sc.dln, g.q_down_w, nullptr, dql, la.ln1, w.q_down_w);
    } else {
      s().gemm_backward(&sc.dln, g.q_up_w, nullptr, dq, la.ln1, w.q_up_w);
    }
    be().add(a.dln, a.dln, sc.dln);
  }
};

}  // namespace

std::unique_ptr<AttentionPart> make_mla_attention(const LayerSpec& spec, const GPTConfig& cfg,
                                                  const ModelShard& shard, PartServices* services) {
  return std::make_unique<MlaAttention>(cfg, shard, spec, services);
}

}  // namespace tessera
