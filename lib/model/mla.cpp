// mla.cpp: multi-latent attention (DeepSeek-V2/V3, Megatron-Core's MLA; docs/model.md) of
// GPTModel, on this rank's Hl heads of hd = qk_head_dim + qk_pos_emb_head_dim features.
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
// replicated weights' gradients once per step (reduce_sequence_parallel_grads).
#include "core/phase_timer.hpp"
#include "model/gpt.hpp"

namespace tessera {

void GPTModel::mla_qkv_forward(Tensor& qkv, const Tensor& ln, const LayerWeights& w,
                               MlaTensors& keep, Tensor& q, Tensor& kv) {
  const int64_t C = cfg_.hidden_size, n = ln.numel() / C, H = heads_local_, D = cfg_.head_dim();
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
    be_.matmul_forward(ql, x, w.q_down_w, nullptr);
    if (cfg_.qk_layernorm) {
      Tensor mean = stats(keep.q_mean), rstd = stats(keep.q_rstd);
      norm_forward(qn, mean, rstd, ql, w.q_down_norm_w, w.q_down_norm_b);
    }
    be_.matmul_forward(qv, qn, w.q_up_w, nullptr);
  } else {
    be_.matmul_forward(qv, x, w.q_up_w, nullptr);
  }
  if (const double f = cfg_.yarn_softmax_factor(); f != 1.0) be_.scale(qv, static_cast<float>(f));
  Tensor c = rows(keep.c, kvr), cn = rows(keep.c_n, kvr), kpe = rows(keep.k_pe, dr);
  be_.matmul_forward(c, x, w.kv_down_w.view(0, {kvr, C}), nullptr);
  be_.matmul_forward(kpe, x, w.kv_down_w.view(kvr * C, {dr, C}), nullptr);
  if (cfg_.qk_layernorm) {
    Tensor mean = stats(keep.c_mean), rstd = stats(keep.c_rstd);
    norm_forward(cn, mean, rstd, c, w.kv_down_norm_w, w.kv_down_norm_b);
  }
  Tensor kvv = rows(kv, H * (dn + dv));
  be_.matmul_forward(kvv, cn, w.kv_up_w, nullptr);
  Tensor out = qkv.reshape({n, 3 * H * D});
  be_.zero(out);                                                       // the values' padding
  be_.copy_column_blocks(out, 0, D, qv, dn, D, dr, H);                 // queries' RoPE part
  be_.copy_column_blocks(out, dr, D, qv, 0, D, dn, H);                 // and the rest
  be_.copy_column_blocks(out, H * D, D, kpe, 0, 0, dr, H);             // the shared RoPE key
  be_.copy_column_blocks(out, H * D + dr, D, kvv, 0, dn + dv, dn, H);  // keys without position
  be_.copy_column_blocks(out, 2 * H * D, D, kvv, dn, dn + dv, dv, H);  // values
}

void GPTModel::mla_values(Tensor& att_v, const Tensor& att) {
  const int64_t H = heads_local_, D = cfg_.head_dim(), dv = cfg_.v_head_dim;
  const int64_t n = att.numel() / (H * D);
  Tensor v = att_v.view(0, {n, H * dv});
  be_.copy_column_blocks(v, 0, dv, att.reshape({n, H * D}), 0, D, dv, H);
}

void GPTModel::mla_expand(Tensor& datt, const Tensor& datt_v) {
  const int64_t H = heads_local_, D = cfg_.head_dim(), dv = cfg_.v_head_dim;
  const int64_t n = datt.numel() / (H * D);
  Tensor d = datt.reshape({n, H * D});
  be_.zero(d);  // the padded values' outputs carry no gradient
  be_.copy_column_blocks(d, 0, D, datt_v, 0, dv, dv, H);
}

