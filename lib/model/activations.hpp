// activations.hpp: the buffers of a stage's passes (model/gpt.hpp runs them, model/parts.hpp's
// parts fill their share): one transformer layer's activations, one micro-batch's (a model
// chunk's layers, the embedding's and the head's tensors, the shared scratch), and their bytes for
// the --dry-run estimate (model/activation_slots.cpp builds both with the same code).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.hpp"
#include "core/tensor.hpp"
#include "model/gpt_config.hpp"
#include "model/params.hpp"
#include "model/recompute.hpp"

namespace tessera {

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

}  // namespace tessera
