// parts.hpp: the swappable parts of a transformer layer (docs/architecture.md, "The model as
// parts"). GPTModel keeps the block's plumbing: the residual stream, the norms around the parts,
// the TP/SP reductions of their outputs and input gradients, the dropout sites, recomputation's
// order. A part, chosen once per layer from its LayerSpec (model/layer_spec.hpp), owns the rest:
// its weights (bound from the flat buffers), the activation buffers it keeps, recomputes and
// shares (so the --dry-run estimate counts exactly what is allocated), its forward, backward,
// selective recomputation, the decode step of generation and the ids of its FP8 GEMMs.
//
// Contracts, for the attention part and the MLP part alike:
//   forward:   the normed input (every token row, gathered over TP with sequence parallelism) ->
//              out (N, C): this rank's partial sum over TP (row-parallel biases on TP rank 0 only);
//   backward:  the branch's output gradient (every row) -> a.dln, the input gradient, a partial
//              sum over TP; the weights' gradients accumulated;
//   recompute: refills what selective recomputation did not keep, from what it did;
//   decode:    forward on generation's buffers (n rows, DecodeBuffers), with the KV cache.
#pragma once

#include <vector>

#include <string>

#include "model/gpt.hpp"
#include "model/layer_spec.hpp"

namespace tessera {

class PhaseSequence;
struct SlotBuilder;  // model/slots.hpp

// What one decode step of generation passes to a layer's attention: the step's rows and their
// positions, the layer's KV cache, and how the attention runs (a decode step's row table, or the
// segments of a prefill).
struct DecodeStep {
  int64_t n = 0;
  const Tensor* positions = nullptr;  // (n) int32
  bool decode = false;                // one new token per sequence: table and context
  Tensor table;
  int64_t context = 0;
  const std::vector<Backend::KvSegment>* segments = nullptr;
  Tensor* k_cache = nullptr;
  Tensor* v_cache = nullptr;
};

// Generation's buffers, for up to `rows` rows; each part allocates what it uses.
struct DecodeBuffers {
  int64_t rows = 0;
  Tensor qkv, att;           // standard and multi-latent attention
  QkNormTensors qk;          // --qk-layernorm
  MlaTensors mla;            // multi-latent attention's latents
  Tensor mla_q, mla_kv;      // and its scratch
  Tensor fc, act;            // the dense MLP's fc1 output and activation
  GPTModel::MoEScratch moe;  // a mixture of experts
};

// The base of every part. A part is made for a model (its services: backend, TP group, FP8
// GEMMs, norms), or without one to plan buffers (the --dry-run estimate builds the same buffers
// on an allocator that only counts). One friend of GPTModel for all parts.
class ModelPart {
 public:
  ModelPart(const GPTConfig& cfg, const ModelShard& shard, const LayerSpec& spec, GPTModel* model)
      : cfg_(cfg), shard_(shard), spec_(spec), m_(model) {}
  virtual ~ModelPart() = default;
  ModelPart(const ModelPart&) = delete;
  ModelPart& operator=(const ModelPart&) = delete;
  // A parameter's tensor (or gradient) of layer l; undefined when the model has none.
  static Tensor param(const ParamStore& ps, int l, const std::string& name, bool grads);

 protected:
  const GPTConfig& cfg_;
  const ModelShard& shard_;
  const LayerSpec spec_;
  GPTModel* m_;
  GPTModel& m() const { return *m_; }
  Backend& be() const { return m_->be_; }
  bool bias_here() const { return shard_.tp_rank == 0; }  // row-parallel biases: once over TP
  int64_t heads_local() const { return cfg_.num_attention_heads / shard_.tp_size; }
  int64_t kv_heads_local() const { return cfg_.kv_heads() / shard_.tp_size; }
  DType compute() const { return m_->compute_; }
  const LayerWeights& weights(int l) const { return m_->weights_[shard_.local_index(l)]; }
  LayerWeights& grads(int l) const { return m_->grads_[shard_.local_index(l)]; }
  void linear_forward(int l, Fp8Gemm g, Tensor& out, const Tensor& inp, const Tensor& w,
                      const Tensor* bias, const Activations& a, int expert = -1) const {
    m_->linear_forward(l, g, out, inp, w, bias, a, expert);
  }
  void linear_backward(int l, Fp8Gemm g, Tensor* dinp, Tensor& dw, Tensor* dbias,
                       const Tensor& dout, const Tensor& inp, const Tensor& w,
                       int expert = -1) const {
    m_->linear_backward(l, g, dinp, dw, dbias, dout, inp, w, expert);
  }
  bool fp8_layer(int l) const { return m_->fp8_layer(l); }
  void norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& w,
                    const Tensor& b) const {
    m_->norm_forward(out, mean, rstd, inp, w, b);
  }
  void norm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout, const Tensor& inp,
                     const Tensor& w, const Tensor& mean, const Tensor& rstd) const {
    m_->norm_backward(dinp, dw, db, dout, inp, w, mean, rstd);
  }
  void tp_reduce(PhaseSequence& phase, Tensor& t) const { m_->tp_reduce(phase, t); }
  Communicator& tp() const { return m_->tp_; }
  // The attention core of layer l (the fused attention, or the CP ring) and its backward; RoPE.
  void attention_core_forward(int l, Activations& a, LayerActivations& la) const {
    m_->attention_core_forward(l, a, la);
  }
  void attention_core_backward(int l, Activations& a, LayerActivations& la) const {
    m_->attention_core_backward(l, a, la);
  }
  void rope(Tensor& qkv, const Activations& a, bool backward) const {
    be().rope(qkv, m_->rope_spec(a.T), m_->rope_positions(a), backward);
  }
  // The dense MLP's passes (model/mlp.cpp).
  void dense_mlp_forward(PhaseSequence& phase, int l, const Activations& a, LayerActivations& la,
                         Tensor& out) const {
    m_->dense_mlp_forward(phase, l, a, la, out);
  }
  void dense_mlp_backward(PhaseSequence& phase, int l, Activations& a, const LayerActivations& la,
                          const Tensor& dout, Tensor& dinp) const {
    m_->dense_mlp_backward(phase, l, a, la, dout, dinp);
  }
  // The MoE layer's passes (model/moe.cpp).
  void moe_forward(PhaseSequence& phase, int l, Activations& a, Tensor& out) const {
    m_->moe_forward(phase, l, a, out);
  }
  void moe_backward(PhaseSequence& phase, int l, Activations& a, const Tensor& dy) const {
    m_->moe_backward(phase, l, a, dy);
  }
  void moe_recompute(PhaseSequence& phase, LayerActivations& la) const {
    m_->moe_recompute(phase, la);
  }
};

