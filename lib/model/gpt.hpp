// gpt.hpp: the GPT model (DESIGN.md invariant 3) on one rank's shard, with explicit forward and
// backward passes over preallocated buffers: the block's plumbing here, each layer's attention
// and MLP as parts chosen once from its spec (model/parts.hpp, model/layer_spec.hpp). Tensor
// parallelism is Megatron's: vocab-parallel embedding and cross-entropy, column-parallel QKV and
// fc1, row-parallel attention projection and fc2; `tp` is the tensor-parallel group (a
// LocalCommunicator for TP=1).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/fp8.hpp"
#include "model/gpt_config.hpp"
#include "model/layer_spec.hpp"
#include "model/params.hpp"
#include "model/pass_observer.hpp"
#include "model/recompute.hpp"
#include "model/step_hooks.hpp"

namespace tessera {

class PhaseSequence;  // core/phase_timer.hpp
class ModelPart;      // model/parts.hpp

// Activations of one transformer layer for one micro-batch. N = B*T tokens; Cl, Fl, Hl are this
// rank's shares of the hidden width, ffn width and heads. With recomputation (model/recompute.hpp)
// some of these tensors are views of a working set shared by every micro-batch in flight: they are
// filled again just before the layer's backward reads them.
// --qk-layernorm: the query and key heads of a layer's qkv before their norm, (n, Hl*hd) and
// (n, Gl*hd), and the norm's statistics (n*Hl), (n*Gl) (the means with LayerNorm only).
struct QkNormTensors {
  Tensor q_raw, k_raw, q_mean, q_rstd, k_mean, k_rstd;
};

// Multi-latent attention (model/mla.cpp): what its backward reads. The query latent before and
// after its norm (N, q_lora_rank) with the norm's statistics (N); the key/value latent before
// and after its norm (N, kv_lora_rank) with its statistics, and the keys' shared RoPE part
// (N, rope dim) before RoPE; the attention output's values per head (N, Hl*v_head_dim), the output
// projection's input. Without the latent norms q_lat_n and c_n are q_lat and c.
struct MlaTensors {
  Tensor q_lat, q_lat_n, q_mean, q_rstd, c, c_n, c_mean, c_rstd, k_pe, att_v;
};

struct LayerActivations {
  Tensor ln1, ln1_mean, ln1_rstd;  // (N,C), (N), (N)
  MlaTensors mla;                  // --multi-latent-attention
  Tensor qkv;        // (B,T,(Hl+2Gl)*hd): query, key, value heads (q/k norms and RoPE applied)
  QkNormTensors qk;  // --qk-layernorm: what the q/k norms' backward reads
  Tensor att, lse;   // (B,T,Cl), (B,Hl,T)
  Tensor res1;       // (N,C)  x + attention
  Tensor ln2, ln2_mean, ln2_rstd;
  Tensor fc1, gelu;  // (N,Fl) (fc1 (N,2Fl) with SwiGLU: gate and up); gelu: the activation's output
  Tensor res2;       // (N,C)  layer output
  // A MoE layer (model/moe.cpp; fc1 and gelu then belong to the shared expert, undefined without
  // one). R: rows of the permuted buffer (token copies grouped by expert).
  Tensor moe_logits;           // (N,E) f32 router logits (every rank's rows, gathered)
  Tensor moe_expert, moe_row;  // (N,K) int32: each slot's expert and permuted row
  Tensor moe_weight;           // (N,K) f32 routing weights
  Tensor moe_x;                // (N*K,C) this rank's token copies grouped by expert
  Tensor moe_out;              // (N*K,C) their expert outputs (partial sums over TP)
  // The expert side: the rows this rank's experts receive (R of them; with expert parallelism
  // from every rank of the EP group, by sender then expert; without, moe_x and moe_out).
  Tensor moe_xe, moe_fc1, moe_act;          // (R,C), (R, expert fc1 width), (R, expert width)
  std::vector<int64_t> moe_rows;            // the expert side's blocks: rows of each
  std::vector<int> moe_block_expert;        // and its local expert
  std::vector<int64_t> moe_send, moe_recv;  // rows sent to / received from each EP rank
  // The allgather dispatcher (expert parallelism): every EP rank's routing weights and slots'
  // rows in this rank's expert side (-1: another rank's expert), (EP*N,K); and the expert side's
  // outputs (R,C), kept for the backward.
  Tensor moe_ag_weight, moe_ag_row, moe_oute;
  std::vector<int64_t> moe_routed;  // tokens routed to each expert (per load-balancing group)
  float moe_loss_scale = 0;         // the micro-batch's Activations::moe_loss_scale
};

// The parameters (or gradients) of one layer, resolved once so a step does no name look-ups.
// Absent ones (biases with --disable-bias-linear, norm biases with RMSNorm) are undefined; with
// grouped-query attention qkv_w / qkv_b view the glued query and key/value parameters.
// In a MoE layer fc1_* and fc2_* are the shared expert's, and the routed experts (this rank's, in
// order) are in experts.
struct ExpertWeights {
  Tensor fc1_w, fc1_b, fc2_w, fc2_b;
};
struct LayerWeights {
  Tensor ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
  Tensor q_norm_w, q_norm_b, k_norm_w, k_norm_b;  // --qk-layernorm
  // MLA: the latents' down-projections and norms, the up-projections (q_up_w is the query
  // projection from the hidden state when there is no query latent).
  Tensor q_down_w, q_down_norm_w, q_down_norm_b, q_up_w, kv_down_w, kv_down_norm_w, kv_down_norm_b,
      kv_up_w;
  Tensor router_w;
  std::vector<ExpertWeights> experts;
};

// Multi-token prediction's depth k (model/mtp.cpp), on the last stage. Residual-stream tensors
// hold this rank's rows (sequence parallelism: its share); lnf and logits every row.
struct MtpActivations {
  Tensor ids, targets;             // (B,T) int32: the token k ahead; the target k + 1 ahead (-1)
  Tensor emb;                      // its embedding (own rows, C)
  Tensor e_n, e_mean, e_rstd;      // enorm(emb)
  Tensor h_n, h_mean, h_rstd;      // hnorm(the previous depth's hidden state)
  Tensor cat;                      // (own rows, 2C): [e_n | h_n], the projection's input
  Tensor x;                        // the projection's output: the depth's layer input
  Tensor lnf, lnf_mean, lnf_rstd;  // the final norm of the layer's output (lnf: N rows)
  Tensor logits;                   // (N, Vl): the logits, their gradient after the forward
  Tensor losses;                   // (N) f32 token losses (0 where no target)
  double tokens = 0;               // the targets (>= 0) of ids/targets
};

// Which dropout masks a micro-batch draws (core/dropout.hpp): set by the trainer before its
// forward and kept until its backward (and any recomputation) has run.
struct DropoutContext {
  bool training = false;  // false (evaluation, generation, tests): no dropout
  uint64_t seed = 0;
  int64_t iteration = 0;     // the training iteration, from 1
  int64_t sample_begin = 0;  // global index of the micro-batch's first sample
};

// Everything one micro-batch needs on this stage (one model chunk of it with the interleaved
// schedule), allocated once for a fixed (B,T).
struct Activations {
  int B = 0, T = 0;
  int chunk = 0;  // the model chunk (ModelShard::chunks) whose layers these are
  DropoutContext dropout;
  Tensor ids, targets;  // (B,T) int32; targets < 0 carry no loss
  Tensor input;         // (B,T,C): embedding output, or what the previous stage sent
  std::vector<LayerActivations> layers;
  Tensor lnf, lnf_mean, lnf_rstd;               // last stage
  Tensor logits;                                // (N,Vl), overwritten in place by dlogits
  Tensor losses, rowmax, sumexp, target_logit;  // (N)
  Tensor dres;                                  // (B,T,C) gradient of the residual stream
  // Scratch, one set shared by every micro-batch in flight (nothing in it outlives a pass).
  Tensor tmp_c;            // (N,C)   row-parallel outputs
  Tensor dln;              // (N,C)
  Tensor dqkv, datt, dfc;  // (N,(Hl+2Gl)hd), (N,Cl), (N,Fl)
  Tensor dfc1;             // (N,2Fl): the gradient of SwiGLU's gate and up (SwiGLU only)
  Tensor qk_tmp;           // (N,Hl*hd): the q/k norms' scratch (--qk-layernorm only)
  // MLA's scratch: the heads' queries (N, Hl*hd), keys without position and values
  // (N, Hl*(qk_head_dim + v_head_dim)), the latents' gradients after and before their norms
  // (N, q_lora_rank) x 2, (N, kv_lora_rank) x 2, the shared RoPE key's gradient (N, rope dim) and
  // one head's (N, rope dim), and a second (N,C) for the input gradient's other parts.
  Tensor mla_q, mla_kv, mla_dq_n, mla_dq_lat, mla_dc_n, mla_dc, mla_dk_pe, mla_tmp_pe, mla_dln;
  Tensor datt_v;  // MLA: the output projection's input gradient (N, Hl*v_head_dim)
  // MoE scratch: expert output and input gradients (R,C), the expert activation's and fc1's
  // gradients, the routing weights' (N,K) and the logits' (N,E) gradients (f32), and two (N,C).
  Tensor moe_dout, moe_dact, moe_dfc1, moe_dweight, moe_dlogits, moe_dx, moe_tmp;
  // Expert parallelism: the expert side's outputs and gradients (R,C) before they return; the
  // allgather dispatcher's gathered rows (EP*N,C: inputs, then outputs or gradients), logits
  // (EP*N,E), experts (EP*N,K) and routing-weight gradients (EP*N,K).
  Tensor moe_oute, moe_doute;
  Tensor moe_ag_x, moe_ag_y, moe_ag_logits, moe_ag_expert, moe_ag_dweight;
  Tensor moe_logits_c;  // (N,E) logits in the compute dtype (mixed precision only)
  // Context parallelism (model/context_parallel.cpp), T being this rank's tokens per sample: the
  // K/V blocks in hand and arriving (B,T,2Gl*hd), the dK/dV sums travelling with them in the
  // backward and a step's own dK/dV part, a block's partial output (B,T,Cl) and log-sum-exp
  // (B,Hl,T) f32, the rows' global positions (B*T int32, RoPE) and the position-embedding rows of
  // the rank's tokens (T,C) and their f32 gradient (learned positions).
  Tensor cp_kv[2], cp_dkv[2], cp_dkv_mine, cp_out, cp_lse, cp_positions, cp_wpe, cp_dwpe;
  // Documents inside the samples (GPTModel::set_documents; empty when off): each local row's
  // position id (B*T int32: RoPE and the learned position embedding's row), the first key each
  // position of the whole samples may see (B*cp*T int32 by global position: --reset-attention-mask;
  // B*T without context parallelism), the whole samples' position ids (B*cp*T: ALiBi under context
  // parallelism; empty at CP 1, where doc_positions serves) and the gathered position-embedding
  // rows (N,C).
  Tensor doc_positions, doc_key_begin, doc_positions_all, doc_wpe;
  // The weight of this micro-batch's load-balancing and z losses in the objective: 1 / the
  // micro-batches of the global batch (the trainer sets it; 1 for a lone micro-batch).
  float moe_loss_scale = 1;
  // Multi-token prediction (the head chunk of the last stage): each depth's tensors, and scratch:
  // the main hidden state's gradient from the head, the chain's hidden-state gradient (own rows,
  // C), the gathered embedding gradient (N, C), the projection's input gradient (own rows, 2C)
  // and its two halves (own rows, C).
  std::vector<MtpActivations> mtp;
  Tensor mtp_dmain, mtp_dh, mtp_demb, mtp_dcat, mtp_de, mtp_dhn;
  bool mtp_staged = false;  // set_mtp_inputs filled each depth's ids and targets
};

// Bytes of the activation buffers of a stage for (B,T) micro-batches: what each micro-batch in
// flight keeps, and the scratch and recompute working set they share. Counted by building the
// same buffers make_activation_slots allocates, on an allocator that only counts.
struct ActivationFootprint {
  double per_micro_batch = 0, shared = 0;
  double total(int slots) const { return per_micro_batch * slots + shared; }
};
ActivationFootprint activation_footprint(const GPTConfig& cfg, const ModelShard& shard,
                                         const RecomputeConfig& rc, int B, int T, DType compute);
// Bytes of make_activation_slots(B, T, counts): counts[c] slots of model chunk c.
double activation_bytes(const GPTConfig& cfg, const ModelShard& shard, const RecomputeConfig& rc,
                        int B, int T, DType compute, const std::vector<int>& counts);

class GPTModel {
 public:
  // `compute`: the dtype of activations and of the weights the passes read (f32, or bf16/f16 for
  // mixed precision with f32 master weights and gradients).
  // `recompute`: which activations are recomputed in the backward instead of stored. `layout`:
  // the flat buffers' data-parallel buckets (and whether f32 master weights live here).
  GPTModel(const GPTConfig& cfg, const ModelShard& shard, Backend& backend, Communicator& tp,
           DType compute = DType::F32, const RecomputeConfig& recompute = {},
           const FlatLayout& layout = {});
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

