// mlp.cpp: the dense MLP as a part of a layer (model/parts.hpp): column-parallel fc1, the
// activation (GELU, SwiGLU's gate * up, or squared ReLU), row-parallel fc2. A MoE layer's shared
// expert is the same MLP (model/moe.cpp uses these buffers and helpers).
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

void dense_mlp_bind(const ParamStore& ps, int l, bool grads, const std::string& prefix,
                    LayerWeights& w) {
  w.fc1_w = ModelPart::param(ps, l, prefix + "fc1.weight", grads);
  w.fc1_b = ModelPart::param(ps, l, prefix + "fc1.bias", grads);
  w.fc2_w = ModelPart::param(ps, l, prefix + "fc2.weight", grads);
  w.fc2_b = ModelPart::param(ps, l, prefix + "fc2.bias", grads);
}

void dense_mlp_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width,
                       MlpActivation act, bool kept) {
  if (width <= 0) return;
  const int64_t glu = act == MlpActivation::SwiGLU ? 2 : 1;
  if (kept && !la.fc1.defined()) la.fc1 = sb.f({sb.N, glu * width});  // SwiGLU: gate and up
  if (!kept && !la.gelu.defined()) la.gelu = sb.f({sb.N, width});
}

void dense_mlp_shared(const SlotBuilder& sb, Activations& shared, MlpActivation act) {
  if (sb.fl_max <= 0 || shared.dfc.defined()) return;
  shared.dfc = sb.f({sb.N, sb.fl_max});
  if (act == MlpActivation::SwiGLU) shared.dfc1 = sb.f({sb.N, 2 * sb.fl_max});
}

void dense_mlp_fit(const SlotBuilder& sb, LayerActivations& la, int64_t width, MlpActivation act) {
  const int64_t glu = act == MlpActivation::SwiGLU ? 2 : 1;
  la.gelu = width > 0 && la.gelu.defined() ? la.gelu.view(0, {sb.N, width}) : Tensor();
  la.fc1 = width > 0 && la.fc1.defined() ? la.fc1.view(0, {sb.N, glu * width}) : Tensor();
}

void GPTModel::dense_mlp_forward(PhaseSequence& phase, int l, const Activations& a,
                                 LayerActivations& la, Tensor& out) {
  const LayerWeights& w = weights_[static_cast<size_t>(shard_.local_index(l))];
  phase("fc1-gemm-forward");
  linear_forward(l, Fp8Gemm::Fc1, la.fc1, la.ln2, w.fc1_w, opt(w.fc1_b), a);
  activation_forward(phase, la);
  phase("fc2-gemm-forward");
  linear_forward(l, Fp8Gemm::Fc2, out, la.gelu, w.fc2_w,
                 shard_.tp_rank == 0 ? opt(w.fc2_b) : nullptr, a);
}

void GPTModel::dense_mlp_backward(PhaseSequence& phase, int l, Activations& a,
                                  const LayerActivations& la, const Tensor& dout, Tensor& dinp) {
  const size_t li = static_cast<size_t>(shard_.local_index(l));
  const LayerWeights& w = weights_[li];
  LayerWeights& g = grads_[li];
  Tensor dfc = a.dfc.view(0, la.gelu.shape());  // the scratch is the widest MLP's
  phase("fc2-gemm-backward");
  const bool gelu = activation_ == MlpActivation::Gelu;
  const Tensor* dfc1 = &dfc;
  // SwiGLU writes its gradient here (alive until fc1's backward has read it).
  Tensor swiglu = swiglu_ ? a.dfc1.view(0, la.fc1.shape()) : Tensor();
  if (gelu && !fp8_layer(l)) {  // GELU's backward in the GEMM's epilogue where there is one
    be_.matmul_gelu_backward(dfc, g.fc2_w, opt(g.fc2_b), dout, la.gelu, w.fc2_w, la.fc1);
  } else {
    linear_backward(l, Fp8Gemm::Fc2, &dfc, g.fc2_w, opt(g.fc2_b), dout, la.gelu, w.fc2_w);
    dfc1 = &activation_backward(phase, dfc, swiglu, la.fc1);
  }
  phase("fc1-gemm-backward");
  linear_backward(l, Fp8Gemm::Fc1, &dinp, g.fc1_w, opt(g.fc1_b), *dfc1, la.ln2, w.fc1_w);
}

