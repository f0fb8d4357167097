// gpt.hpp: the GPT model (DESIGN.md invariant 3) on one rank's shard, with explicit forward and
// backward passes over preallocated buffers (model/activations.hpp). The model strings parts
// together: the embedding, each layer's block plumbing (the residual stream, the norms around its
// two branches, the TP/SP reductions of their outputs and input gradients, the dropout sites,
// recomputation's order) around the layer's attention and MLP parts, chosen once from its spec
// (model/parts.hpp, model/layer_spec.hpp), and the head with its loss and multi-token prediction
// (model/mtp.hpp). What parts and plumbing share (the GEMMs, norms, rows, dropout, the attention
// core) is PartServices (model/part_services.hpp). Tensor parallelism is Megatron's:
// vocab-parallel embedding and cross-entropy, column-parallel QKV and fc1, row-parallel attention
// projection and fc2; `tp` is the tensor-parallel group (a LocalCommunicator for TP=1).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/activations.hpp"
#include "model/fp8.hpp"
#include "model/gpt_config.hpp"
#include "model/layer_spec.hpp"
#include "model/params.hpp"
#include "model/pass_observer.hpp"
#include "model/recompute.hpp"
#include "model/step_hooks.hpp"

namespace tessera {

class PartServices;  // model/part_services.hpp
class MtpHead;       // model/mtp.hpp

class GPTModel {
 public:
  // `compute`: the dtype of activations and of the weights the passes read (f32, or bf16/f16 for
  // mixed precision with f32 master weights and gradients).
  // `recompute`: which activations are recomputed in the backward instead of stored. `layout`:
  // the flat buffers' data-parallel buckets (and whether f32 master weights live here).
  GPTModel(const GPTConfig& cfg, const ModelShard& shard, Backend& backend, Communicator& tp,
           DType compute = DType::F32, const RecomputeConfig& recompute = {},
           const FlatLayout& layout = {});
  ~GPTModel();
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;
  DType compute_dtype() const { return compute_; }

  const GPTConfig& config() const { return cfg_; }
  const ModelShard& shard() const { return shard_; }
  ParamStore& params() { return *params_; }
  const ParamStore& params() const { return *params_; }
  int64_t padded_vocab() const { return padded_vocab_; }

  // Counter-based initialization: the same global values whatever the layout. Without f32 master
  // weights here (the distributed optimizer keeps them), each parameter's f32 values go to
  // `master_sink` instead, and its owner fills the compute copy.
  using ParamSink = std::function<void(const ParamSpec&, const float* values)>;
  void init_parameters(uint64_t seed, const ParamSink& master_sink = {});
  // Refreshes the compute-dtype copy of the weights from the f32 master weights (after an
  // optimizer step or a load); nothing to do in f32.
  void sync_compute_weights();
  void zero_grads();

  // The buffers of `count` (B,T) micro-batches in flight at once (pipeline slots): each its own
  // kept activations, all sharing one scratch and recompute working set. With several model
  // chunks, counts[c] slots of chunk c (in chunk order), all sharing the scratch.
  std::vector<Activations> make_activation_slots(int B, int T, int count) const;
  std::vector<Activations> make_activation_slots(int B, int T,
                                                 const std::vector<int>& counts) const;
  Activations make_activations(int B, int T) const { return make_activation_slots(B, T, 1)[0]; }
  // Generation's buffers (lib/inference/engine.hpp) for a forward of n rows (B = 1, T = n) whose
  // head returns the logits of S rows: the forward's alone, one layer's set that every layer
  // shares (nothing is kept for a backward), the hidden state running through it in place. Set
  // a.inference before the forward.
  Activations make_decode_activations(int64_t n, int64_t S, Allocator& al) const;
  // Documents inside the micro-batch's samples (run/sample_layout.hpp; host arrays of the whole
  // samples, B*S with S = cp*T the sequence length, row b*S + p by global position; either may be
  // null): each position's id (--reset-position-ids: RoPE, ALiBi and the learned position
  // embedding take it) and the first key it may see (--reset-attention-mask). Every CP rank gets
  // the whole samples' tables and keeps its own rows' positions. Both null: plain causal samples
  // again. Kept in `a` for its backward.
  void set_documents(Activations& a, const int32_t* positions, const int32_t* key_begin);