  const RecomputeConfig& recompute() const { return recompute_; }
  ActivationFootprint activation_footprint(int B, int T) const;
  // The buffers of `count` (B,T) micro-batches in flight at once (pipeline slots): each its own
  // kept activations, all sharing one scratch and recompute working set. With several model
  // chunks, counts[c] slots of chunk c (in chunk order), all sharing the scratch.
  std::vector<Activations> make_activation_slots(int B, int T, int count) const;
  std::vector<Activations> make_activation_slots(int B, int T,
                                                 const std::vector<int>& counts) const;
  Activations make_activations(int B, int T) const { return make_activation_slots(B, T, 1)[0]; }
  // Documents inside the micro-batch's samples (run/sample_layout.hpp; host arrays of the whole
  // samples, B*S with S = cp*T the sequence length, row b*S + p by global position; either may be
  // null): each position's id (--reset-position-ids: RoPE, ALiBi and the learned position
  // embedding take it) and the first key it may see (--reset-attention-mask). Every CP rank gets
  // the whole samples' tables and keeps its own rows' positions. Both null: plain causal samples
  // again. Kept in `a` for its backward.
  void set_documents(Activations& a, const int32_t* positions, const int32_t* key_begin);

  // Whether a's chunk begins with the embedding / ends with the head (first / last virtual stage).
  bool embeds(const Activations& a) const { return shard_.has_embedding && a.chunk == 0; }
  bool ends_in_head(const Activations& a) const {
    return shard_.has_head && a.chunk == shard_.num_chunks() - 1;
  }
  const LayerRange& chunk_layers(const Activations& a) const { return shard_.chunks[a.chunk]; }