namespace {

class DenseMlp final : public MlpPart {
 public:
  using MlpPart::MlpPart;

  void add_params(ParamSpecBuilder& b, int l) const override {
    dense_mlp_layer_params(spec_, b, l);
  }
  void bind(const ParamStore& ps, int l, bool grads, LayerWeights& w) const override {
    dense_mlp_bind(ps, l, grads, "mlp.", w);
  }
  int64_t dense_width() const override { return spec_.dense_width / shard_.tp_size; }
  void recomputed_buffers(const SlotBuilder& sb, LayerActivations& la,
                          int64_t width) const override {
    dense_mlp_buffers(sb, la, width, spec_.activation, false);
  }
  void kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const override {
    dense_mlp_buffers(sb, la, width, spec_.activation, true);
  }
  void shared_buffers(const SlotBuilder& sb, Activations& shared) const override {
    dense_mlp_shared(sb, shared, spec_.activation);
  }
  void fit(const SlotBuilder& sb, LayerActivations& la) const override {
    dense_mlp_fit(sb, la, dense_width(), spec_.activation);
    // A working set shared with MoE layers: none of their buffers here.
    for (Tensor* t : {&la.moe_x, &la.moe_xe, &la.moe_act, &la.moe_logits, &la.moe_expert,
                      &la.moe_row, &la.moe_weight, &la.moe_fc1, &la.moe_out, &la.moe_ag_weight,
                      &la.moe_ag_row, &la.moe_oute})
      *t = Tensor();
  }

  void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
               Tensor& out) override {
    dense_mlp_forward(phase, l, a, la, out);
  }

  void recompute(PhaseSequence& phase, int, Activations&, LayerActivations& la) override {
    phase(mlp_activation_phase(spec_.activation, false));
    mlp_activation_forward(be(), spec_.activation, la.gelu, la.fc1);
  }

  void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                const Tensor& dout) override {
    dense_mlp_backward(phase, l, a, la, dout, a.dln);
  }

  void reduce_tp_grads(int) override {}

  void decode_buffers(DecodeBuffers& d) const override {
    if (d.act.defined()) return;
    const int64_t glu = spec_.activation == MlpActivation::SwiGLU ? 2 : 1;
    const int64_t Fl = cfg_.ffn() / shard_.tp_size;
    d.fc = Tensor({d.rows, glu * Fl}, compute(), be().allocator());
    d.act = Tensor({d.rows, Fl}, compute(), be().allocator());
  }

  void decode(int l, const Tensor& ln, Tensor& out, DecodeBuffers& d) override {
    const LayerWeights& w = weights(l);
    const int64_t n = ln.dim(0);
    Tensor fc = d.fc.view(0, {n, d.fc.dim(1)}), act = d.act.view(0, {n, d.act.dim(1)});
    if (spec_.activation == MlpActivation::Gelu) {  // one kernel on the CUDA backend
      be().matmul_gelu_forward(act, fc, ln, w.fc1_w, opt(w.fc1_b));
    } else {
      be().matmul_forward(fc, ln, w.fc1_w, opt(w.fc1_b));
      mlp_activation_forward(be(), spec_.activation, act, fc);
    }
    be().matmul_forward(out, act, w.fc2_w, bias_here() ? opt(w.fc2_b) : nullptr);
  }
};

}  // namespace

std::unique_ptr<MlpPart> make_dense_mlp(const LayerSpec& spec, const GPTConfig& cfg,
                                        const ModelShard& shard, GPTModel* model) {
  return std::make_unique<DenseMlp>(cfg, shard, spec, model);
}

}  // namespace tessera
