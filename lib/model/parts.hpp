// parts.hpp: the swappable parts of a transformer layer (docs/architecture.md, "The model as
// parts"). GPTModel keeps the block's plumbing: the residual stream, the norms around the parts,
// the TP/SP reductions of their outputs and input gradients, the dropout sites, recomputation's
// order. A part, chosen once per layer from its LayerSpec (model/layer_spec.hpp), owns the rest:
// its parameters (add_params: names, global shapes, TP split, init; what the model's parameter
// list is made of), its weights and gradients (bound from the flat buffers), the activation
// buffers it keeps, recomputes and shares (so the --dry-run estimate counts exactly what is
// allocated), its forward (training's and generation's), backward, selective recomputation and
// its per-step state (a step hook). It reaches the rest of the model only through PartServices
// (model/part_services.hpp): the GEMMs (FP8 where the layer runs in FP8), the norms, the TP
// reduction, the attention core, RoPE.
//
// Contracts, for the attention part and the MLP part alike:
//   forward:   the normed input (every token row, gathered over TP with sequence parallelism) ->
//              out (N, C): this rank's partial sum over TP (row-parallel biases on TP rank 0 only);
//              generation runs the same forward with an inference context (Activations::
//              inference: the KV cache and the rows' positions, which PartServices' attention core
//              and RoPE read);
//   backward:  the branch's output gradient (every row) -> a.dln, the input gradient, a partial
//              sum over TP; the weights' gradients accumulated;
//   recompute: refills what selective recomputation did not keep, from what it did.
#pragma once

#include <string>
#include <vector>

#include "model/activations.hpp"
#include "model/layer_spec.hpp"
#include "model/params.hpp"
#include "model/part_services.hpp"
#include "model/step_hooks.hpp"

namespace tessera {

class PhaseSequence;
struct SlotBuilder;  // model/slots.hpp

// The base of every part. A part is made for a model (`services` its model's), or without one to
// plan parameters and buffers (the parameter list and the --dry-run estimate build the same
// parameters and buffers, the latter on an allocator that only counts).
class ModelPart {
 public:
  ModelPart(const GPTConfig& cfg, const ModelShard& shard, const LayerSpec& spec,
            PartServices* services)
      : cfg_(cfg), shard_(shard), spec_(spec), s_(services) {}
  virtual ~ModelPart() = default;
  ModelPart(const ModelPart&) = delete;
  ModelPart& operator=(const ModelPart&) = delete;
  // A parameter's tensor (or gradient) of layer l; undefined when the model has none.
  static Tensor param(const ParamStore& ps, int l, const std::string& name, bool grads);

  // Layer l's parameters (names, global shapes, TP split, init).
  virtual void add_params(ParamSpecBuilder& b, int l) const = 0;
  // Binds layer l's weights and gradients from the model's flat buffers.
  virtual void bind(const ParamStore& ps, int l) = 0;
  // After the layer's last backward of a step: the gradients of weights every TP rank holds whole
  // but computed from its own share (q/k norms, MLA's latents, the router), summed over TP.
  virtual void reduce_tp_grads(int l) = 0;
  // The part's per-step state (model/step_hooks.hpp), null without; the parts of one kind in a
  // model may share one.
  virtual StepHook* step_hook() { return nullptr; }
  // Zero-bubble (model/weight_grads.hpp): the elements a B pass of one micro-batch (`sb`'s
  // shapes) holds for the W pass, the input and the output gradient of each GEMM whose weight
  // half it defers (a MoE layer's experts at balanced routing: N*K rows).
  virtual int64_t deferred_elements(const SlotBuilder& sb) const = 0;

 protected:
  const GPTConfig& cfg_;
  const ModelShard& shard_;
  const LayerSpec spec_;
  PartServices* s_;  // null: a planning instance
  PartServices& s() const { return *s_; }
  Backend& be() const { return s_->backend(); }
  Communicator& tp() const { return s_->tp(); }
  DType compute() const { return s_->compute(); }
  bool bias_here() const { return shard_.tp_rank == 0; }  // row-parallel biases: once over TP
  int64_t heads_local() const { return cfg_.num_attention_heads / shard_.tp_size; }
  int64_t kv_heads_local() const { return cfg_.kv_heads() / shard_.tp_size; }
};

class AttentionPart : public ModelPart {
 public:
  using ModelPart::ModelPart;
  // Buffers: what the core writes (recomputed by selective recomputation: the output and its
  // log-sum-exp), what the layer keeps (the projected heads and what their norms' backward
  // reads), and the scratch every layer shares (into `shared`, once; the forward's alone for
  // generation, SlotBuilder::inference).
  virtual void core_buffers(const SlotBuilder& sb, LayerActivations& la) const = 0;
  virtual void kept_buffers(const SlotBuilder& sb, LayerActivations& la) const = 0;
  virtual void shared_buffers(const SlotBuilder& sb, Activations& shared) const = 0;
  virtual void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                       Tensor& out) = 0;
  virtual void recompute(PhaseSequence& phase, int l, Activations& a, LayerActivations& la) = 0;
  virtual void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                        const Tensor& dout) = 0;
};

