// part_services.hpp: what the parts of a layer (model/parts.hpp) and the block's plumbing
// (model/gpt.hpp) share on one rank's shard, declared below the model so that a part never
// reaches into it: the backend and the groups (TP, and the expert and context groups where they
// exist), the layers' GEMMs in FP8 where a layer runs in FP8 (Fp8Scaling), the configured norm,
// the token rows of a rank under sequence parallelism and their reductions over TP, hidden and
// attention dropout keyed by global coordinates, the attention core (the fused attention, or the
// context-parallel ring), RoPE and ALiBi of this rank's heads, and the vocabulary-parallel
// cross-entropy. One per model (GPTModel owns it); the parts hold a pointer to it.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/activations.hpp"
#include "model/fp8.hpp"
#include "model/params.hpp"
#include "model/weight_grads.hpp"

namespace tessera {

class PhaseSequence;  // core/phase_timer.hpp

class PartServices {
 public:
  // cfg and shard are the model's (they outlive this).
  PartServices(const GPTConfig& cfg, const ModelShard& shard, Backend& backend, Communicator& tp,
               DType compute);
  PartServices(const PartServices&) = delete;
  PartServices& operator=(const PartServices&) = delete;

  Backend& backend() const { return be_; }
  Communicator& tp() const { return tp_; }
  // The dtype of activations and of the weights the passes read.
  DType compute() const { return compute_; }
  int64_t heads_local() const { return heads_local_; }
  int64_t kv_heads_local() const { return kv_heads_local_; }  // the KV cache's heads
  // This rank's vocabulary shard: its first row and its rows (the padded vocabulary / TP).
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t vocab_local() const { return vocab_local_; }
  // The layer's buffers of a micro-batch (its model chunk's).
  // The chunk's layers in order, then multi-token prediction's.
  LayerActivations& acts(int layer, Activations& a) const {
    const LayerRange& c = shard_.chunks[a.chunk];
    const int i =
        shard_.is_mtp_layer(layer) ? c.size() + layer - shard_.mtp_begin : layer - c.begin;
    return a.layers[static_cast<size_t>(i)];
  }

  // Expert parallelism: the group that splits the experts (its size is the shard's ep_size;
  // without a call, none). Context parallelism: the ring of CP ranks, needed before a forward
  // when cp_size > 1.
  void set_expert_comm(Communicator& ep);
  Communicator* expert_comm() const { return ep_; }
  void set_context_comm(Communicator& cp) { cp_ = &cp; }
  Communicator* context_comm() const { return cp_; }
  // Sums integer counts over the CP ring, in place (exact in doubles).
  void cp_sum(std::vector<int64_t>& counts);

  // FP8 (model/fp8.hpp): the layers' GEMMs run in FP8 as `c` says, from now on (after
  // set_context_comm where there is a ring); null scaling without it.
  void set_fp8(const Fp8Config& c);
  Fp8Scaling* fp8() const { return fp8_.get(); }
  bool fp8_layer(int l) const { return fp8_ && fp8_->active(shard_.local_index(l)); }
  // A transformer layer's linear layer (GEMM g of layer l; of its global expert `expert` where
  // >= 0): matmul_forward / matmul_backward, in FP8 where the layer runs in FP8. `a`: whose
  // micro-batch (training forwards record amaxes). An FP8 expert block of no rows computes its
  // scales (their reductions, which every TP and CP rank makes alike) and no GEMM.
  void linear_forward(int l, Fp8Gemm g, Tensor& out, const Tensor& inp, const Tensor& w,
                      const Tensor* bias, const Activations& a, int expert = -1);
  void linear_backward(int l, Fp8Gemm g, Tensor* dinp, Tensor& dw, Tensor* dbias,
                       const Tensor& dout, const Tensor& inp, const Tensor& w, int expert = -1);

  // The GEMMs of a backward outside linear_backward's FP8 (matmul_backward, the MLP's fused
  // GELU one, the experts' grouped one): run whole, or during a zero-bubble B pass the input
  // half now and the weight half recorded for the W pass (weight_grads()).
  void gemm_backward(Tensor* dinp, Tensor& dw, Tensor* dbias, const Tensor& dout, const Tensor& inp,
                     const Tensor& w);
  void gemm_gelu_backward(Tensor& dpre, Tensor& dw, Tensor* dbias, const Tensor& dout,
                          const Tensor& inp, const Tensor& w, const Tensor& pre);
  void grouped_gemm_backward(const std::vector<Backend::GroupedGemm>& groups);
  // The word embedding's gradient (embedding_backward), recorded for the W pass too where the
  // output layer is tied to it (its GEMM's weight half writes the same gradient).
  void embedding_grad(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t row_begin);
  WeightGradStore& weight_grads() { return weight_grads_; }

