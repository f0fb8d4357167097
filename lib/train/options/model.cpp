// model.cpp: the model's options (shape, architecture, dropout), their checks and the model's
// --dry-run lines (parameter count, architecture).
#include <cstdio>
#include <ostream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "train/options/option_group.hpp"

namespace tessera {
namespace {

class ModelOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    GPTConfig& m = o.model;
    p.group("Model").add_options()(
        "num-layers", po::value(&m.num_layers)->default_value(m.num_layers), "transformer layers")(
        "hidden-size", po::value(&m.hidden_size)->default_value(m.hidden_size), "hidden width")(
        "num-attention-heads",
        po::value(&m.num_attention_heads)->default_value(m.num_attention_heads),
        "attention heads (must divide hidden-size, unless --kv-channels is given)")(
        "ffn-hidden-size", po::value(&m.ffn_hidden_size)->default_value(0),
        "MLP width (0: 4 * hidden-size)")(
        "seq-length", po::value(&m.seq_length)->default_value(m.seq_length), "tokens per sample")(
        "max-position-embeddings", po::value(&m.max_position_embeddings)->default_value(0),
        "positions of the model (0: seq-length)")(
        "vocab-size", po::value(&m.vocab_size)->default_value(0),
        "vocabulary size (0: from the data's shards; 512 for mock data)")(
        "make-vocab-size-divisible-by",
        po::value(&m.make_vocab_size_divisible_by)->default_value(128),
        "pad the vocabulary to a multiple of this times TP (padding is masked out of the loss)")(
        "init-method-std", po::value(&m.init_method_std)->default_value(0.02),
        "std of the normal init (residual projections use std/sqrt(2*layers))")(
        "layernorm-epsilon", po::value(&m.layernorm_epsilon)->default_value(1e-5),
        "LayerNorm epsilon")("attention-dropout", po::value(&m.attention_dropout)->default_value(0),
                             "dropout on the attention probabilities in training (GPT-2: 0.1)")(
        "hidden-dropout", po::value(&m.hidden_dropout)->default_value(0),
        "dropout on the embedding output and on each attention and MLP output before the residual "
        "add, in training (GPT-2: 0.1)")(
        "position-embedding-type",
        po::value(&m.position_embedding_type)->default_value(m.position_embedding_type),
        "learned_absolute (GPT-2) | rope (rotary, Llama) | alibi (linear distance penalty per "
        "head) "
        "| none (causal attention alone)")("rotary-base",
                                           po::value(&m.rotary_base)->default_value(m.rotary_base),
                                           "RoPE base (theta; Llama 3: 500000)")(
        "rotary-percent", po::value(&m.rotary_percent)->default_value(m.rotary_percent),
        "share of each head's features that RoPE rotates, 0 < p <= 1")(
        "use-rope-scaling", po::bool_switch(&m.use_rope_scaling),
        "Llama 3.1's RoPE frequency scaling (low/high frequency factors 1/4, original context "
        "8192)")("rope-scaling-factor",
                 po::value(&m.rope_scaling_factor)->default_value(m.rope_scaling_factor),
                 "with --use-rope-scaling: how much the long wavelengths are slowed (Llama 3.1: 8, "
                 "3.2: 32)")(
        "rope-scaling-low-freq-factor",
        po::value(&m.rope_scaling_low_freq_factor)->default_value(m.rope_scaling_low_freq_factor),
        "with --use-rope-scaling: wavelengths above original / this are slowed (Llama 3: 1)")(
        "rope-scaling-high-freq-factor",
        po::value(&m.rope_scaling_high_freq_factor)->default_value(m.rope_scaling_high_freq_factor),
        "with --use-rope-scaling: wavelengths below original / this are kept (Llama 3: 4)")(
        "rope-scaling-original-max-position-embeddings",
        po::value(&m.rope_scaling_original_max_positions)
            ->default_value(m.rope_scaling_original_max_positions),
        "with --use-rope-scaling: the context the frequencies were trained for (Llama 3: 8192)")(
        "normalization", po::value(&m.normalization)->default_value(m.normalization),
        "LayerNorm (GPT-2) | RMSNorm (Llama)")(
        "norm-epsilon", po::value(&norm_epsilon_),
        "epsilon of the norms (Megatron's name for --layernorm-epsilon)")(
        "swiglu", po::bool_switch(&m.swiglu),
        "SwiGLU MLP (gate and up projections, silu(gate) * up) instead of GELU; Llama uses "
        "--ffn-hidden-size 8/3 h rounded")(
        "group-query-attention", po::bool_switch(&m.group_query_attention),
        "grouped-query attention: --num-query-groups key/value heads shared by the query heads")(
        "num-query-groups", po::value(&m.num_query_groups)->default_value(m.num_query_groups),
        "key/value heads with --group-query-attention (1: multi-query attention); must divide "
        "the heads and be divisible by TP")(
        "untie-embeddings-and-output-weights",
        po::bool_switch(&m.untie_embeddings_and_output_weights),
        "an output layer (lm_head) of its own instead of the word embedding's transpose")(
        "disable-bias-linear", po::bool_switch(&disable_bias_linear_),
        "no biases in the QKV, projection and MLP layers (Llama)")(
        "add-qkv-bias", po::bool_switch(&m.add_qkv_bias),
        "biases on the QKV projection even with --disable-bias-linear (Qwen2)")(
        "kv-channels", po::value(&m.kv_channels)->default_value(0),
        "features per attention head (0: hidden-size / num-attention-heads)")(
        "apply-layernorm-1p", po::bool_switch(&m.apply_layernorm_1p),
        "norm weights stored as w and applied as (1 + w), initialized to 0")(
        "rotary-interleaved", po::bool_switch(&m.rotary_interleaved),
        "RoPE rotates adjacent feature pairs (2i, 2i+1) instead of the two halves")(
        "squared-relu", po::bool_switch(&m.squared_relu),
        "MLP activation relu(x)^2 instead of GELU")(
        "qk-layernorm", po::bool_switch(&m.qk_layernorm),
        "normalize each query and key head (--normalization's norm over its --kv-channels "
        "features, weights shared by the heads) before RoPE (Qwen3); with "
        "--multi-latent-attention, the query and key/value latents");
    p.group("Multi-latent attention (DeepSeek)")
        .add_options()("multi-latent-attention", po::bool_switch(&m.multi_latent_attention),
                       "DeepSeek-V2/V3's attention: queries and keys/values from compressed "
                       "latents, a RoPE part of the keys shared by the heads")(
            "q-lora-rank", po::value(&m.q_lora_rank)->default_value(0),
            "the query latent's width (0: queries straight from the hidden state)")(
            "kv-lora-rank", po::value(&m.kv_lora_rank)->default_value(0),
            "the key/value latent's width (required with MLA)")(
            "qk-head-dim", po::value(&m.qk_head_dim)->default_value(m.qk_head_dim),
            "query/key features per head without position")(
            "qk-pos-emb-head-dim",
            po::value(&m.qk_pos_emb_head_dim)->default_value(m.qk_pos_emb_head_dim),
            "query/key features per head with RoPE (even; the keys' shared by the heads)")(
            "v-head-dim", po::value(&m.v_head_dim)->default_value(m.v_head_dim),
            "value features per head")(
            "rope-type", po::value(&m.rope_type)->default_value(m.rope_type),
            "rope | yarn (YaRN's frequencies and softmax scale; with --multi-latent-attention)")(
            "rotary-scaling-factor",
            po::value(&m.rotary_scaling_factor)->default_value(m.rotary_scaling_factor),
            "YaRN: the context's growth over the original (DeepSeek-V3: 40)")(
            "mscale", po::value(&m.mscale)->default_value(m.mscale),
            "YaRN: m in 0.1 m ln(factor) + 1 for RoPE's cos and sin (must equal "
            "--mscale-all-dim)")("mscale-all-dim",
                                 po::value(&m.mscale_all_dim)->default_value(m.mscale_all_dim),
                                 "YaRN: m in the softmax scale's (0.1 m ln(factor) + 1)^2")(
            "beta-fast", po::value(&m.beta_fast)->default_value(m.beta_fast),
            "YaRN: frequencies that turn more than this often in the original context are kept")(
            "beta-slow", po::value(&m.beta_slow)->default_value(m.beta_slow),
            "YaRN: those that turn fewer times than this are divided by the factor")(
            "original-max-position-embeddings",
            po::value(&m.original_max_position_embeddings)
                ->default_value(m.original_max_position_embeddings),
            "YaRN: the context the model was first trained for (DeepSeek-V3: 4096)")(
            "mtp-num-layers", po::value(&m.mtp_num_layers)->default_value(0),
            "multi-token prediction's depths (DeepSeek-V3: 1): each predicts one token further "
            "through a transformer layer of its own on the last pipeline stage")(
            "mtp-loss-scaling-factor",
            po::value(&m.mtp_loss_scaling_factor)->default_value(m.mtp_loss_scaling_factor),
            "the weight of multi-token prediction's loss (divided over the depths)");
    p.alternatives({"layernorm-epsilon", "norm-epsilon"});
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes&) override {
    GPTConfig& m = o.model;
    if (p.given("num-query-groups") && !m.group_query_attention)
      throw ConfigError(detail::concat("--num-query-groups=", m.num_query_groups,
                                       " needs --group-query-attention (without it every head has "
                                       "keys and values of its own)"));
    m.add_bias_linear = !disable_bias_linear_;
    if (p.given("norm-epsilon")) {
      if (p.given("layernorm-epsilon") && norm_epsilon_ != m.layernorm_epsilon)
        throw ConfigError(detail::concat("--norm-epsilon=", norm_epsilon_,
                                         " and --layernorm-epsilon=", m.layernorm_epsilon,
                                         " disagree; give one"));
      m.layernorm_epsilon = norm_epsilon_;
    }
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    const GPTConfig& m = d.o.model;
    if (s == DryRunSection::Totals) {
      char buf[400];
      std::snprintf(buf, sizeof buf,
                    "parameters: %lld (model%s); padded vocabulary %lld (true "
                    "%lld, multiple of %d x TP)\n",
                    (long long)m.num_parameters(), m.tied_head() ? ", tied head counted once" : "",
                    (long long)m.padded_vocab_size(d.o.tp), (long long)m.vocab_size,
                    m.make_vocab_size_divisible_by);
      out << buf;
      if (m.mtp()) {  // Hugging Face's model class counts the rest (it does not load MTP layers)
        GPTConfig main = m;
        main.mtp_num_layers = 0;
        std::snprintf(buf, sizeof buf,
                      "multi-token prediction: %lld of them in %d layer%s (the embedding and "
                      "output layer shared); the model without them %lld\n",
                      (long long)(m.num_parameters() - main.num_parameters()), m.mtp_num_layers,
                      m.mtp_num_layers == 1 ? "" : "s", (long long)main.num_parameters());
        out << buf;
      }
    } else if (s == DryRunSection::Setup) {
      out << "architecture: " << m.describe() << "\n";
    }
  }

 private:
  double norm_epsilon_ = 0;
  bool disable_bias_linear_ = false;
};

}  // namespace

std::unique_ptr<OptionGroup> make_model_options() {
  return std::make_unique<ModelOptions>();
}

}  // namespace tessera
