// mlp.cpp: the dense MLP as a part of a layer (model/mlp.hpp): column-parallel fc1, the
// activation (GELU, SwiGLU's gate * up, or squared ReLU), row-parallel fc2. A MoE layer's experts
// and shared expert reuse its parameters, weights and buffers (model/moe.hpp).
#include "model/mlp.hpp"

#include "core/phase_timer.hpp"
#include "model/slots.hpp"

namespace tessera {

void mlp_activation_forward(Backend& be, MlpActivation kind, Tensor& out, const Tensor& fc1) {
  switch (kind) {
    case MlpActivation::SwiGLU:
      be.swiglu_forward(out, fc1);
      break;
    case MlpActivation::SquaredRelu:
      be.squared_relu_forward(out, fc1);
      break;
    case MlpActivation::Gelu:
      be.gelu_forward(out, fc1);
      break;
  }
}

const char* mlp_activation_phase(MlpActivation kind, bool backward) {
  switch (kind) {
    case MlpActivation::SwiGLU:
      return backward ? "swiglu-backward" : "swiglu-forward";
    case MlpActivation::SquaredRelu:
      return backward ? "squared-relu-backward" : "squared-relu-forward";
    case MlpActivation::Gelu:
      break;
  }
  return backward ? "gelu-backward" : "gelu-forward";
}

Tensor& mlp_activation_backward(Backend& be, MlpActivation kind, Tensor& dact, Tensor& dfc1_swiglu,
                                const Tensor& fc1) {
  switch (kind) {
    case MlpActivation::SwiGLU:
      be.swiglu_backward(dfc1_swiglu, fc1, dact);
      return dfc1_swiglu;
    case MlpActivation::SquaredRelu:
      be.squared_relu_backward(dact, fc1, dact);
      return dact;
    case MlpActivation::Gelu:
      be.gelu_backward(dact, fc1, dact);
      return dact;
  }
  return dact;
}

MlpWeights dense_mlp_bind(const ParamStore& ps, int l, bool grads, const std::string& prefix) {
  MlpWeights w;
  w.fc1_w = ModelPart::param(ps, l, prefix + "fc1.weight", grads);
  w.fc1_b = ModelPart::param(ps, l, prefix + "fc1.bias", grads);
  w.fc2_w = ModelPart::param(ps, l, prefix + "fc2.weight", grads);
  w.fc2_b = ModelPart::param(ps, l, prefix + "fc2.bias", grads);
  return w;
}

void dense_mlp_params(ParamSpecBuilder& b, const std::string& m, int64_t w, MlpActivation act) {
  const int64_t h = b.cfg.hidden_size;
  const double std = b.cfg.init_method_std;
  const bool bias = b.cfg.add_bias_linear;
  if (act == MlpActivation::SwiGLU) {  // [gate; up], each split over TP: a rank holds its columns
    b.add(m + "fc1.weight", {2, w, h}, 1, ParamInit::Normal, std, true);
    if (bias) b.add(m + "fc1.bias", {2, w}, 1, ParamInit::Zeros, 0, false);
  } else {
    b.add(m + "fc1.weight", {w, h}, 0, ParamInit::Normal, std, true);
    if (bias) b.add(m + "fc1.bias", {w}, 0, ParamInit::Zeros, 0, false);
  }
  b.add(m + "fc2.weight", {h, w}, 1, ParamInit::Normal, b.out_std(), true);
  if (bias) b.add(m + "fc2.bias", {h}, -1, ParamInit::Zeros, 0, false);
}

void dense_mlp_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width,
                       MlpActivation act, bool kept) {
  if (width <= 0) return;
  const int64_t glu = act == MlpActivation::SwiGLU ? 2 : 1;
  if (kept && !la.fc1.defined()) la.fc1 = sb.f({sb.N, glu * width});  // SwiGLU: gate and up
  if (!kept && !la.gelu.defined()) la.gelu = sb.f({sb.N, width});
}

void dense_mlp_shared(const SlotBuilder& sb, Activations& shared, MlpActivation act) {
  if (sb.inference || sb.fl_max <= 0 || shared.dfc.defined()) return;  // the backward's
  shared.dfc = sb.f({sb.N, sb.fl_max});
  if (act == MlpActivation::SwiGLU) shared.dfc1 = sb.f({sb.N, 2 * sb.fl_max});
}

void dense_mlp_fit(const SlotBuilder& sb, LayerActivations& la, int64_t width, MlpActivation act) {
  const int64_t glu = act == MlpActivation::SwiGLU ? 2 : 1;
  la.gelu = width > 0 && la.gelu.defined() ? la.gelu.view(0, {sb.N, width}) : Tensor();
  la.fc1 = width > 0 && la.fc1.defined() ? la.fc1.view(0, {sb.N, glu * width}) : Tensor();
}