  // The configured norm (LayerNorm or RMSNorm; mean and bias unused by RMSNorm; with
  // --apply-layernorm-1p the weight applied is 1 + w). add_norm_forward: sum = a + b, out = the
  // norm of sum (one pass where the backend has one; sum may be a).
  void norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& w,
                    const Tensor& b);
  void add_norm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                        const Tensor& b, const Tensor& w, const Tensor& bias);
  void norm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout, const Tensor& inp,
                     const Tensor& w, const Tensor& mean, const Tensor& rstd);

  // Inside a recomputation (full recomputation's forward again): training forwards record
  // nothing then (FP8 amaxes, the router's statistics).
  bool recomputing() const { return recomputing_; }
  void set_recomputing(bool on) { recomputing_ = on; }

  // Sequence parallelism. The rows of a micro-batch's (B*T) token rows this rank holds in the
  // norm/dropout/residual regions: [row_begin, row_begin + local_rows); all of them without.
  bool sequence_parallel() const { return sp_; }
  int64_t local_rows(const Activations& a) const;
  int64_t row_begin(const Activations& a) const;
  // This rank's rows of a full (B*T, C) tensor (the whole tensor without sequence parallelism).
  Tensor own_rows(const Tensor& full, const Activations& a) const;
  // A row-parallel GEMM's partial output `full` (B*T rows) summed over TP: all-reduced in place
  // (returns it), or with sequence parallelism reduce-scattered (returns this rank's rows).
  Tensor reduce_rows(PhaseSequence& phase, Tensor& full, const Activations& a);
  // With sequence parallelism: every rank's rows of `full`, each written into its own rows, to
  // all (in place). Nothing to do without.
  void gather_rows(PhaseSequence& phase, Tensor& full);
  // A TP all-reduce inside a layer: phase "tp-all-reduce" where TP > 1.
  void tp_reduce(PhaseSequence& phase, Tensor& t);
  // The gradient a column-parallel GEMM's backward reads, from the residual gradient a.dres:
  // through the dropout mask of `site` when active, gathered over TP with sequence parallelism
  // (into a.tmp_c when either applies; else a.dres itself).
  const Tensor& branch_grad(PhaseSequence& phase, Activations& a, const DropoutSpec& site);

  // The hidden dropout of a site (inactive outside training or at p = 0), applied over a
  // micro-batch's local rows (this rank's own rows), keyed by global sample and position (one
  // call per run of consecutive positions with context parallelism).
  DropoutSpec hidden_dropout(int layer, DropoutKind kind, const Activations& a) const;
  void apply_hidden_dropout(Tensor& out, const Tensor& in, const DropoutSpec& d,
                            const Activations& a);

  // The attention core of layer l (la.qkv -> la.att, la.lse) and its backward (a.datt -> a.dqkv):
  // the fused attention, or with context parallelism the ring (model/context_parallel.cpp).
  void attention_core_forward(int layer, Activations& a, LayerActivations& la);
  void attention_core_backward(int layer, Activations& a, LayerActivations& la);
  // RoPE of this rank's heads for rows at positions r % seq_len (or given positions); applied to
  // qkv (or its gradient, backward) at the micro-batch's positions: the documents', the global
  // ones with context parallelism, or r % T.
  RopeSpec rope_spec(int64_t seq_len) const {
    RopeSpec r = rope_;
    r.seq_len = seq_len;
    return r;
  }
  void rope(Tensor& qkv, const Activations& a, bool backward);
  // ALiBi of this rank's heads; null without it.
  const AttentionAlibi* alibi() const { return cfg_.alibi() ? &alibi_ : nullptr; }

  // The vocabulary-parallel cross-entropy of logits (N, Vl) against targets (-1: no loss): the
  // token losses (N, f32) and, in place, the logits' gradient times grad_scale; a's row
  // statistics as scratch.
  void cross_entropy(Tensor& losses, Tensor& logits, const Tensor& targets, Activations& a,
                     float grad_scale);

  // State that the parts of one kind share in this model, made on first use (the MoE layers' step
  // hook, model/moe.hpp); it lives as long as the services.
  template <class T>
  T& shared() {
    for (const auto& h : shared_)
      if (auto* held = dynamic_cast<Held<T>*>(h.get())) return held->value;
    shared_.push_back(std::make_unique<Held<T>>());
    return static_cast<Held<T>*>(shared_.back().get())->value;
  }

 private:
  struct HeldBase {
    virtual ~HeldBase() = default;
  };
  template <class T>
  struct Held final : HeldBase {
    T value;
  };
  int64_t dropout_row_begin(const Activations& a) const;  // row_begin (a test hook aside)
  // w, or 1 + w (in a scratch tensor) with --apply-layernorm-1p.
  const Tensor& norm_weight(const Tensor& w);
  // The attention dropout of a layer (null when inactive); the document tables of a
  // micro-batch's attention (null when its samples have none).
  const AttentionDropout* attention_dropout(int layer, const Activations& a);
  const AttentionDocuments* documents(const Activations& a);
  // RoPE's positions: the documents' (GPTModel::set_documents), the global ones with context
  // parallelism, or null (row % T).
  const Tensor* rope_positions(const Activations& a) const;
  void ring_attention_forward(int layer, Activations& a, LayerActivations& la);
  void ring_attention_backward(int layer, Activations& a, LayerActivations& la);

  const GPTConfig& cfg_;
  const ModelShard& shard_;
  Backend& be_;
  Communicator& tp_;
  DType compute_;
  Communicator* ep_ = nullptr;  // set_expert_comm
  Communicator* cp_ = nullptr;  // set_context_comm
  std::unique_ptr<Fp8Scaling> fp8_;
  WeightGradStore weight_grads_;  // zero-bubble's deferred weight halves
  bool sp_ = false;               // sequence parallelism on (TP > 1)
  bool recomputing_ = false;
  int64_t heads_local_ = 0, kv_heads_local_ = 0;
  int64_t vocab_local_ = 0, vocab_begin_ = 0, valid_cols_ = 0;
  RopeSpec rope_;         // this rank's heads (seq_len set per call)
  AttentionAlibi alibi_;  // this rank's heads among all (ALiBi)
  // --apply-layernorm-1p: ones and the (1 + w) scratch, max(C, hd) long (the q/k norms are hd
  // wide), and the view of it norm_weight last returned.
  Tensor norm_ones_, norm_w1p_, norm_w1p_view_;
  AttentionDropout attn_drop_;                     // what attention_dropout() hands out
  AttentionDocuments documents_;                   // what documents() last returned
  std::vector<std::unique_ptr<HeldBase>> shared_;  // shared<T>()
};

}  // namespace tessera