void GPTModel::mla_qkv_backward(int l, Activations& a, LayerActivations& la) {
  const int li = shard_.local_index(l);
  const LayerWeights& w = weights_[static_cast<size_t>(li)];
  LayerWeights& g = grads_[static_cast<size_t>(li)];
  const MlaTensors& m = la.mla;
  const int64_t C = cfg_.hidden_size, n = int64_t(a.B) * a.T, H = heads_local_;
  const int64_t D = cfg_.head_dim(), dn = cfg_.qk_head_dim, dr = cfg_.qk_pos_emb_head_dim;
  const int64_t dv = cfg_.v_head_dim, qr = cfg_.q_lora_rank, kvr = cfg_.kv_lora_rank;
  const Tensor rows = a.dqkv.reshape({n, 3 * H * D});
  // The queries' gradient in the up-projection's order ([without position | RoPE part] per head),
  // times the softmax factor the forward applied.
  Tensor dq = a.mla_q.view(0, {n, H * D});
  be_.copy_column_blocks(dq, dn, D, rows, 0, D, dr, H);
  be_.copy_column_blocks(dq, 0, D, rows, dr, D, dn, H);
  if (const double f = cfg_.yarn_softmax_factor(); f != 1.0) be_.scale(dq, static_cast<float>(f));
  // The keys' (without position) and values' gradient per head, and the shared RoPE key's: the
  // sum of every head's.
  Tensor dkv = a.mla_kv.view(0, {n, H * (dn + dv)});
  be_.copy_column_blocks(dkv, 0, dn + dv, rows, H * D + dr, D, dn, H);
  be_.copy_column_blocks(dkv, dn, dn + dv, rows, 2 * H * D, D, dv, H);
  Tensor dkpe = a.mla_dk_pe, tmp = a.mla_tmp_pe;
  be_.zero(dkpe);
  for (int64_t h = 0; h < H; ++h) {
    be_.copy_columns(tmp, 0, rows, H * D + h * D, dr);
    be_.add(dkpe, dkpe, tmp);
  }
  // Keys and values: the up-projection, the latent's norm, the down-projection (its two row
  // blocks: the latent and the RoPE key).
  Tensor dcn = a.mla_dc_n;
  be_.matmul_backward(&dcn, g.kv_up_w, nullptr, dkv, m.c_n, w.kv_up_w);
  Tensor dc = dcn;
  if (cfg_.qk_layernorm) {
    dc = a.mla_dc;
    be_.zero(dc);  // the norm's backward accumulates
    norm_backward(dc, g.kv_down_norm_w, g.kv_down_norm_b, dcn, m.c, w.kv_down_norm_w, m.c_mean,
                  m.c_rstd);
  }
  Tensor gc = g.kv_down_w.view(0, {kvr, C}), gpe = g.kv_down_w.view(kvr * C, {dr, C});
  be_.matmul_backward(&a.dln, gc, nullptr, dc, la.ln1, w.kv_down_w.view(0, {kvr, C}));
  be_.matmul_backward(&a.mla_dln, gpe, nullptr, dkpe, la.ln1, w.kv_down_w.view(kvr * C, {dr, C}));
  be_.add(a.dln, a.dln, a.mla_dln);
  // Queries: the up-projection, the latent's norm, the down-projection (or the one projection).
  if (qr > 0) {
    Tensor dqn = a.mla_dq_n;
    be_.matmul_backward(&dqn, g.q_up_w, nullptr, dq, m.q_lat_n, w.q_up_w);
    Tensor dql = dqn;
    if (cfg_.qk_layernorm) {
      dql = a.mla_dq_lat;
      be_.zero(dql);
      norm_backward(dql, g.q_down_norm_w, g.q_down_norm_b, dqn, m.q_lat, w.q_down_norm_w, m.q_mean,
                    m.q_rstd);
    }
    be_.matmul_backward(&a.mla_dln, g.q_down_w, nullptr, dql, la.ln1, w.q_down_w);
  } else {
    be_.matmul_backward(&a.mla_dln, g.q_up_w, nullptr, dq, la.ln1, w.q_up_w);
  }
  be_.add(a.dln, a.dln, a.mla_dln);
}

}  // namespace tessera