  // Whether a's chunk begins with the embedding / ends with the head (first / last virtual stage).
  bool embeds(const Activations& a) const { return shard_.has_embedding && a.chunk == 0; }
  // The chunk ends in multi-token prediction without the loss (a layout's "m|L"): its head piece
  // is mtp_forward / mtp_backward.
  bool ends_in_mtp(const Activations& a) const {
    return !shard_.has_head && shard_.mtp_count > 0 && a.chunk == shard_.num_chunks() - 1;
  }
  bool ends_in_head(const Activations& a) const {
    return shard_.has_head && a.chunk == shard_.num_chunks() - 1;
  }
  const LayerRange& chunk_layers(const Activations& a) const { return shard_.chunks[a.chunk]; }

  // The forward pieces. embed: ids -> input. block l: input of layer l -> layers[l].res2.
  // head: last hidden -> loss; returns the sum of token losses and leaves dlogits (scaled by
  // grad_scale, normally 1/loss tokens in the global batch) in acts.logits; multi-token
  // prediction's loss joins the gradient there (training micro-batches only).
  void embed_forward(Activations& a);
  void block_forward(int layer, Activations& a);
  double head_forward(Activations& a, float grad_scale);
  // The same, leaving the token losses (N, f32) in `losses_out` (backend memory) instead of
  // summing them on the host: no device round trip per micro-batch.
  void head_forward(Activations& a, float grad_scale, Tensor& losses_out);
  // The head piece of a chunk that ends in multi-token prediction alone (ends_in_mtp): its
  // losses join the gradient (training micro-batches; nothing otherwise), the stage's output
  // passes on unchanged; the backward adds its gradient of that output to a.dres.
  void mtp_forward(Activations& a, float grad_scale);
  // All of a's chunk (first and last stage together when PP = 1): training's, evaluation's and
  // generation's forward (a.inference: the KV caches, the rows' positions, the output rows; the
  // head leaves their logits in the context instead of a loss).
  double forward(Activations& a, float grad_scale);

  // The backward pieces mirror the forward; each reads and writes a.dres. block_backward runs the
  // layers in reverse order (the last layer first): with full recomputation, the backward of a
  // chunk's last layer first re-runs the chunk's forward.
  void head_backward(Activations& a);
  void mtp_backward(Activations& a);
  void block_backward(int layer, Activations& a);
  void embed_backward(Activations& a);
  // `weights_later`: zero-bubble's B pass (model/weight_grads.hpp): the input gradients now, the
  // weight-gradient GEMMs recorded for weight_backward, which runs the oldest recorded pass and
  // only then calls the pieces' grads_ready observers.
  void backward(Activations& a, bool weights_later = false);
  void weight_backward();

  // The observers of the passes, piece by piece (model/pass_observer.hpp: the gradient reduction,
  // the overlapped parameter gather, Megatron-FSDP), called in the order they were added.
  // Multi-token prediction's layers are the head piece's. An observer removes itself before it
  // goes.
  void add_observer(PassObserver* o) { observers_.push_back(o); }
  void remove_observer(PassObserver* o);

