// fp8.hpp: FP8 as a precision of the transformer layers' GEMMs (DESIGN.md, fourth wave; the
// user's page is docs/training.md, "FP8"). Fp8Config is what Megatron's --fp8-* options say;
// Fp8Scaling keeps the scaling state of one model shard, one entry per logical tensor (the input,
// the weight and the output gradient of each FP8 GEMM of each layer), and hands the backend's FP8
// GEMMs their scales, with every amax reduced over the ranks that hold pieces of the tensor so
// that every layout quantizes alike.
#pragma once

#include "model/step_hooks.hpp"

#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/tensor.hpp"
#include "model/fp8_config.hpp"

namespace tessera {

// The FP8 GEMMs of a transformer layer, and the roles of their operands. An MoE layer's experts
// have their own FC1 and FC2 (Fc1, Fc2 with an expert index); its shared expert uses the layer's.
enum class Fp8Gemm { Qkv, Proj, Fc1, Fc2 };
enum class Fp8Role { Input, Weight, GradOutput };

class Fp8Scaling final : public StepHook {
 public:
  // `layers`: the global indices of this shard's layers in local order; `num_experts` the
  // model's (0: dense), whose state every rank keeps for every expert (a rank's own experts'
  // amaxes are recorded, the others stay 0 until the step's reduction brings theirs); `tp` and
  // `cp` (null: no context parallelism) the groups an amax is reduced over before it is used.
  Fp8Scaling(const Fp8Config& cfg, const std::vector<int>& layers, int num_layers, int num_experts,
             Backend& be, Communicator& tp, Communicator* cp);

  const Fp8Config& config() const { return cfg_; }
  // Whether local layer li runs in FP8.
  bool active(int li) const { return active_[static_cast<size_t>(li)]; }
  // The operand of `role` in GEMM `g` of local layer li, quantizing x. Tensorwise: the amax of x
  // over the TP and CP groups, and its scale, now. Delayed: the scale the history gave at the last
  // step's end, and with `record` x's amax joins this step's. With expert >= 0, global expert
  // e's Fc1 or Fc2 instead: tensorwise, the amax is the one of x, the block of one sender's tokens
  // for this expert (with expert parallelism, each block comes from another micro-batch), reduced
  // over TP and CP: the same as this micro-batch's on one rank. Every rank of a CP group calls it
  // for the same blocks in the same order (a block may be empty on one).
  Backend::Fp8Operand operand(int li, Fp8Gemm g, Fp8Role role, const Tensor& x, bool record,
                              int expert = -1);
  // Delayed scaling, after a step's last backward: the step's amaxes are reduced over TP and the
  // gradient group (DP x CP) and the histories and scales advance (nothing for tensorwise).
  void end_step(Communicator* grad_group) override;
  // Delayed scaling: a rerun in place forgets the amaxes recorded since the last end_step.
  void begin_attempt(bool rerun) override {
    if (rerun && cfg_.recipe == Fp8Recipe::Delayed && n_ > 0) be_.zero(amax_);
  }

  // The state of delayed scaling (checkpoints): history (H, n) and scales (n) of n tensors in the
  // order (local layer, GEMM, role), each layer's followed by its experts' (expert, FC1/FC2,
  // role): per_layer() = fp8_state_columns(num_experts) tensors a layer.
  int64_t tensors() const { return n_; }
  int64_t per_layer() const { return per_layer_; }
  Tensor& history() { return history_; }
  Tensor& scales() { return scale_; }

 private:
  int64_t index(int li, Fp8Gemm g, Fp8Role role) const {
    return int64_t(li) * per_layer_ + int64_t(g) * 3 + int64_t(role);
  }
  Backend::Fp8Operand operand_at(int li, int64_t i, const Tensor& x, bool record);
  void reduce_max(Tensor& t, Communicator* also);

  Fp8Config cfg_;
  Backend& be_;
  Communicator& tp_;
  Communicator* cp_;
  std::vector<bool> active_;
  int64_t n_ = 0, per_layer_ = 0;
  int num_experts_ = 0;
  Tensor amax_, scale_, history_, fp8_max_;  // (n), (n), (H,n), (n) f32 on the backend
  std::vector<Tensor> amax_at_, scale_at_;   // 1-element views, one per tensor
  std::vector<Fp8Format> format_;            // per tensor
  bool fault_no_tp_amax_ = false;            // test hook (core/test_hooks.hpp)
};

}  // namespace tessera