  // The forward pieces. embed: ids -> input. block l: input of layer l -> layers[l].res2.
  // head: last hidden -> loss; returns the sum of token losses and leaves dlogits (scaled by
  // grad_scale, normally 1/loss tokens in the global batch) in acts.logits.
  void embed_forward(Activations& a);
  void block_forward(int layer, Activations& a);
  double head_forward(Activations& a, float grad_scale);
  // The same, leaving the token losses (N, f32) in `losses_out` (backend memory) instead of
  // summing them on the host: no device round trip per micro-batch.
  void head_forward(Activations& a, float grad_scale, Tensor& losses_out);
  // All of a's chunk (first and last stage together when PP = 1).
  double forward(Activations& a, float grad_scale);
  // Multi-token prediction (model/mtp.cpp): the sums over the training micro-batches since
  // reset_mtp_losses of each depth's token losses and loss tokens (this rank's; the last stage's
  // tp rank 0 counts). Its loss joins the gradient in head_forward (training micro-batches only).
  struct MtpLoss {
    double sum = 0, tokens = 0;
  };
  const std::vector<MtpLoss>& mtp_losses() const { return mtp_losses_; }
  void reset_mtp_losses();
  // Depth k's inputs of a micro-batch (host arrays, B*T by local row): the token k + 1 ahead and
  // the target k + 1 ahead (-1: none), cut from the whole samples by the caller (context
  // parallelism: this rank's chunks). Without a call the forward shifts the micro-batch's own ids
  // and targets (one rank's whole samples only).
  void set_mtp_inputs(Activations& a, int depth, const int32_t* ids, const int32_t* targets);

