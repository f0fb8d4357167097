// mtp.cpp: multi-token prediction (DeepSeek-V3, Megatron-Core's MTP; docs/model.md; model/mtp.hpp),
// run by the head piece of the last stage on training micro-batches.
//
// Depth k (0-based here, k + 1 in the logs) predicts the token k + 2 positions ahead of each
// position p: the embedding of the token at p + k + 1 and the previous depth's hidden state (the
// main model's last layer output for k = 0), each through its norm, concatenated ([embedding |
// hidden]) and projected back to the hidden width (eh_proj, replicated over TP: every row is its
// own), run through the depth's transformer layer (layer num_layers + k, block_forward as any
// other), its final norm and the shared output layer; the cross-entropy against the target at
// p + k + 1 (the main targets shifted by k + 1: none past the sample's end or where the main one
// has none), with the weight mtp_loss_scaling_factor / D. The backward runs the depths deepest
// first, each adding its hidden-state gradient to the previous depth's, the last to the main
// hidden state's (a.dres), and the embedding gradients to the last stage's copy of wte.
#include "model/mtp.hpp"

#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"

namespace tessera {

MtpHead::MtpHead(const GPTConfig& cfg, const ModelShard& shard, PartServices& services,
                 const ParamStore& params)
    : cfg_(cfg), shard_(shard), s_(services), params_(params) {
  losses_.assign(static_cast<size_t>(shard_.mtp_count), Loss{});
}

void MtpHead::add_params(ParamSpecBuilder& b) {
  const int64_t h = b.cfg.hidden_size;
  for (int k = 0; k < b.shard.mtp_count; ++k) {
    const std::string m = "mtp." + std::to_string(k) + ".";
    b.norm(m + "enorm", h);
    b.norm(m + "hnorm", h);
    b.add(m + "eh_proj.weight", {h, 2 * h}, -1, ParamInit::Normal, b.cfg.init_method_std, true);
    b.norm(m + "final_norm", h);
  }
}

Tensor MtpHead::weight(const std::string& n) const {
  return params_.has(n) ? params_.compute_param(n) : Tensor();
}

Tensor MtpHead::grad(const std::string& n) const {
  return params_.has(n) ? params_.grad(n) : Tensor();
}

void MtpHead::reduce_tp_grads() {
  if (!s_.sequence_parallel()) return;
  // Its norms and projection saw this rank's rows.
  TESSERA_PHASE("sp-grad-all-reduce");
  for (int k = 0; k < shard_.mtp_count; ++k)
    for (const char* n : {"enorm.weight", "enorm.bias", "hnorm.weight", "hnorm.bias",
                          "eh_proj.weight", "final_norm.weight", "final_norm.bias"}) {
      const std::string name = "mtp." + std::to_string(k) + "." + n;
      if (!params_.has(name)) continue;
      Tensor g = params_.grad(name);
      s_.tp().all_reduce(g, ReduceOp::Sum);
    }
}

void MtpHead::embed_rows(PhaseSequence& phase, Tensor& out, const Tensor& ids, Activations& a) {
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  const Tensor wte = params_.compute_param("wte");
  if (s_.sequence_parallel()) {  // each rank's vocabulary rows, summed and scattered by rows
    Tensor full = a.tmp_c;
    s_.backend().embedding_forward(full, ids, wte, s_.vocab_begin());
    const Tensor mine = s_.reduce_rows(phase, full, a);
    s_.backend().cast(out, mine);
  } else {
    Tensor x = out.reshape({N, C});
    s_.backend().embedding_forward(x, ids, wte, s_.vocab_begin());
    s_.tp().all_reduce(out, ReduceOp::Sum);
  }
}

void MtpHead::set_inputs(Activations& a, int depth, const int32_t* ids, const int32_t* targets) {
  MtpActivations& m = a.mtp[static_cast<size_t>(depth)];
  s_.backend().copy_from_host(m.ids, ids);
  s_.backend().copy_from_host(m.targets, targets);
  m.tokens = 0;
  for (int64_t i = 0; i < m.targets.numel(); ++i) m.tokens += targets[i] >= 0;
  a.mtp_staged = true;
}

void MtpHead::prepare(Activations& a) {
  // The tokens and targets shifted by k + 1 within each sample, from the micro-batch's own.
  const int64_t B = a.B, T = a.T, N = B * T;
  TESSERA_CHECK(shard_.cp_size == 1, "multi-token prediction with context parallelism");
  std::vector<int32_t> ids(static_cast<size_t>(N)), tg(ids.size()), ik(ids.size()), tk(ids.size());
  s_.backend().copy_to_host(ids.data(), a.ids);
  s_.backend().copy_to_host(tg.data(), a.targets);
  for (int k = 0; k < shard_.mtp_count; ++k) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t q = t + k + 1, i = b * T + t;
        ik[static_cast<size_t>(i)] = q < T ? ids[static_cast<size_t>(b * T + q)] : 0;
        tk[static_cast<size_t>(i)] = q < T ? tg[static_cast<size_t>(b * T + q)] : -1;
      }
    set_inputs(a, k, ik.data(), tk.data());
  }
}

