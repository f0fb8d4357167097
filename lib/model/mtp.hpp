// mtp.hpp: multi-token prediction (DeepSeek-V3, Megatron-Core's MTP; docs/model.md) as the head's
// part on the last stage (model/mtp.cpp): its parameters, its inputs, its forward and backward
// around its depths' transformer layers (which the model's block runs), its TP-partial gradients
// and its per-step losses (a step hook).
#pragma once

#include <functional>
#include <vector>

#include "model/activations.hpp"
#include "model/params.hpp"
#include "model/part_services.hpp"
#include "model/step_hooks.hpp"

namespace tessera {

class PhaseSequence;

class MtpHead final : public StepHook {
 public:
  // The depths of `shard` (the last stage's, with --mtp-num-layers) on its model's services and
  // parameters (they outlive it).
  MtpHead(const GPTConfig& cfg, const ModelShard& shard, PartServices& services,
          const ParamStore& params);
  // Its parameters on the stage with the head, after the final norm (its layers' come with the
  // model's): each depth's embedding and hidden-state norms, the projection of the two
  // concatenated (replicated over TP: row-local), the final norm.
  static void add_params(ParamSpecBuilder& b);

  // The sums over the training micro-batches since the attempt began of each depth's token losses
  // and loss tokens (this rank's; the last stage's tp rank 0 counts).
  struct Loss {
    double sum = 0, tokens = 0;
  };
  const std::vector<Loss>& losses() const { return losses_; }
  // Depth k's inputs of a micro-batch (host arrays, B*T by local row): the token k + 1 ahead and
  // the target k + 1 ahead (-1: none), cut from the whole samples by the caller (context
  // parallelism: this rank's chunks). Without a call the forward shifts the micro-batch's own ids
  // and targets (one rank's whole samples only).
  void set_inputs(Activations& a, int depth, const int32_t* ids, const int32_t* targets);

  // The forward after the main head (training micro-batches): each depth's loss joins the
  // gradient (its logits' gradient times grad_scale and the MTP weight); `hidden` is the main
  // model's last output, `block` runs a depth's transformer layer. The backward before the main
  // head's: adds the main hidden state's gradient to a.dres.
  using BlockPass = std::function<void(int layer, Activations& a)>;
  void forward(Activations& a, float grad_scale, const Tensor& hidden, const BlockPass& block);
  void backward(Activations& a, const Tensor& hidden, const BlockPass& block);
  // With sequence parallelism, after the head piece's last backward of a step: its norms' and
  // projection's gradients (from this rank's rows) summed over TP.
  void reduce_tp_grads();

  void begin_attempt(bool) override { losses_.assign(losses_.size(), Loss{}); }
  void end_step(Communicator*) override {}

 private:
  // The tokens and targets of each depth shifted within each sample, from the micro-batch's own.
  void prepare(Activations& a);
  // The word embedding of `ids` (B,T) into out (own rows, C): the vocabulary-parallel lookup
  // summed over TP (reduce-scattered with sequence parallelism).
  void embed_rows(PhaseSequence& phase, Tensor& out, const Tensor& ids, Activations& a);
  const char* output_weight() const { return cfg_.tied_head() ? "wte" : "lm_head"; }
  Tensor weight(const std::string& name) const;  // undefined when absent
  Tensor grad(const std::string& name) const;

  const GPTConfig& cfg_;
  const ModelShard& shard_;
  PartServices& s_;
  const ParamStore& params_;
  std::vector<Loss> losses_;  // per depth
  std::vector<float> host_;   // staging for the token losses
};

}  // namespace tessera