class AttentionPart : public ModelPart {
 public:
  using ModelPart::ModelPart;
  // Layer l's parameters (names, global shapes, TP split, init), after its first norm.
  virtual void add_params(ParamSpecBuilder& b, int l) const = 0;
  // Layer l's weights (or gradients) from the flat buffers into w.
  virtual void bind(const ParamStore& ps, int l, bool grads, LayerWeights& w) const = 0;
  // Buffers: what the core writes (recomputed by selective recomputation: the output and its
  // log-sum-exp), what the layer keeps (the projected heads and what their norms' backward
  // reads), and the scratch every layer shares (into `shared`, once).
  virtual void core_buffers(const SlotBuilder& sb, LayerActivations& la) const = 0;
  virtual void kept_buffers(const SlotBuilder& sb, LayerActivations& la) const = 0;
  virtual void shared_buffers(const SlotBuilder& sb, Activations& shared) const = 0;
  virtual void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                       Tensor& out) = 0;
  virtual void recompute(PhaseSequence& phase, int l, Activations& a, LayerActivations& la) = 0;
  virtual void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                        const Tensor& dout) = 0;
  // After the layer's last backward of a step: the gradients of weights every TP rank holds
  // whole but computed from its own heads only (q/k norms, MLA's latents), summed over TP.
  virtual void reduce_tp_grads(int l) = 0;
  virtual void decode_buffers(DecodeBuffers& d) const = 0;
  virtual void decode(int l, const DecodeStep& step, const Tensor& ln, Tensor& out,
                      DecodeBuffers& d) = 0;

 protected:
  // Generation's attention from qkv (n rows, before RoPE) into att, with the layer's KV cache.
  void decode_attention(const DecodeStep& step, Tensor& qkv, Tensor& att) const;
};

class MlpPart : public ModelPart {
 public:
  using ModelPart::ModelPart;
  // Layer l's parameters, after its second norm.
  virtual void add_params(ParamSpecBuilder& b, int l) const = 0;
  virtual void bind(const ParamStore& ps, int l, bool grads, LayerWeights& w) const = 0;
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
  virtual void reduce_tp_grads(int l) = 0;
  virtual void decode_buffers(DecodeBuffers& d) const = 0;
  virtual void decode(int l, const Tensor& ln, Tensor& out, DecodeBuffers& d) = 0;
};

// The MLP activation of `kind` (fc1's output -> out; SwiGLU halves the width), its phase name,
// and its backward: fills the fc1 gradient from the activation's (dact's buffer, or SwiGLU's own
// dfc1_swiglu) and returns it.
void mlp_activation_forward(Backend& be, MlpActivation kind, Tensor& out, const Tensor& fc1);
const char* mlp_activation_phase(MlpActivation kind, bool backward);
Tensor& mlp_activation_backward(Backend& be, MlpActivation kind, Tensor& dact, Tensor& dfc1_swiglu,
                                const Tensor& fc1);

// The dense MLP's pieces, which a MoE layer's shared expert reuses (model/mlp.cpp): its weights
// under `prefix` ("mlp." or "mlp.shared_expert."), its buffers for `width` (kept: fc1's output;
// else the activation's), the scratch of the widest (SlotBuilder::fl_max), and the cut of a
// working set to `width`.
// Each part's parameter specs (model/part_params.cpp), and a layer's by its spec.
void standard_attention_params(const LayerSpec& spec, ParamSpecBuilder& b, int l);
void mla_attention_params(const LayerSpec& spec, ParamSpecBuilder& b, int l);
void dense_mlp_layer_params(const LayerSpec& spec, ParamSpecBuilder& b, int l);
void moe_mlp_params(const LayerSpec& spec, ParamSpecBuilder& b, int l);
void add_attention_params(const LayerSpec& spec, ParamSpecBuilder& b, int l);
void add_mlp_params(const LayerSpec& spec, ParamSpecBuilder& b, int l);
void dense_mlp_params(ParamSpecBuilder& b, const std::string& prefix, int64_t width,
                      MlpActivation act);
void dense_mlp_bind(const ParamStore& ps, int l, bool grads, const std::string& prefix,
                    LayerWeights& w);
void dense_mlp_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width,
                       MlpActivation act, bool kept);
void dense_mlp_shared(const SlotBuilder& sb, Activations& shared, MlpActivation act);
void dense_mlp_fit(const SlotBuilder& sb, LayerActivations& la, int64_t width, MlpActivation act);

}  // namespace tessera
