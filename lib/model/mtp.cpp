// mtp.cpp: multi-token prediction (DeepSeek-V3, Megatron-Core's MTP; docs/model.md) of GPTModel,
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
#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"
#include "model/gpt.hpp"

namespace tessera {

namespace {

// Multi-token prediction's per-step state: each attempt sums its depths' losses again.
class MtpHook final : public StepHook {
 public:
  explicit MtpHook(GPTModel& m) : m_(m) {}
  void begin_attempt(bool) override { m_.reset_mtp_losses(); }
  void end_step(Communicator*) override {}

 private:
  GPTModel& m_;
};

}  // namespace

void GPTModel::init_mtp() {
  if (shard_.mtp_count > 0) mtp_hook_ = std::make_unique<MtpHook>(*this);
}

void GPTModel::reset_mtp_losses() {
  for (MtpLoss& m : mtp_losses_) m = MtpLoss{};
}

void GPTModel::embed_rows(PhaseSequence& phase, Tensor& out, const Tensor& ids, Activations& a) {
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  const Tensor wte = params_->compute_param("wte");
  if (sp_) {  // each rank's vocabulary rows, summed and scattered by rows
    Tensor full = a.tmp_c;
    be_.embedding_forward(full, ids, wte, vocab_begin_);
    const Tensor mine = reduce_rows(phase, full, a);
    be_.cast(out, mine);
  } else {
    Tensor x = out.reshape({N, C});
    be_.embedding_forward(x, ids, wte, vocab_begin_);
    tp_.all_reduce(out, ReduceOp::Sum);
  }
}

void GPTModel::set_mtp_inputs(Activations& a, int depth, const int32_t* ids,
                              const int32_t* targets) {
  MtpActivations& m = a.mtp[static_cast<size_t>(depth)];
  be_.copy_from_host(m.ids, ids);
  be_.copy_from_host(m.targets, targets);
  m.tokens = 0;
  for (int64_t i = 0; i < m.targets.numel(); ++i) m.tokens += targets[i] >= 0;
  a.mtp_staged = true;
}

void GPTModel::mtp_prepare(Activations& a) {
  // The tokens and targets shifted by k + 1 within each sample, from the micro-batch's own.
  const int64_t B = a.B, T = a.T, N = B * T;
  TESSERA_CHECK(shard_.cp_size == 1, "multi-token prediction with context parallelism");
  std::vector<int32_t> ids(static_cast<size_t>(N)), tg(ids.size()), ik(ids.size()), tk(ids.size());
  be_.copy_to_host(ids.data(), a.ids);
  be_.copy_to_host(tg.data(), a.targets);
  for (int k = 0; k < shard_.mtp_count; ++k) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t q = t + k + 1, i = b * T + t;
        ik[static_cast<size_t>(i)] = q < T ? ids[static_cast<size_t>(b * T + q)] : 0;
        tk[static_cast<size_t>(i)] = q < T ? tg[static_cast<size_t>(b * T + q)] : -1;
      }
    set_mtp_inputs(a, k, ik.data(), tk.data());
  }
}

void GPTModel::mtp_forward(Activations& a, float grad_scale) {
  NVTX_RANGE("mtp-forward");
  PhaseSequence phase;
  const int64_t C = cfg_.hidden_size;
  const float scale =
      static_cast<float>(grad_scale * cfg_.mtp_loss_scaling_factor / cfg_.mtp_num_layers);
  auto P = [&](const std::string& n) {
    return params_->has(n) ? params_->compute_param(n) : Tensor();
  };
  const Tensor head = params_->compute_param(output_weight_name());
  Tensor h_prev = stage_output(a);
  for (int k = 0; k < shard_.mtp_count; ++k) {
    MtpActivations& m = a.mtp[static_cast<size_t>(k)];
    const int l = shard_.mtp_begin + k;
    const std::string p = "mtp." + std::to_string(k) + ".";
    phase("mtp-embedding");
    embed_rows(phase, m.emb, m.ids, a);
    phase("layernorm-forward");
    norm_forward(m.e_n, m.e_mean, m.e_rstd, m.emb, P(p + "enorm.weight"), P(p + "enorm.bias"));
    norm_forward(m.h_n, m.h_mean, m.h_rstd, h_prev, P(p + "hnorm.weight"), P(p + "hnorm.bias"));
    phase("mtp-projection");
    const int64_t rows = m.cat.dim(0);
    be_.copy_columns(m.cat, 0, m.e_n.reshape({rows, C}), 0, C);
    be_.copy_columns(m.cat, C, m.h_n.reshape({rows, C}), 0, C);
    Tensor x = m.x.reshape({rows, C});
    be_.matmul_forward(x, m.cat, P(p + "eh_proj.weight"), nullptr);
    block_forward(l, a);
    h_prev = acts_of(l, a).res2;
    phase("layernorm-forward");
    Tensor lnf = own_rows(m.lnf, a);
    norm_forward(lnf, m.lnf_mean, m.lnf_rstd, h_prev, P(p + "final_norm.weight"),
                 P(p + "final_norm.bias"));
    gather_rows(phase, m.lnf);
    phase("lm-head-gemm-forward");
    be_.matmul_forward(m.logits, m.lnf, head, nullptr);
    phase("cross-entropy");
    cross_entropy(m.losses, m.logits, m.targets, a, scale);
    mtp_host_.resize(static_cast<size_t>(m.losses.numel()));
    be_.copy_to_host(mtp_host_.data(), m.losses);
    double sum = 0;  // in token order, in double: the same on every layout
    for (float v : mtp_host_) sum += v;
    mtp_losses_[static_cast<size_t>(k)].sum += sum;
    mtp_losses_[static_cast<size_t>(k)].tokens += m.tokens;
  }
  a.mtp_staged = false;  // the next micro-batch in this slot stages its own
}