  // The backward pieces mirror the forward; each reads and writes a.dres. block_backward runs the
  // layers in reverse order (the last layer first): with full recomputation, the backward of a
  // chunk's last layer first re-runs the chunk's forward.
  void head_backward(Activations& a);
  void block_backward(int layer, Activations& a);
  void embed_backward(Activations& a);
  void backward(Activations& a);

  // The observers of the passes, piece by piece (model/pass_observer.hpp: the gradient reduction,
  // the overlapped parameter gather, Megatron-FSDP), called in the order they were added.
  // Multi-token prediction's layers are the head piece's. An observer removes itself before it
  // goes.
  void add_observer(PassObserver* o) { observers_.push_back(o); }
  void remove_observer(PassObserver* o);
  // The pieces whose passes read or write each parameter (in spec order): a layer index,
  // kHeadPiece or kEmbedPiece (the tied embedding: both on the stage that has both).
  std::vector<std::vector<int>> pieces_of_params() const;

  const LayerWeights& layer_weights(int layer) const { return weights_[shard_.local_index(layer)]; }
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t vocab_local() const { return vocab_local_; }
  int64_t kv_heads_local() const { return kv_heads_local_; }  // the KV cache's heads
  // RoPE of this rank's heads for rows at positions r % seq_len (or given positions).
  RopeSpec rope_spec(int64_t seq_len) const {
    RopeSpec r = rope_;
    r.seq_len = seq_len;
    return r;
  }
  // ALiBi of this rank's heads; null without it.
  const AttentionAlibi* alibi() const { return cfg_.alibi() ? &alibi_ : nullptr; }
  // The document tables of a micro-batch's attention (null when its samples have none).
  const AttentionDocuments* documents(const Activations& a);
  // The output layer's weight: the tied word embedding, or lm_head.
  const char* output_weight_name() const { return cfg_.tied_head() ? "wte" : "lm_head"; }
  // The configured norm (LayerNorm or RMSNorm; mean and bias unused by RMSNorm; with
  // --apply-layernorm-1p the weight applied is 1 + w).
  void norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& w,
                    const Tensor& b);
  // sum = a + b, out = the model's norm of sum (one pass where the backend has one; sum may be a).
  void add_norm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                        const Tensor& b, const Tensor& w, const Tensor& bias);
  Backend& backend() { return be_; }
  Communicator& tp_comm() { return tp_; }
  // The parts of layer `layer` (held by this rank), chosen once from its spec (model/parts.hpp).
  AttentionPart& attention_part(int layer) { return *attention_[shard_.local_index(layer)]; }
  MlpPart& mlp_part(int layer) { return *mlp_[shard_.local_index(layer)]; }
  ~GPTModel();

  // MoE statistics of this rank's MoE layers, summed over the training micro-batches' forwards
  // since the last reset (recomputation adds nothing): the load-balancing metric (the aux loss
  // without its coefficient) and the z-loss metric (mean logsumexp^2), per layer.
  struct MoEStats {
    double balance = 0, z = 0;
    int64_t micro_batches = 0;
  };
  const std::vector<MoEStats>& moe_stats() const { return moe_stats_; }
  void reset_moe_stats();
  // Tokens per expert (and the aux-loss-free expert bias). The training forwards of a step count
  // each MoE layer's routed tokens (recomputation adds nothing); begin_step_routing forgets them
  // (each attempt of an iteration starts again); end_step_routing, once a step after the last
  // backward, sums them over the global batch (grad_group: the DP x CP ranks; null for one),
  // adds them to the counts since the last take_logged_tokens, and with
  // --moe-router-enable-expert-bias moves each expert's bias by rate * sign(mean - load): the
  // same on every rank. take_logged_tokens returns (per local layer, E counts; empty for dense
  // layers) and clears them.
  void begin_step_routing();
  void end_step_routing(Communicator* grad_group);
  // The model's per-step state (model/step_hooks.hpp), in the order a step runs them: FP8's
  // delayed scaling, the MoE router's loads and expert bias, multi-token prediction's losses;
  // those this rank has.
  std::vector<StepHook*> step_hooks() const;
  std::vector<std::vector<int64_t>> take_logged_tokens();
  // The expert bias of MoE layer `layer` (held by this rank), f32 on the host: the routing's
  // source of truth (checkpoints save and restore it).
  const std::vector<float>& expert_bias(int layer) const;
  void set_expert_bias(int layer, const float* values);
  // Expert parallelism: the group of ranks that split the experts (its size is the shard's
  // ep_size). Without a call, a group of one.
  void set_expert_comm(Communicator& ep);
  // Context parallelism: the ring of CP ranks (its size is the shard's cp_size). Needed before a
  // forward when cp_size > 1.
  void set_context_comm(Communicator& cp) { cp_comm_ = &cp; }
  // Selective recomputation of a MoE layer's routed experts: their inputs and activations from
  // the kept routing.
  void moe_recompute(PhaseSequence& phase, LayerActivations& la);
  // The MoE MLP of `layer` for inference (generation, serving): `rows` rows of ln (n,C) -> out
  // (n,C), a partial sum over TP like fc2's output (the caller reduces it). Dropless whatever the
  // capacity factor (as Hugging Face's Mixtral); TP rank 0's logits route every rank. The
  // scratch holds up to `rows` rows (make_moe_scratch).
  struct MoEScratch {
    int64_t rows = 0;
    Tensor logits_c, logits, expert, weight, row, x, fc1, act, out, sfc1, sact, tmp;
  };
  MoEScratch make_moe_scratch(int64_t rows) const;
  void moe_mlp(int layer, const Tensor& ln, Tensor& out, MoEScratch& s);

  // FP8 (model/fp8.hpp, docs/training.md "FP8"): the transformer layers' GEMMs of this shard run
  // in FP8 as `c` says (c.enabled), from now on; needs the context-parallel ring set first where
  // there is one. Its delayed scaling is a step hook (step_hooks()).
  void set_fp8(const Fp8Config& c);
  Fp8Scaling* fp8() { return fp8_.get(); }

  // Output of this stage's last layer (what the next stage receives).
  Tensor& stage_output(Activations& a);

  // Sequence parallelism: the LayerNorm weights and biases see only this rank's tokens, so their
  // gradients are partial sums over the TP group. Called once per step for each piece whose
  // gradients are complete (after the last micro-batch's backward of it), it all-reduces them
  // over TP (phase "sp-grad-all-reduce"); nothing to do without sequence parallelism.
  void reduce_sequence_parallel_grads(int piece);
  bool sequence_parallel() const { return sp_; }

 private:
  const Tensor& layer_input(int layer, const Activations& a) const;
  // A transformer layer's linear layer (GEMM g of layer l; of its global expert `expert` where
  // >= 0): matmul_forward / matmul_backward, in FP8 where the layer runs in FP8. `a`: whose
  // micro-batch (training forwards record amaxes). An FP8 expert block of no rows computes its
  // scales (their reductions, which every TP and CP rank makes alike) and no GEMM.
  void linear_forward(int l, Fp8Gemm g, Tensor& out, const Tensor& inp, const Tensor& w,
                      const Tensor* bias, const Activations& a, int expert = -1);
  void linear_backward(int l, Fp8Gemm g, Tensor* dinp, Tensor& dw, Tensor* dbias,
                       const Tensor& dout, const Tensor& inp, const Tensor& w, int expert = -1);
  bool fp8_layer(int l) const { return fp8_ && fp8_->active(shard_.local_index(l)); }
  // The dense MLP of layer l (model/mlp.cpp; a MoE layer's shared expert too): la.ln2 -> out (N,
  // C, partial over TP), and its backward from dout (every row) to dinp (partial over TP).
  void dense_mlp_forward(PhaseSequence& phase, int l, const Activations& a, LayerActivations& la,
                         Tensor& out);
  void dense_mlp_backward(PhaseSequence& phase, int l, Activations& a, const LayerActivations& la,
                          const Tensor& dout, Tensor& dinp);
  // The vocabulary-parallel cross-entropy of logits (N, Vl) against targets (-1: no loss): the
  // token losses (N, f32) and, in place, the logits' gradient times grad_scale; a's row
  // statistics as scratch (model/sequence_parallel.cpp).
  void cross_entropy(Tensor& losses, Tensor& logits, const Tensor& targets, Activations& a,
                     float grad_scale);
  // A TP all-reduce inside a layer: phase "tp-all-reduce" where TP > 1.
  void tp_reduce(PhaseSequence& phase, Tensor& t);
  // Sequence parallelism. Rows of a micro-batch's (B*T) token rows this rank holds in the
  // LayerNorm/dropout/residual regions: [row_begin, row_begin + local_rows); all of them without.
  int64_t local_rows(const Activations& a) const;
  int64_t row_begin(const Activations& a) const;
  int64_t dropout_row_begin(const Activations& a) const;  // row_begin (a test hook aside)
  // This rank's rows of a full (B*T, C) tensor (the whole tensor without sequence parallelism).
  Tensor own_rows(const Tensor& full, const Activations& a) const;
  // A row-parallel GEMM's partial output `full` (B*T rows) summed over TP: all-reduced in place
  // (returns it), or with sequence parallelism reduce-scattered (returns this rank's rows).
  Tensor reduce_rows(PhaseSequence& phase, Tensor& full, const Activations& a);
  // With sequence parallelism: every rank's rows of `full`, each written into its own rows, to
  // all (in place). Nothing to do without.
  void gather_rows(PhaseSequence& phase, Tensor& full);
  // The gradient a column-parallel GEMM's backward reads, from the residual gradient dres: through
  // the dropout mask of `site` when active, gathered over TP with sequence parallelism (into
  // tmp_c when either applies; else dres itself).
  const Tensor& branch_grad(PhaseSequence& phase, Activations& a, const DropoutSpec& site);
  LayerActivations& acts_of(int layer, Activations& a) const;
  friend class ModelPart;
  // The MLP's activation (of every layer: GELU, SwiGLU or squared ReLU): la.fc1 -> la.gelu, and
  // fc1 output -> out.
  void activation_forward(PhaseSequence& phase, LayerActivations& la);
  void mlp_activation(Tensor& out, const Tensor& fc1);
  // w, or 1 + w (in a scratch tensor) with --apply-layernorm-1p.
  const Tensor& norm_weight(const Tensor& w);
  void norm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout, const Tensor& inp,
                     const Tensor& w, const Tensor& mean, const Tensor& rstd);
  // The hidden dropout of a site (inactive outside training or at p = 0), and the attention
  // dropout of a layer (null when inactive).
  DropoutSpec hidden_dropout(int layer, DropoutKind kind, const Activations& a) const;
  const AttentionDropout* attention_dropout(int layer, const Activations& a);
  // Refills what the layer's backward reads and the plan did not keep.
  void recompute_for_backward(int layer, Activations& a);
  // The MLP of a MoE layer (model/moe.cpp): ln2 -> out (N,C), partial over TP like fc2's; and
  // its backward from the branch gradient dy (N,C, every row) to a.dln (partial over TP).
  void moe_forward(PhaseSequence& phase, int layer, Activations& a, Tensor& out);
  void moe_backward(PhaseSequence& phase, int layer, Activations& a, const Tensor& dy);
  // The attention core of layer l (la.qkv -> la.att, la.lse) and its backward (a.datt -> a.dqkv):
  // the fused attention, or with context parallelism the ring (model/context_parallel.cpp).
  void attention_core_forward(int layer, Activations& a, LayerActivations& la);
  void attention_core_backward(int layer, Activations& a, LayerActivations& la);
  void ring_attention_forward(int layer, Activations& a, LayerActivations& la);
  // Multi-token prediction: each depth's targets from the micro-batch's ids and targets; its
  // forward after the main head (losses and logits' gradients) and its backward before the main
  // head's (adding the main hidden state's gradient to a.dres).
  void mtp_prepare(Activations& a);
  void mtp_forward(Activations& a, float grad_scale);
  void mtp_backward(Activations& a);
  // The word embedding of `ids` (B,T) into out (own rows, C): the vocabulary-parallel lookup
  // summed over TP (reduce-scattered with sequence parallelism).
  void embed_rows(PhaseSequence& phase, Tensor& out, const Tensor& ids, Activations& a);
  void ring_attention_backward(int layer, Activations& a, LayerActivations& la);
  // Hidden dropout over rows of a micro-batch's local rows (this rank's own rows, as
  // dropout_row_begin counts them), keyed by global sample and position (one call per run of
  // consecutive positions with context parallelism).
  void apply_hidden_dropout(Tensor& out, const Tensor& in, const DropoutSpec& d,
                            const Activations& a);
  // RoPE's positions: the documents' (set_documents), the global ones with context parallelism,
  // or null (row % T).
  const Tensor* rope_positions(const Activations& a) const;
  // btc (B,T,C) += wpe[position of each row] (the documents' position ids).
  void add_document_positions(Tensor& btc, const Tensor& wpe, Activations& a);
  // The learned position embedding added to (B,T,C) / its gradient from it: wpe[0:T], or the
  // rank's global positions with context parallelism.
  void add_position_embedding(Tensor& btc, Activations& a);
  void position_embedding_grad(const Tensor& dbtc, Activations& a);
  // Context parallelism: sums MoE counts over the CP ring, in place.
  void cp_sum(std::vector<int64_t>& counts);
  // The rows of a micro-batch this TP rank routes: its sequence-parallel rows, else its 1/TP.
  int64_t router_rows(const Activations& a) const;
  // The gradients of the expert and shared-expert MLPs, through the activation: fills dfc1
  // (dact's buffer, or SwiGLU's own) from dact and fc1.
  Tensor& activation_backward(PhaseSequence& phase, Tensor& dact, Tensor& dfc1_swiglu,
                              const Tensor& fc1);

  GPTConfig cfg_;
  ModelShard shard_;
  // Per local layer: its spec and parts (model/layer_spec.hpp).
  std::vector<LayerSpec> specs_;
  std::vector<std::unique_ptr<AttentionPart>> attention_;
  std::vector<std::unique_ptr<MlpPart>> mlp_;
  MlpActivation activation_ = MlpActivation::Gelu;  // every layer's
  bool swiglu_ = false;                             // activation_ is SwiGLU
  bool moe_layer(int layer) const {
    return specs_[static_cast<size_t>(shard_.local_index(layer))].mlp == MlpKind::MoE;
  }
  void init_moe();  // the router's settings and step hook (model/moe.cpp)
  void init_mtp();  // multi-token prediction's step hook (model/mtp.cpp)
  Backend& be_;
  Communicator& tp_;
  DType compute_ = DType::F32;
  RecomputeConfig recompute_;
  std::vector<LayerRecompute> plan_;  // indexed by shard_.local_index(layer)
  int64_t padded_vocab_ = 0, vocab_local_ = 0, vocab_begin_ = 0, valid_cols_ = 0;
  int64_t heads_local_ = 0, kv_heads_local_ = 0, hidden_local_ = 0, ffn_local_ = 0;
  RopeSpec rope_;  // this rank's heads (seq_len set per call)
  // --apply-layernorm-1p: ones and the (1 + w) scratch, max(C, hd) long (the q/k norms are hd
  // wide), and the view of it norm_weight last returned.
  Tensor norm_ones_, norm_w1p_, norm_w1p_view_;
  AttentionAlibi alibi_;          // this rank's heads among all (ALiBi)
  AttentionDocuments documents_;  // what documents() last returned
  bool sp_ = false;               // sequence parallelism on (TP > 1)
  std::unique_ptr<ParamStore> params_;
  std::vector<LayerWeights> weights_, grads_;  // indexed by shard_.local_index(layer)
  std::vector<float> host_losses_;             // staging for the loss readback
  AttentionDropout attn_drop_;                 // what attention_dropout() hands out
  std::vector<std::string> range_names_;       // NVTX: layer-L-forward, layer-L-backward
  MoERouting routing_;                         // MoE: the router's settings
  std::vector<MoEStats> moe_stats_;            // indexed by shard_.local_index(layer)
  // Per local layer (E entries for MoE layers): the expert bias (f32), the step's routed tokens
  // (this rank's micro-batches, CP-ring totals) and the global counts since the last log.
  std::vector<std::vector<float>> expert_bias_;
  std::vector<std::vector<int64_t>> step_tokens_, logged_tokens_;
  std::vector<MtpLoss> mtp_losses_;  // per depth (mtp_losses)
  std::vector<float> mtp_host_;      // staging for the MTP token losses
  bool recomputing_ = false;         // inside recompute_for_backward
  Communicator* ep_ = nullptr;       // expert parallelism (set_expert_comm)
  Communicator* cp_comm_ = nullptr;  // context parallelism (set_context_comm)
  std::unique_ptr<Fp8Scaling> fp8_;  // FP8 GEMMs (set_fp8); null: none
  // The step hooks of the MoE router (any MoE layer here) and multi-token prediction (the last
  // stage with MTP); FP8's is fp8_ itself.
  std::unique_ptr<StepHook> routing_hook_, mtp_hook_;
  std::vector<PassObserver*> observers_;  // add_observer
  // Calls `event` of every observer for `piece`.
  void notify(void (PassObserver::*event)(int), int piece) {
    for (PassObserver* o : observers_) (o->*event)(piece);
  }
  // Testing (the layout-equivalence test): TESSERA_TEST_MOE_LOGIT_BIAS="e:v,e:v" adds v to
  // expert e's router logit (to force all tokens onto some experts), and
  // TESSERA_FAULT_MOE_DISPATCH=wrong-rank sends one token copy to the wrong expert rank.
  std::vector<std::pair<int, float>> test_logit_bias_;
  bool fault_wrong_rank_ = false;
  // Testing (GPT.RouterMutationsMissTheReference): TESSERA_FAULT_ROUTER.
  bool fault_bias_in_weights_ = false, fault_no_group_limit_ = false;
  // Counts the expert side of a routed micro-batch: exchanges the rows per expert over the EP
  // group and fills la's blocks and per-rank rows.
  void moe_plan(LayerActivations& la, const std::vector<int64_t>& kept);
  // The allgather dispatcher: gathers the EP group's tokens and logits, routes each rank's, and
  // permutes the copies for this rank's experts into la.moe_xe (blocks by rank, then expert).
  void moe_allgather_dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la,
                              int64_t group_rows, const MoERouting& routing);
  // The routing options of MoE layer `layer`: routing_ with its expert bias.
  MoERouting routing_of(int layer) const;
  // Adds a training micro-batch's routed counts (per group and expert) to the step's.
  void count_step_tokens(int local_layer, const std::vector<int64_t>& routed);
  // The steps of moe_forward: the router logits (every rank's rows in la.moe_logits); the logged
  // load-balance and z-loss metrics; the token copies to the expert side; the experts' MLPs into
  // oute; their outputs back into token order in out.
  void moe_router_forward(PhaseSequence& phase, const LayerWeights& w, Activations& a,
                          LayerActivations& la);
  void moe_record_stats(int local_layer, const Activations& a, const LayerActivations& la,
                        int64_t group_rows);
  void moe_dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la, int64_t group_rows,
                    const std::vector<int64_t>& kept, bool allgather, const MoERouting& routing);
  void moe_experts_forward(PhaseSequence& phase, int l, const LayerWeights& w, const Activations& a,
                           LayerActivations& la, Tensor& oute);
  void moe_combine(PhaseSequence& phase, Activations& a, LayerActivations& la, Tensor& oute,
                   Tensor& out, bool allgather);
  // The steps of moe_backward, mirrors of the forward's: the expert outputs' and routing weights'
  // gradients from dy; the experts' MLPs' backward (input gradients into de); those back into
  // token order in a.dln; the router's gradients.
  void moe_combine_backward(PhaseSequence& phase, Activations& a, LayerActivations& la,
                            const Tensor& dy, Tensor& de, bool allgather);
  void moe_experts_backward(PhaseSequence& phase, int l, const LayerWeights& w, LayerWeights& g,
                            Activations& a, LayerActivations& la, Tensor& de);
  void moe_dispatch_backward(PhaseSequence& phase, Activations& a, LayerActivations& la, Tensor& de,
                             bool allgather);
  void moe_router_grad(PhaseSequence& phase, const LayerWeights& w, LayerWeights& g, Activations& a,
                       LayerActivations& la);
};

}  // namespace tessera