  // The block's own weights of layer `layer` (held by this rank): its two norms.
  const LayerWeights& layer_weights(int layer) const { return weights_[shard_.local_index(layer)]; }
  // The output layer's weight: the tied word embedding, or lm_head.
  const char* output_weight_name() const { return cfg_.tied_head() ? "wte" : "lm_head"; }
  // What the parts and the plumbing share: the norms, the GEMMs, the groups, the vocabulary shard.
  PartServices& services() const { return *services_; }
  Backend& backend() { return be_; }
  Communicator& tp_comm() { return tp_; }
  // The parts of layer `layer` (held by this rank), chosen once from its spec (model/parts.hpp).
  AttentionPart& attention_part(int layer) const { return *attention_[shard_.local_index(layer)]; }
  MlpPart& mlp_part(int layer) const { return *mlp_[shard_.local_index(layer)]; }
  // Multi-token prediction's head (model/mtp.hpp): its inputs and losses; null without MTP here.
  MtpHead* mtp() const { return mtp_.get(); }

  // The model's per-step state (model/step_hooks.hpp), in the order a step runs them: FP8's
  // delayed scaling, the parts' (the MoE router's loads and expert bias), multi-token
  // prediction's losses; those this rank has.
  std::vector<StepHook*> step_hooks() const;
  // Expert parallelism: the group of ranks that split the experts (its size is the shard's
  // ep_size). Without a call, a group of one.
  void set_expert_comm(Communicator& ep);
  // Context parallelism: the ring of CP ranks (its size is the shard's cp_size). Needed before a
  // forward when cp_size > 1.
  void set_context_comm(Communicator& cp);
  // FP8 (model/fp8.hpp, docs/training.md "FP8"): the transformer layers' GEMMs of this shard run
  // in FP8 as `c` says (c.enabled), from now on; needs the context-parallel ring set first where
  // there is one. Its delayed scaling is a step hook (step_hooks()).
  void set_fp8(const Fp8Config& c);
  Fp8Scaling* fp8() const;

  // Output of this stage's last layer (what the next stage receives).
  Tensor& stage_output(Activations& a);

  // Called once per step for each piece whose gradients are complete (after the last
  // micro-batch's backward of it): the gradients that are partial sums over the TP group (the
  // norms' under sequence parallelism, each part's replicated weights) all-reduced over TP
  // (phase "sp-grad-all-reduce").
  void reduce_sequence_parallel_grads(int piece);

 private:
  const Tensor& layer_input(int layer, const Activations& a) const;
  // Refills what the layer's backward reads and the plan did not keep.
  void recompute_for_backward(int layer, Activations& a);
  // Calls `event` of every observer for `piece`.
  void notify(void (PassObserver::*event)(int), int piece) {
    for (PassObserver* o : observers_) (o->*event)(piece);
  }
  // The learned position embedding added to (B,T,C) / its gradient from it: wpe[0:T], each row's
  // document position, or the rank's global positions with context parallelism.
  void add_position_embedding(Tensor& btc, Activations& a);
  void position_embedding_grad(const Tensor& dbtc, Activations& a);
  // btc (B,T,C) += wpe[position of each row] (the documents' position ids).
  void add_document_positions(Tensor& btc, const Tensor& wpe, Activations& a);

  GPTConfig cfg_;
  ModelShard shard_;
  Backend& be_;
  Communicator& tp_;
  DType compute_ = DType::F32;
  RecomputeConfig recompute_;
  std::vector<LayerRecompute> plan_;  // indexed by shard_.local_index(layer)
  int64_t padded_vocab_ = 0;
  std::unique_ptr<PartServices> services_;
  // Per local layer: its spec and parts (model/layer_spec.hpp).
  std::vector<LayerSpec> specs_;
  std::vector<std::unique_ptr<AttentionPart>> attention_;
  std::vector<std::unique_ptr<MlpPart>> mlp_;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<MtpHead> mtp_;               // the last stage with multi-token prediction
  std::vector<LayerWeights> weights_, grads_;  // the norms, by shard_.local_index(layer)
  std::vector<float> host_losses_;             // staging for the loss readback
  std::vector<std::string> range_names_;       // NVTX: layer-L-forward, layer-L-backward
  std::vector<PassObserver*> observers_;       // add_observer
};

}  // namespace tessera
