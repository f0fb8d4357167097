// gpt_config.hpp: the model's hyper-parameters (GPT-2 by default, the Llama family's options
// beside them), vocabulary padding and validation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

namespace tessera {

struct GPTConfig {
  int num_layers = 2;
  int hidden_size = 64;
  int num_attention_heads = 4;
  int ffn_hidden_size = 0;  // 0: 4 * hidden_size
  int seq_length = 64;
  int max_position_embeddings = 0;  // 0: seq_length
  int64_t vocab_size = 0;           // the tokenizer's (true) vocabulary size
  int make_vocab_size_divisible_by = 128;
  double init_method_std = 0.02;
  double layernorm_epsilon = 1e-5;
  // Dropout in training (GPT-2 used 0.1 for both); evaluation and generation never drop. Masks
  // are keyed by global coordinates (core/dropout.hpp), so every layout drops the same elements.
  double attention_dropout = 0;  // on the attention probabilities
  double hidden_dropout = 0;     // on the embedding output and each residual branch's output

  // The Llama family (docs/model.md), each behind Megatron-LM's option; the defaults are GPT-2.
  // learned_absolute | rope | alibi | none
  std::string position_embedding_type = "learned_absolute";
  double rotary_base = 10000;   // RoPE's theta
  double rotary_percent = 1.0;  // share of each head's features that rotate, (0, 1]
  // Llama 3's RoPE frequency scaling (Megatron's --use-rope-scaling / --rope-scaling-factor; the
  // other three as Hugging Face's rope_scaling "llama3" names them, Megatron's fixed values).
  bool use_rope_scaling = false;
  double rope_scaling_factor = 8;
  double rope_scaling_low_freq_factor = 1, rope_scaling_high_freq_factor = 4;
  double rope_scaling_original_max_positions = 8192;
  std::string normalization = "LayerNorm";  // LayerNorm | RMSNorm (epsilon: layernorm_epsilon)
  bool swiglu = false;                      // the MLP's activation: SwiGLU instead of GELU
  bool group_query_attention = false;       // key/value heads shared by groups of query heads
  int num_query_groups = 1;                 // with group_query_attention (1: multi-query)
  bool untie_embeddings_and_output_weights = false;  // an output layer of its own
  bool add_bias_linear = true;                       // biases in the QKV, projection and MLP GEMMs
  // Qwen2 and other small Megatron options (docs/model.md).
  bool add_qkv_bias = false;        // biases on the QKV projection even with --disable-bias-linear
  int kv_channels = 0;              // features per head (0: hidden_size / num_attention_heads)
  bool apply_layernorm_1p = false;  // norm weights stored as w, applied as (1 + w), zero init
  bool rotary_interleaved = false;  // RoPE pairs (2i, 2i+1) instead of (i, i + d/2)
  bool squared_relu = false;        // the MLP's activation relu(x)^2 instead of GELU
  // Qwen3 (Megatron's --qk-layernorm): each query and key head normalized over its head_dim
  // features by the model's norm (RMSNorm or LayerNorm) with weights of its own per layer
  // (attn.q_norm, attn.k_norm, shared by all heads), after the QKV projection and before RoPE.
  bool qk_layernorm = false;
  // Multi-latent attention (DeepSeek-V2/V3, Megatron-Core's MLA; docs/model.md): queries from a
  // compressed latent of q_lora_rank features (0: straight from the hidden state), keys and values
  // from one of kv_lora_rank features, each latent through the model's norm when qk_layernorm;
  // per head qk_head_dim features without position and qk_pos_emb_head_dim with RoPE (the keys'
  // RoPE part shared by all heads), values of v_head_dim. The attention runs on heads of
  // qk_head_dim + qk_pos_emb_head_dim features (head_dim()), the values padded with zeros.
  bool multi_latent_attention = false;
  int q_lora_rank = 0, kv_lora_rank = 0;
  int qk_head_dim = 128, qk_pos_emb_head_dim = 64, v_head_dim = 128;
  // RoPE's frequencies: rope, or yarn (YaRN, with MLA: --rotary-scaling-factor over the original
  // context, the beta_fast / beta_slow ramp, and the softmax scale times mscale(mscale_all_dim)^2).
  std::string rope_type = "rope";
  double rotary_scaling_factor = 1, mscale = 1, mscale_all_dim = 0;
  double beta_fast = 32, beta_slow = 1;
  int original_max_position_embeddings = 4096;
  // Multi-token prediction (DeepSeek-V3, Megatron-Core's MTP; docs/model.md): depth k = 1..D
  // predicts the token k + 1 positions ahead from the previous depth's hidden state (the main
  // model's last layer for k = 1) and the embedding of the token k ahead, through its norms, a
  // projection of the two concatenated, a transformer layer (layer index num_layers + k - 1, of the
  // last layer's kind) and a final norm, into the shared output layer. Its loss, times
  // mtp_loss_scaling_factor / D, joins the objective; on the last pipeline stage.
  int mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;