void DenseMlp::add_params(ParamSpecBuilder& b, int l) const {
  dense_mlp_params(b, "layers." + std::to_string(l) + "." + prefix_, spec_.dense_width,
                   spec_.activation);
}

void DenseMlp::bind(const ParamStore& ps, int l) {
  w_ = dense_mlp_bind(ps, l, false, prefix_);
  g_ = dense_mlp_bind(ps, l, true, prefix_);
}

int64_t DenseMlp::deferred_elements(const SlotBuilder& sb) const {
  const int64_t fl = dense_width(), glu = spec_.activation == MlpActivation::SwiGLU ? 2 : 1;
  return sb.N * (sb.C + fl * glu) + sb.N * (fl + sb.C);  // fc1, fc2
}

void DenseMlp::recomputed_buffers(const SlotBuilder& sb, LayerActivations& la,
                                  int64_t width) const {
  dense_mlp_buffers(sb, la, width, spec_.activation, false);
}

void DenseMlp::kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const {
  dense_mlp_buffers(sb, la, width, spec_.activation, true);
}

void DenseMlp::shared_buffers(const SlotBuilder& sb, Activations& shared) const {
  dense_mlp_shared(sb, shared, spec_.activation);
}

void DenseMlp::fit(const SlotBuilder& sb, LayerActivations& la) const {
  dense_mlp_fit(sb, la, dense_width(), spec_.activation);
}

void DenseMlp::forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                       Tensor& out) {
  if (a.inference && spec_.activation == MlpActivation::Gelu && !s().fp8_layer(l)) {
    // Generation keeps nothing for a backward: fc1 and its GELU in one kernel on the CUDA
    // backend (cuBLASLt's epilogue; the same as the two on the CPU).
    be().matmul_gelu_forward(la.gelu, la.fc1, la.ln2, w_.fc1_w, opt(w_.fc1_b));
    be().matmul_forward(out, la.gelu, w_.fc2_w, bias_here() ? opt(w_.fc2_b) : nullptr);
    return;
  }
  phase("fc1-gemm-forward");
  s().linear_forward(l, Fp8Gemm::Fc1, la.fc1, la.ln2, w_.fc1_w, opt(w_.fc1_b), a);
  phase(mlp_activation_phase(spec_.activation, false));
  mlp_activation_forward(be(), spec_.activation, la.gelu, la.fc1);
  phase("fc2-gemm-forward");
  s().linear_forward(l, Fp8Gemm::Fc2, out, la.gelu, w_.fc2_w, bias_here() ? opt(w_.fc2_b) : nullptr,
                     a);
}

void DenseMlp::recompute(PhaseSequence& phase, int, Activations&, LayerActivations& la) {
  phase(mlp_activation_phase(spec_.activation, false));
  mlp_activation_forward(be(), spec_.activation, la.gelu, la.fc1);
}

void DenseMlp::backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                        const Tensor& dout) {
  backward_into(phase, l, a, la, dout, a.dln);
}

void DenseMlp::backward_into(PhaseSequence& phase, int l, Activations& a,
                             const LayerActivations& la, const Tensor& dout, Tensor& dinp) {
  Tensor dfc = a.dfc.view(0, la.gelu.shape());  // the scratch is the widest MLP's
  phase("fc2-gemm-backward");
  const bool gelu = spec_.activation == MlpActivation::Gelu;
  const Tensor* dfc1 = &dfc;
  // SwiGLU writes its gradient here (alive until fc1's backward has read it).
  Tensor swiglu =
      spec_.activation == MlpActivation::SwiGLU ? a.dfc1.view(0, la.fc1.shape()) : Tensor();
  if (gelu && !s().fp8_layer(l)) {  // GELU's backward in the GEMM's epilogue where there is one
    s().gemm_gelu_backward(dfc, g_.fc2_w, opt(g_.fc2_b), dout, la.gelu, w_.fc2_w, la.fc1);
  } else {
    s().linear_backward(l, Fp8Gemm::Fc2, &dfc, g_.fc2_w, opt(g_.fc2_b), dout, la.gelu, w_.fc2_w);
    phase(mlp_activation_phase(spec_.activation, true));
    dfc1 = &mlp_activation_backward(be(), spec_.activation, dfc, swiglu, la.fc1);
  }
  phase("fc1-gemm-backward");
  s().linear_backward(l, Fp8Gemm::Fc1, &dinp, g_.fc1_w, opt(g_.fc1_b), *dfc1, la.ln2, w_.fc1_w);
}

std::unique_ptr<MlpPart> make_dense_mlp(const LayerSpec& spec, const GPTConfig& cfg,
                                        const ModelShard& shard, PartServices* services) {
  return std::make_unique<DenseMlp>(cfg, shard, spec, services);
}

}  // namespace tessera
