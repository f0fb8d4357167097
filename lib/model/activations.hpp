// activations.hpp: the buffers of a stage's passes (model/gpt.hpp runs them, model/parts.hpp's
// parts fill their share): one transformer layer's activations, one micro-batch's (a model
// chunk's layers, the embedding's and the head's tensors, the shared scratch), and their bytes for
// the --dry-run estimate (model/activation_slots.cpp builds both with the same code).
#pragma once

#include <cstdint>
#include <memory>
#include <typeinfo>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "model/gpt_config.hpp"
#include "model/params.hpp"
#include "model/recompute.hpp"

namespace tessera {

// The buffers a part keeps beyond the block's, one struct per part kind, declared in the part's
// own file (MoE's in model/moe.hpp, multi-latent attention's in model/mla.cpp, the q/k norms' in
// model/attention.cpp) and held here by type, so a new part adds its buffers without touching
// this file. Copies are deep in the struct and shallow in its tensors (views of the same memory),
// as the rest of LayerActivations: a layer's view of a shared working set is a copy.
class PartBuffers {
 public:
  PartBuffers() = default;
  PartBuffers(const PartBuffers& o) { *this = o; }
  PartBuffers(PartBuffers&&) = default;
  PartBuffers& operator=(const PartBuffers& o) {
    if (this == &o) return *this;
    items_.clear();
    for (const Item& i : o.items_) items_.push_back({i.type, i.value->clone()});
    return *this;
  }
  PartBuffers& operator=(PartBuffers&&) = default;

  // The part's struct, made empty on first use.
  template <class T>
  T& get() {
    if (T* t = find<T>()) return *t;
    auto h = std::make_unique<Holder<T>>();
    T& t = h->value;
    items_.push_back({&typeid(T), std::move(h)});
    return t;
  }
  template <class T>
  const T& get() const {
    const T* t = find<T>();
    TESSERA_CHECK(t, "a part's buffers read before they were built");
    return *t;
  }
  // Null where this set holds no T (a layer of another kind).
  template <class T>
  T* find() {
    for (Item& i : items_)
      if (*i.type == typeid(T)) return &static_cast<Holder<T>*>(i.value.get())->value;
    return nullptr;
  }
  template <class T>
  const T* find() const {
    return const_cast<PartBuffers*>(this)->find<T>();
  }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual std::unique_ptr<Base> clone() const = 0;
  };
  template <class T>
  struct Holder final : Base {
    T value;
    std::unique_ptr<Base> clone() const override { return std::make_unique<Holder>(*this); }
  };
  struct Item {
    const std::type_info* type;
    std::unique_ptr<Base> value;
  };
  std::vector<Item> items_;
};

// Activations of one transformer layer for one micro-batch. N = B*T tokens; Cl, Fl, Hl are this
// rank's shares of the hidden width, ffn width and heads. With recomputation (model/recompute.hpp)
// some of these tensors are views of a working set shared by every micro-batch in flight: they are
// filled again just before the layer's backward reads them.
struct LayerActivations {
  Tensor ln1, ln1_mean, ln1_rstd;  // (N,C), (N), (N)
  Tensor qkv;                      // (B,T,(Hl+2Gl)*hd): query, key, value heads (RoPE applied)
  Tensor att, lse;                 // (B,T,Cl), (B,Hl,T)
  Tensor res1;                     // (N,C)  x + attention
  Tensor ln2, ln2_mean, ln2_rstd;
  // (N,Fl) (fc1 (N,2Fl) with SwiGLU: gate and up); gelu: the activation's output. In a MoE layer
  // its shared expert's (undefined without one).
  Tensor fc1, gelu;
  Tensor res2;        // (N,C)  layer output
  PartBuffers parts;  // what the layer's parts keep beyond these
};

// The block's own parameters (or gradients) of one layer, its two norms, resolved once so a step
// does no name look-ups (norm biases with RMSNorm are undefined). Each part binds its own
// (model/parts.hpp).
struct LayerWeights {
  Tensor ln1_w, ln1_b, ln2_w, ln2_b;
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

// A forward for generation (lib/inference/engine.hpp, docs/generation.md): the same forward as
// training's over one batch of new tokens of several sequences (B = 1, T = their n rows, the rows'
// positions in Activations::doc_positions), each attending to its sequence's cached keys and
// values: a decode step (one new token per sequence, its row table on the backend, the attention
// planned for contexts up to `context`) or a prefill's segments. On the last stage the head
// returns the logits of `out_rows` (S rows) instead of a loss.
struct InferenceContext {
  bool decode = false;
  Tensor table;  // a decode step's rows (n, 3) int32: cache slot, position, row
  int64_t context = 0;
  const std::vector<Backend::KvSegment>* segments = nullptr;
  std::vector<Tensor>* k_cache = nullptr;  // per local layer (slots, Gl, Tmax, hd)
  std::vector<Tensor>* v_cache = nullptr;
  // The head: the output rows (S) int32, their hidden states (S, C), the logits in f32 (S, Vl; the
  // logits themselves in f32 models) and all TP ranks' (tp * S * Vl), which the head leaves in
  // `logits`.
  Tensor out_rows, rows_x, logits_f32, gathered, logits;
};

// Everything one micro-batch needs on this stage (one model chunk of it with the interleaved
// schedule), allocated once for a fixed (B,T).
struct Activations {
  int B = 0, T = 0;
  int chunk = 0;  // the model chunk (ModelShard::chunks) whose layers these are
  DropoutContext dropout;
  InferenceContext* inference = nullptr;  // generation's forward; null: training or evaluation
  Tensor ids, targets;                    // (B,T) int32; targets < 0 carry no loss
  Tensor input;  // (B,T,C): embedding output, or what the previous stage sent
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
  // The parts' own scratch (MLA's, MoE's, the q/k norms'), by type as LayerActivations::parts.
  PartBuffers part_scratch;
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
// Zero-bubble (model/weight_grads.hpp): the bytes a B pass of a (B,T) micro-batch of model chunk
// `chunk` holds until its W pass: each deferred GEMM's input and output gradient (the parts'
// deferred_elements, the output layer's and multi-token prediction's GEMMs).
double weight_pass_bytes(const GPTConfig& cfg, const ModelShard& shard, int B, int T, DType compute,
                         int chunk);

}  // namespace tessera