  // Mixture of Experts (Megatron-Core's MoE layer, docs/model.md): with num_experts > 0 the MLP of
  // the layers moe_layer_freq selects is a router over num_experts expert MLPs (each the model's
  // MLP, moe_ffn_hidden_size wide), every token going to its moe_router_topk experts.
  int num_experts = 0;          // 0: every layer's MLP is dense
  int moe_router_topk = 2;      // experts per token
  int moe_ffn_hidden_size = 0;  // each expert's width (0: ffn())
  // Which layers are MoE: "N" every N-th layer from layer 0 (layer l when l % N == 0), or a
  // pattern "[1,0,1,...]" with one entry per layer.
  std::string moe_layer_freq = "1";
  std::string moe_router_load_balancing_type = "aux_loss";  // aux_loss | seq_aux_loss | none
  double moe_aux_loss_coeff = 0;  // the load-balancing loss's weight in the objective
  double moe_z_loss_coeff = 0;    // the router z-loss's weight
  std::string moe_router_score_function = "softmax";  // softmax | sigmoid
  bool moe_router_pre_softmax = false;  // softmax over all experts, then the top k (no renorm)
  double moe_router_topk_scaling_factor = 0;  // routing weights times this (0: unscaled)
  // DeepSeek-V3's aux-loss-free balancing (sigmoid scores only): a per-expert bias added to the
  // scores for the choice of the top k only (the weights are the scores without it); after each
  // step it moves by rate * sign(mean load - the expert's load), loads counted over the global
  // batch (GPTModel::update_expert_bias). Not trained; saved in checkpoints.
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  // Group-limited routing: the experts in moe_router_num_groups equal groups; each token keeps
  // its moe_router_group_topk best groups and chooses its top k among their experts. A group's
  // score is the sum of its moe_router_group_score_experts best scores (0: topk / group_topk,
  // Megatron-Core's rule; 2: DeepSeek-V3's as Hugging Face computes it).
  int moe_router_num_groups = 0;  // 0: no group limit
  int moe_router_group_topk = 0;
  int moe_router_group_score_experts = 0;
  int moe_shared_expert_intermediate_size = 0;  // a dense expert every token goes through (0: none)
  // Token dropping: 0 is dropless (every token reaches its k experts); > 0 caps each expert at
  // ceil(tokens * k / E * factor) token copies per micro-batch, keeping the highest routing
  // weights (probs) or the earliest tokens (position).
  double moe_expert_capacity_factor = 0;
  std::string moe_token_drop_policy = "probs";  // probs | position
  // With expert parallelism, how tokens reach their experts' ranks (the same results): alltoall
  // (each rank's copies to their experts' ranks and back) or allgather (every rank gathers the EP
  // group's tokens, computes its experts' share, and the outputs are reduce-scattered).
  std::string moe_token_dispatcher_type = "alltoall";
  // The experts' GEMMs of a layer as one grouped GEMM per projection (Backend::grouped_matmul_*;
  // on CUDA cublasGemmGroupedBatchedEx) instead of one GEMM per expert: the same results. As in
  // Megatron-Core's GroupedMLP, the experts may have no biases (--disable-bias-linear).
  bool moe_grouped_gemm = false;

