// mlp.hpp: the dense MLP as a part of a layer (model/mlp.cpp): column-parallel fc1, the activation
// (GELU, SwiGLU's gate * up, or squared ReLU), row-parallel fc2. A MoE layer holds one as its
// shared expert (model/moe.hpp).
#pragma once

#include <string>

#include "model/parts.hpp"

namespace tessera {

class DenseMlp final : public MlpPart {
 public:
  // `prefix`: where its weights are under "layers.<l>.": "mlp." (a dense layer), or
  // "mlp.shared_expert." (a MoE layer's shared expert, whose parameters the MoE part adds).
  DenseMlp(const GPTConfig& cfg, const ModelShard& shard, const LayerSpec& spec,
           PartServices* services, std::string prefix = "mlp.")
      : MlpPart(cfg, shard, spec, services), prefix_(std::move(prefix)) {}

  void add_params(ParamSpecBuilder& b, int l) const override;
  void bind(const ParamStore& ps, int l) override;
  void reduce_tp_grads(int) override {}
  int64_t dense_width() const override { return spec_.dense_width / shard_.tp_size; }
  int64_t deferred_elements(const SlotBuilder& sb) const override;
  void recomputed_buffers(const SlotBuilder& sb, LayerActivations& la,
                          int64_t width) const override;
  void kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const override;
  void shared_buffers(const SlotBuilder& sb, Activations& shared) const override;
  void fit(const SlotBuilder& sb, LayerActivations& la) const override;
  // la.ln2 -> out (N, C, partial over TP); the backward from dout (every row) into a.dln.
  void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
               Tensor& out) override;
  void recompute(PhaseSequence& phase, int l, Activations& a, LayerActivations& la) override;
  void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                const Tensor& dout) override;

  // The backward into dinp (partial over TP): a.dln for a dense layer, the MoE layer's scratch
  // for its shared expert.
  void backward_into(PhaseSequence& phase, int l, Activations& a, const LayerActivations& la,
                     const Tensor& dout, Tensor& dinp);
  const MlpWeights& weights() const { return w_; }

 private:
  std::string prefix_;
  MlpWeights w_, g_;  // bound from the flat buffers
};

}  // namespace tessera