void GPTModel::mtp_backward(Activations& a) {
  NVTX_RANGE("mtp-backward");
  PhaseSequence phase;
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size;
  auto W = [&](const std::string& n) {
    return params_->has(n) ? params_->compute_param(n) : Tensor();
  };
  auto G = [&](const std::string& n) { return params_->has(n) ? params_->grad(n) : Tensor(); };
  const Tensor head = params_->compute_param(output_weight_name());
  Tensor dhead = params_->grad(output_weight_name()), dwte = params_->grad("wte");
  be_.cast(a.mtp_dmain, a.dres);  // the main head's gradient of the main hidden state
  be_.zero(a.mtp_dh);             // the deepest depth's output gets none from deeper
  for (int k = shard_.mtp_count - 1; k >= 0; --k) {
    MtpActivations& m = a.mtp[static_cast<size_t>(k)];
    const int l = shard_.mtp_begin + k;
    const std::string p = "mtp." + std::to_string(k) + ".";
    const Tensor& h_out = acts_of(l, a).res2;
    const Tensor& h_in = k == 0 ? stage_output(a) : acts_of(l - 1, a).res2;
    // The output layer and the final norm: into the chain's gradient of the depth's output.
    phase("lm-head-gemm-backward");
    be_.matmul_backward(&a.dln, dhead, nullptr, m.logits, m.lnf, head);
    const Tensor dlnf = reduce_rows(phase, a.dln, a);
    phase("layernorm-backward");
    be_.cast(a.dres, a.mtp_dh);
    Tensor gw = G(p + "final_norm.weight"), gb = G(p + "final_norm.bias");
    norm_backward(a.dres, gw, gb, dlnf, h_out, W(p + "final_norm.weight"), m.lnf_mean, m.lnf_rstd);
    block_backward(l, a);  // a.dres: now the gradient of the depth's layer input
    phase("mtp-projection");
    const int64_t rows = m.cat.dim(0);
    Tensor gp = G(p + "eh_proj.weight");
    be_.matmul_backward(&a.mtp_dcat, gp, nullptr, a.dres.reshape({rows, C}), m.cat,
                        W(p + "eh_proj.weight"));
    be_.copy_columns(a.mtp_de, 0, a.mtp_dcat, 0, C);
    be_.copy_columns(a.mtp_dhn, 0, a.mtp_dcat, C, C);
    phase("layernorm-backward");
    be_.zero(a.mtp_dh);  // the previous depth's (or the main) hidden state's gradient
    Tensor dh = a.mtp_dh.reshape({rows, C});
    gw = G(p + "hnorm.weight");
    gb = G(p + "hnorm.bias");
    norm_backward(dh, gw, gb, a.mtp_dhn, h_in, W(p + "hnorm.weight"), m.h_mean, m.h_rstd);
    Tensor demb = own_rows(a.mtp_demb, a);
    be_.zero(demb);
    gw = G(p + "enorm.weight");
    gb = G(p + "enorm.bias");
    norm_backward(demb, gw, gb, a.mtp_de, m.emb, W(p + "enorm.weight"), m.e_mean, m.e_rstd);
    gather_rows(phase, a.mtp_demb);  // every row: each TP rank scatters into its vocabulary rows
    phase("embedding-backward");
    be_.embedding_backward(dwte, a.mtp_demb.reshape({N, C}), m.ids, vocab_begin_);
  }
  be_.add(a.dres, a.mtp_dmain, a.mtp_dh);
}

}  // namespace tessera