  bool rope() const { return position_embedding_type == "rope"; }
  bool mla() const { return multi_latent_attention; }
  bool yarn() const { return rope_type == "yarn"; }
  // YaRN's m(f, s) = 0.1 s ln f + 1 (1 when f <= 1), and MLA's softmax scale factor m(f,
  // mscale_all_dim)^2.
  double yarn_softmax_factor() const;
  bool learned_positions() const { return position_embedding_type == "learned_absolute"; }
  bool alibi() const { return position_embedding_type == "alibi"; }
  bool rmsnorm() const { return normalization == "RMSNorm"; }
  bool tied_head() const { return !untie_embeddings_and_output_weights; }
  bool mtp() const { return mtp_num_layers > 0; }
  // The word embedding on the last pipeline stage too: tied to the output layer, or read by
  // multi-token prediction (its copy's gradient is summed with the first stage's).
  bool embedding_on_last_stage() const { return tied_head() || mtp(); }
  // The transformer layers with parameters: the model's and multi-token prediction's.
  int total_layers() const { return num_layers + mtp_num_layers; }
  // Key/value heads: the query groups with grouped-query attention, else one per query head.
  int kv_heads() const {
    return group_query_attention && !mla() ? num_query_groups : num_attention_heads;
  }
  // Features of a head that RoPE rotates (even).
  int rotary_dim() const;
  // The architecture in words, e.g. "RoPE (base 500000, 64 of 64 features), RMSNorm, SwiGLU,
  // grouped-query attention (8 key/value heads for 32), tied output layer, no linear biases".
  std::string describe() const;

  int ffn() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  int max_positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  // Features per head: --kv-channels, else hidden_size / num_attention_heads. The QKV projection
  // is heads * head_dim() wide and the output projection maps that back to hidden_size.
  int head_dim() const {
    if (mla()) return qk_head_dim + qk_pos_emb_head_dim;
    return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads;
  }
  // The width per head of the attention output the projection reads (MLA: v_head_dim).
  int value_dim() const { return mla() ? v_head_dim : head_dim(); }
  // Whether the QKV projection has biases (all linear biases, or --add-qkv-bias alone).
  bool qkv_bias() const { return add_bias_linear || add_qkv_bias; }
  // Megatron's padding: the smallest multiple of divisible_by * tp at or above vocab_size. Padded
  // entries are masked out of the loss, so the padding never changes what the model learns.
  int64_t padded_vocab_size(int tp_size) const;

  // MoE: whether layer l's MLP is a mixture of experts, the number of such layers, and each
  // expert's width.
  bool moe() const { return num_experts > 0; }
  bool is_moe_layer(int layer) const;
  int num_moe_layers() const;
  int moe_ffn() const { return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn(); }
  bool moe_dropless() const { return moe_expert_capacity_factor <= 0; }
  // The token copies one rank's experts can receive in a MoE layer from `tokens` tokens per rank
  // over `ep` expert-parallel ranks (the size of its expert-side buffers): every copy without EP
  // (tokens x top-k); with EP, from each rank at most tokens x min(top-k, local experts)
  // (dropless), or local experts x the capacity when a capacity factor drops the rest (Megatron's
  // get_capacity, ceil(tokens x top-k / experts x factor) per expert, as moe_route drops).
  int64_t moe_received_rows(int64_t tokens, int ep) const;
  // The scores summed into a group's score under group-limited routing.
  int moe_group_score_experts() const {
    return moe_router_group_score_experts > 0
               ? moe_router_group_score_experts
               : moe_router_topk / std::max(1, moe_router_group_topk);
  }

  // Throws ConfigError naming the option, its value and what is allowed.
  void validate() const;
  void validate_moe() const;
  void validate_moe_router() const;  // expert bias and group-limited routing
  void validate_mla() const;         // multi-latent attention and YaRN

  // Parameters of the whole model at tensor-parallel size 1 (tied head counted once), and those
  // one token uses (with MoE: k of the E experts of each MoE layer; the same as num_parameters
  // for a dense model).
  int64_t num_parameters() const;
  int64_t num_active_parameters() const;
  // Training FLOPs per token with Megatron's formula (forward + backward, no recompute):
  // 72*L*h^2*(1 + s/(6h) + V/(12*h*L)) per token = 6*(12*L*h^2 + V*h) + 12*L*s*h.
  double train_flops_per_token() const;
};

// Evaluation or generation at `seq` tokens per sample instead of the length `cfg` was trained with
// (0: unchanged); the model's positions stay what they are. ConfigError naming --seq-length and
// `source` (the checkpoint) when seq is outside [1, max_positions()].
void set_seq_length(GPTConfig& cfg, int seq, const std::string& source);

}  // namespace tessera
