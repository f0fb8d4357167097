// fp8.cpp: FP8's configuration and scaling state (model/fp8.hpp).
#include "model/fp8.hpp"

#include <sstream>

#include "core/error.hpp"
#include "core/test_hooks.hpp"

namespace tessera {

bool Fp8Config::layer_in_fp8(int layer, int num_layers) const {
  if (!enabled) return false;
  if (!first_last_bf16) return true;
  return layer >= layers_at_start_bf16 && layer < num_layers - layers_at_end_bf16;
}

std::string Fp8Config::describe(int num_layers) const {
  std::ostringstream s;
  s << (hybrid ? "hybrid (E4M3 inputs and weights, E5M2 output gradients)" : "e4m3") << ", ";
  if (recipe == Fp8Recipe::Tensorwise) {
    s << "tensorwise scaling";
  } else {
    s << "delayed scaling (amax history " << amax_history_len << ", "
      << (amax_most_recent ? "most_recent" : "max") << ", margin " << margin << ")";
  }
  int fp8_layers = 0;
  for (int l = 0; l < num_layers; ++l) fp8_layers += layer_in_fp8(l, num_layers);
  s << "; " << fp8_layers << " of " << num_layers << " layers in FP8";
  if (first_last_bf16)
    s << " (first " << layers_at_start_bf16 << " and last " << layers_at_end_bf16
      << " in the model's precision)";
  return s.str();
}

Fp8Scaling::Fp8Scaling(const Fp8Config& cfg, const std::vector<int>& layers, int num_layers,
                       int num_experts, Backend& be, Communicator& tp, Communicator* cp)
    : cfg_(cfg),
      be_(be),
      tp_(tp),
      cp_(cp),
      num_experts_(num_experts),
      fault_no_tp_amax_(test_hooks::fp8_no_tp_amax()) {
  TESSERA_CHECK(cfg.enabled && cfg.amax_history_len >= 1 && cfg.margin >= 0,
                "Fp8Scaling: FP8 off or an invalid recipe");
  for (int l : layers) active_.push_back(cfg.layer_in_fp8(l, num_layers));
  per_layer_ = fp8_state_columns(num_experts);
  n_ = int64_t(layers.size()) * per_layer_;
  if (n_ == 0) return;
  const int64_t H = cfg.recipe == Fp8Recipe::Delayed ? cfg.amax_history_len : 1;
  Allocator& alloc = be.allocator();
  amax_ = Tensor({n_}, DType::F32, alloc);
  scale_ = Tensor({n_}, DType::F32, alloc);
  history_ = Tensor({H, n_}, DType::F32, alloc);
  fp8_max_ = Tensor({n_}, DType::F32, alloc);
  // Every scale starts at 1 (Transformer Engine's), every amax and history row at 0.
  std::vector<float> ones(static_cast<size_t>(n_), 1.0f), maxes(static_cast<size_t>(n_));
  for (int64_t i = 0; i < n_; ++i) {
    // (every layer's columns are (GEMM, role) triples)
    const Fp8Format f = i % 3 == int64_t(Fp8Role::GradOutput) ? cfg.grad_format() : Fp8Format::E4M3;
    format_.push_back(f);
    maxes[static_cast<size_t>(i)] = fp8_max(f);
    amax_at_.push_back(amax_.view(i, {1}));
    scale_at_.push_back(scale_.view(i, {1}));
  }
  be.copy_from_host(scale_, ones.data());
  be.copy_from_host(fp8_max_, maxes.data());
  be.zero(amax_);
  be.zero(history_);
}

void Fp8Scaling::reduce_max(Tensor& t, Communicator* also) {
  if (tp_.size() > 1 && !fault_no_tp_amax_) tp_.all_reduce(t, ReduceOp::Max);
  if (also && also->size() > 1) also->all_reduce(t, ReduceOp::Max);
}

Backend::Fp8Operand Fp8Scaling::operand(int li, Fp8Gemm g, Fp8Role role, const Tensor& x,
                                        bool record, int expert) {
  if (expert < 0) return operand_at(li, index(li, g, role), x, record);
  TESSERA_CHECK(expert < num_experts_ && (g == Fp8Gemm::Fc1 || g == Fp8Gemm::Fc2),
                "FP8 operand of expert ", expert, " of ", num_experts_);
  const int64_t j = 12 + (int64_t(expert) * 2 + (g == Fp8Gemm::Fc2 ? 1 : 0)) * 3 + int64_t(role);
  return operand_at(li, int64_t(li) * per_layer_ + j, x, record);
}

Backend::Fp8Operand Fp8Scaling::operand_at(int li, int64_t index, const Tensor& x, bool record) {
  TESSERA_CHECK(li >= 0 && li < static_cast<int>(active_.size()) && active(li),
                "FP8 operand of a layer that is not in FP8");
  const size_t i = static_cast<size_t>(index);
  if (cfg_.recipe == Fp8Recipe::Tensorwise) {
    // The amax of the whole logical tensor: TP holds pieces of weights, of the row-parallel
    // GEMMs' inputs and of the column-parallel GEMMs' output gradients, CP pieces of every
    // activation (a replicated tensor's maximum is itself).
    be_.fp8_amax(amax_at_[i], x, false);
    reduce_max(amax_at_[i], cp_);
    be_.fp8_current_scale(scale_at_[i], amax_at_[i], format_[i]);
  } else if (record) {
    be_.fp8_amax(amax_at_[i], x, true);
  }
  return {&scale_at_[i], format_[i]};
}

void Fp8Scaling::end_step(Communicator* grad_group) {
  if (cfg_.recipe != Fp8Recipe::Delayed || n_ == 0) return;
  // The step's amax of a tensor: over its pieces (TP; CP within the gradient group) and over the
  // micro-batches of the global batch (the DP ranks'), so every layout records the same.
  reduce_max(amax_, grad_group);
  be_.fp8_delayed_update(history_, scale_, amax_, fp8_max_, cfg_.amax_most_recent, cfg_.margin);
}

}  // namespace tessera