void MtpHead::forward(Activations& a, float grad_scale, const Tensor& hidden,
                      const BlockPass& block) {
  if (!a.mtp_staged) prepare(a);  // no inputs set for this micro-batch: its own ids shifted
  NVTX_RANGE("mtp-forward");
  PhaseSequence phase;
  const int64_t C = cfg_.hidden_size;
  const float scale =
      static_cast<float>(grad_scale * cfg_.mtp_loss_scaling_factor / cfg_.mtp_num_layers);
  auto P = [&](const std::string& n) { return weight(n); };
  const Tensor head = params_.compute_param(output_weight());
  Tensor h_prev = hidden;
  for (int k = 0; k < shard_.mtp_count; ++k) {
    MtpActivations& m = a.mtp[static_cast<size_t>(k)];
    const int l = shard_.mtp_begin + k;
    const std::string p = "mtp." + std::to_string(k) + ".";
    phase("mtp-embedding");
    embed_rows(phase, m.emb, m.ids, a);
    phase("layernorm-forward");
    s_.norm_forward(m.e_n, m.e_mean, m.e_rstd, m.emb, P(p + "enorm.weight"), P(p + "enorm.bias"));
    s_.norm_forward(m.h_n, m.h_mean, m.h_rstd, h_prev, P(p + "hnorm.weight"), P(p + "hnorm.bias"));
    phase("mtp-projection");
    const int64_t rows = m.cat.dim(0);
    s_.backend().copy_columns(m.cat, 0, m.e_n.reshape({rows, C}), 0, C);
    s_.backend().copy_columns(m.cat, C, m.h_n.reshape({rows, C}), 0, C);
    Tensor x = m.x.reshape({rows, C});
    s_.backend().matmul_forward(x, m.cat, P(p + "eh_proj.weight"), nullptr);
    block(l, a);
    h_prev = s_.acts(l, a).res2;
    phase("layernorm-forward");
    Tensor lnf = s_.own_rows(m.lnf, a);
    s_.norm_forward(lnf, m.lnf_mean, m.lnf_rstd, h_prev, P(p + "final_norm.weight"),
                    P(p + "final_norm.bias"));
    s_.gather_rows(phase, m.lnf);
    phase("lm-head-gemm-forward");
    s_.backend().matmul_forward(m.logits, m.lnf, head, nullptr);
    phase("cross-entropy");
    s_.cross_entropy(m.losses, m.logits, m.targets, a, scale);
    host_.resize(static_cast<size_t>(m.losses.numel()));
    s_.backend().copy_to_host(host_.data(), m.losses);
    double sum = 0;  // in token order, in double: the same on every layout
    for (float v : host_) sum += v;
    losses_[static_cast<size_t>(k)].sum += sum;
    losses_[static_cast<size_t>(k)].tokens += m.tokens;
  }
  a.mtp_staged = false;  // the next micro-batch in this slot stages its own
}

void MtpHead::backward(Activations& a, const Tensor& hidden, const BlockPass& block) {
  NVTX_RANGE("mtp-backward");
  PhaseSequence phase;
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  auto W = [&](const std::string& n) { return weight(n); };
  auto G = [&](const std::string& n) { return grad(n); };
  const Tensor head = params_.compute_param(output_weight());
  Tensor dhead = params_.grad(output_weight()), dwte = params_.grad("wte");
  s_.backend().cast(a.mtp_dmain, a.dres);  // the main head's gradient of the main hidden state
  s_.backend().zero(a.mtp_dh);             // the deepest depth's output gets none from deeper
  for (int k = shard_.mtp_count - 1; k >= 0; --k) {
    MtpActivations& m = a.mtp[static_cast<size_t>(k)];
    const int l = shard_.mtp_begin + k;
    const std::string p = "mtp." + std::to_string(k) + ".";
    const Tensor& h_out = s_.acts(l, a).res2;
    const Tensor& h_in = k == 0 ? hidden : s_.acts(l - 1, a).res2;
    // The output layer and the final norm: into the chain's gradient of the depth's output.
    phase("lm-head-gemm-backward");
    s_.gemm_backward(&a.dln, dhead, nullptr, m.logits, m.lnf, head);
    const Tensor dlnf = s_.reduce_rows(phase, a.dln, a);
    phase("layernorm-backward");
    s_.backend().cast(a.dres, a.mtp_dh);
    Tensor gw = G(p + "final_norm.weight"), gb = G(p + "final_norm.bias");
    s_.norm_backward(a.dres, gw, gb, dlnf, h_out, W(p + "final_norm.weight"), m.lnf_mean,
                     m.lnf_rstd);
    block(l, a);  // a.dres: now the gradient of the depth's layer input
    phase("mtp-projection");
    const int64_t rows = m.cat.dim(0);
    Tensor gp = G(p + "eh_proj.weight");
    s_.gemm_backward(&a.mtp_dcat, gp, nullptr, a.dres.reshape({rows, C}), m.cat,
                     W(p + "eh_proj.weight"));
    s_.backend().copy_columns(a.mtp_de, 0, a.mtp_dcat, 0, C);
    s_.backend().copy_columns(a.mtp_dhn, 0, a.mtp_dcat, C, C);
    phase("layernorm-backward");
    s_.backend().zero(a.mtp_dh);  // the previous depth's (or the main) hidden state's gradient
    Tensor dh = a.mtp_dh.reshape({rows, C});
    gw = G(p + "hnorm.weight");
    gb = G(p + "hnorm.bias");
    s_.norm_backward(dh, gw, gb, a.mtp_dhn, h_in, W(p + "hnorm.weight"), m.h_mean, m.h_rstd);
    Tensor demb = s_.own_rows(a.mtp_demb, a);
    s_.backend().zero(demb);
    gw = G(p + "enorm.weight");
    gb = G(p + "enorm.bias");
    s_.norm_backward(demb, gw, gb, a.mtp_de, m.emb, W(p + "enorm.weight"), m.e_mean, m.e_rstd);
    s_.gather_rows(phase, a.mtp_demb);  // every row: each TP rank scatters into its vocabulary rows
    phase("embedding-backward");
    s_.embedding_grad(dwte, a.mtp_demb.reshape({N, C}), m.ids, s_.vocab_begin());
  }
  s_.backend().add(a.dres, a.mtp_dmain, a.mtp_dh);
}

}  // namespace tessera