// The router of a MoE layer as the trainer reads and restores it (model/moe.hpp): the logged
// statistics of the step's training micro-batches so far (the load-balancing metric, the aux loss
// without its coefficient, and the z-loss metric, mean logsumexp^2), the tokens each expert
// received since the last take (global counts, summed at each step's end), and the aux-loss-free
// expert bias (f32 on the host: the routing's source of truth, which checkpoints save).
class MoeRouter {
 public:
  struct Stats {
    double balance = 0, z = 0;
    int64_t micro_batches = 0;
  };
  virtual const Stats& stats() const = 0;
  virtual std::vector<int64_t> take_logged_tokens() = 0;
  virtual const std::vector<float>& expert_bias() const = 0;
  virtual void set_expert_bias(const float* values) = 0;

 protected:
  ~MoeRouter() = default;
};

class MlpPart : public ModelPart {
 public:
  using ModelPart::ModelPart;
  // This layer's dense MLP width on this rank (the shared expert's in a MoE layer; 0: none).
  virtual int64_t dense_width() const = 0;
  // Buffers for a dense width `width` (the widest layer's when building the recompute working
  // set every layer shares): what selective recomputation refills, what the layer keeps, the
  // scratch shared by all layers. fit cuts a working set built for the widest layer to this one.
  virtual void recomputed_buffers(const SlotBuilder& sb, LayerActivations& la,
                                  int64_t width) const = 0;
  virtual void kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const = 0;
  virtual void shared_buffers(const SlotBuilder& sb, Activations& shared) const = 0;
  virtual void fit(const SlotBuilder& sb, LayerActivations& la) const = 0;
  virtual void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                       Tensor& out) = 0;
  virtual void recompute(PhaseSequence& phase, int l, Activations& a, LayerActivations& la) = 0;
  virtual void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                        const Tensor& dout) = 0;
  // A MoE layer's router; null for a dense MLP.
  virtual MoeRouter* router() { return nullptr; }
};

// The weights (or gradients) of a dense MLP: a dense layer's, a MoE layer's shared expert's or
// one routed expert's (model/mlp.hpp).
struct MlpWeights {
  Tensor fc1_w, fc1_b, fc2_w, fc2_b;
};

// The MLP activation of `kind` (fc1's output -> out; SwiGLU halves the width), its phase name,
// and its backward: fills the fc1 gradient from the activation's (dact's buffer, or SwiGLU's own
// dfc1_swiglu) and returns it.
void mlp_activation_forward(Backend& be, MlpActivation kind, Tensor& out, const Tensor& fc1);
const char* mlp_activation_phase(MlpActivation kind, bool backward);
Tensor& mlp_activation_backward(Backend& be, MlpActivation kind, Tensor& dact, Tensor& dfc1_swiglu,
                                const Tensor& fc1);

// The dense MLP's pieces, which a MoE layer's experts and shared expert reuse (model/mlp.cpp):
// its parameters and weights under `prefix` ("layers.<l>.mlp.", "...mlp.shared_expert." or
// "...mlp.experts.<e>."), its buffers for `width` (kept: fc1's output; else the activation's),
// the scratch of the widest (SlotBuilder::fl_max), and the cut of a working set to `width`.
void dense_mlp_params(ParamSpecBuilder& b, const std::string& prefix, int64_t width,
                      MlpActivation act);
MlpWeights dense_mlp_bind(const ParamStore& ps, int l, bool grads, const std::string& prefix);
void dense_mlp_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width,
                       MlpActivation act, bool kept);
void dense_mlp_shared(const SlotBuilder& sb, Activations& shared, MlpActivation act);
void dense_mlp_fit(const SlotBuilder& sb, LayerActivations& la, int64_t width, MlpActivation act);

}  // namespace tessera
