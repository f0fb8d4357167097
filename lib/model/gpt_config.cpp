// gpt_config.cpp: validation and derived sizes of the GPT configuration.
#include "model/gpt_config.hpp"

#include "core/error.hpp"

namespace tessera {

int64_t GPTConfig::padded_vocab_size(int tp_size) const {
  const int64_t multiple = static_cast<int64_t>(make_vocab_size_divisible_by) * tp_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

void GPTConfig::validate() const {
  auto positive = [](const char* opt, int64_t v) {
    if (v <= 0)
      throw ConfigError(detail::concat("--", opt, "=", v, " is out of range (allowed: >= 1)"));
  };
  positive("num-layers", num_layers);
  positive("hidden-size", hidden_size);
  positive("num-attention-heads", num_attention_heads);
  positive("seq-length", seq_length);
  positive("make-vocab-size-divisible-by", make_vocab_size_divisible_by);
  if (vocab_size < 2)
    throw ConfigError(
        detail::concat("--vocab-size=", vocab_size, " is out of range (allowed: >= 2)"));
  if (vocab_size > (int64_t(1) << 31) - 1)
    throw ConfigError(
        detail::concat("--vocab-size=", vocab_size, " is too large (allowed: < 2^31)"));
  if (kv_channels < 0)
    throw ConfigError(detail::concat("--kv-channels=", kv_channels,
                                     " is out of range (allowed: 0 for hidden/heads, or >= 1)"));
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    throw ConfigError(detail::concat(
        "--num-attention-heads=", num_attention_heads, " must divide --hidden-size=", hidden_size,
        " (allowed: a divisor of ", hidden_size, "; or give --kv-channels)"));
  if (ffn_hidden_size < 0)
    throw ConfigError(detail::concat("--ffn-hidden-size=", ffn_hidden_size,
                                     " is out of range (allowed: 0 for 4*hidden, or >= 1)"));
  if (max_position_embeddings < 0)
    throw ConfigError(detail::concat("--max-position-embeddings=", max_position_embeddings,
                                     " is out of range (allowed: 0 for --seq-length, or >= 1)"));
  if (seq_length > max_positions())
    throw ConfigError(detail::concat("--seq-length=", seq_length,
                                     " exceeds --max-position-embeddings=", max_positions(),
                                     " (allowed: seq-length <= max-position-embeddings)"));
  if (!(init_method_std > 0))
    throw ConfigError(detail::concat("--init-method-std=", init_method_std, " must be > 0"));
  if (!(layernorm_epsilon > 0))
    throw ConfigError(detail::concat("--layernorm-epsilon=", layernorm_epsilon, " must be > 0"));
  if (position_embedding_type != "learned_absolute" && position_embedding_type != "rope" &&
      position_embedding_type != "alibi" && position_embedding_type != "none")
    throw ConfigError("--position-embedding-type=" + position_embedding_type +
                      " is not known (allowed: learned_absolute, rope, alibi, none)");
  if (normalization != "LayerNorm" && normalization != "RMSNorm")
    throw ConfigError("--normalization=" + normalization +
                      " is not known (allowed: LayerNorm, RMSNorm)");
  if (!(rotary_percent > 0 && rotary_percent <= 1))
    throw ConfigError(detail::concat("--rotary-percent=", rotary_percent,
                                     " is out of range (allowed: 0 < p <= 1)"));
  if (!(rotary_base > 0))
    throw ConfigError(detail::concat("--rotary-base=", rotary_base, " must be > 0"));
  if (rope() && rotary_dim() < 2)
    throw ConfigError(detail::concat("--rotary-percent=", rotary_percent, " of head dimension ",
                                     head_dim(), " rotates no feature pair (allowed: at least 2 ",
                                     "features, i.e. p >= ", 2.0 / head_dim(), ")"));
  if (rotary_interleaved && !rope())
    throw ConfigError("--rotary-interleaved needs --position-embedding-type rope");
  if (squared_relu && swiglu)
    throw ConfigError(
        "--squared-relu and --swiglu both given: they are two MLP activations; "
        "choose one");
  if (use_rope_scaling && !rope())
    throw ConfigError("--use-rope-scaling needs --position-embedding-type rope");
  if (use_rope_scaling && !(rope_scaling_factor > 1 && rope_scaling_low_freq_factor > 0 &&
                            rope_scaling_high_freq_factor > rope_scaling_low_freq_factor &&
                            rope_scaling_original_max_positions > 0))
    throw ConfigError(detail::concat(
        "--rope-scaling-factor=", rope_scaling_factor, " (low/high frequency factors ",
        rope_scaling_low_freq_factor, "/", rope_scaling_high_freq_factor, ", original positions ",
        rope_scaling_original_max_positions,
        ") is out of range (allowed: factor > 1, 0 < low < high, positions > 0)"));
  if (group_query_attention) {
    if (num_query_groups < 1)
      throw ConfigError(detail::concat("--num-query-groups=", num_query_groups,
                                       " is out of range (allowed: >= 1)"));
    if (num_query_groups == num_attention_heads)
      throw ConfigError(detail::concat(
          "--num-query-groups=", num_query_groups, " equals --num-attention-heads: that is ",
          "multi-head attention; drop --group-query-attention (or use fewer groups)"));
    if (num_attention_heads % num_query_groups != 0)
      throw ConfigError(detail::concat(
          "--num-query-groups=", num_query_groups, " does not divide --num-attention-heads=",
          num_attention_heads, " (allowed: a divisor of ", num_attention_heads, ")"));
  }
  if (!(attention_dropout >= 0 && attention_dropout < 1))
    throw ConfigError(detail::concat("--attention-dropout=", attention_dropout,
                                     " is out of range (allowed: 0 <= p < 1)"));
  if (!(hidden_dropout >= 0 && hidden_dropout < 1))
    throw ConfigError(detail::concat("--hidden-dropout=", hidden_dropout,
                                     " is out of range (allowed: 0 <= p < 1)"));
}

int GPTConfig::rotary_dim() const {
  // Megatron: int(head_dim * percent), rounded down to an even count.
  const int d = static_cast<int>(head_dim() * rotary_percent + 1e-9);
  return d - d % 2;
}

std::string GPTConfig::describe() const {
  std::string out =
      rope() ? detail::concat(
                   "RoPE (base ", rotary_base, ", ", rotary_dim(), " of ", head_dim(), " features",
                   use_rope_scaling ? detail::concat(", Llama 3 scaling x", rope_scaling_factor)
                                    : std::string(),
                   ")")
             : std::string(learned_positions() ? "learned absolute positions"
                           : alibi()           ? "ALiBi"
                                               : "no position embedding");
  out += rmsnorm() ? ", RMSNorm" : ", LayerNorm";
  if (apply_layernorm_1p) out += " (1 + w)";
  out += swiglu ? ", SwiGLU" : squared_relu ? ", squared ReLU" : ", GELU";
  if (rope() && rotary_interleaved) out += ", interleaved rotary pairs";
  if (kv_channels > 0) out += detail::concat(", ", kv_channels, " channels per head");
  if (!group_query_attention)
    out += ", multi-head attention";
  else if (num_query_groups == 1)
    out +=
        detail::concat(", multi-query attention (1 key/value head for ", num_attention_heads, ")");
  else
    out += detail::concat(", grouped-query attention (", num_query_groups, " key/value heads for ",
                          num_attention_heads, ")");
  out += tied_head() ? ", output layer tied to the embedding" : ", untied output layer";
  if (!add_bias_linear) out += add_qkv_bias ? ", QKV biases only" : ", no linear biases";
  return out;
}

int64_t GPTConfig::num_parameters() const {
  const int64_t h = hidden_size, f = ffn(), L = num_layers, hd = head_dim();
  const int64_t qkv = (num_attention_heads + 2 * int64_t(kv_heads())) * hd;
  const int64_t fc1 = swiglu ? 2 * f : f;
  const int64_t norm = rmsnorm() ? h : 2 * h;
  const int64_t bias = add_bias_linear ? 1 : 0, qkv_b = qkv_bias() ? 1 : 0;
  const int64_t per_layer = 2 * norm + (qkv * h + qkv_b * qkv) +
                            (h * num_attention_heads * hd + bias * h) + (fc1 * h + bias * fc1) +
                            (h * f + bias * h);
  int64_t n = vocab_size * h + L * per_layer + norm;
  if (learned_positions()) n += static_cast<int64_t>(max_positions()) * h;
  if (!tied_head()) n += vocab_size * h;
  return n;
}

double GPTConfig::train_flops_per_token() const {
  const double h = hidden_size, L = num_layers, s = seq_length, V = static_cast<double>(vocab_size);
  const double f = ffn(), hd = head_dim(), H = num_attention_heads, G = kv_heads();
  // matmul parameters per layer: qkv (H+2G)*hd*h (3h^2 for GPT-2), proj h^2, mlp 2*h*f (= 8h^2
  // for f = 4h; 3*h*f with SwiGLU's gate)
  const double mlp = (swiglu ? 3 : 2) * h * f;
  const double matmul_params = L * ((H + 2 * G) * hd * h + H * hd * h + mlp) + V * h;
  // attention scores and their weighted sum: 12*L*s*(H*hd) (= 12*L*s*h unless --kv-channels)
  return 6.0 * matmul_params + 12.0 * L * s * H * hd;
}

void set_seq_length(GPTConfig& cfg, int seq, const std::string& source) {
  if (seq == 0) return;
  if (seq < 0 || seq > cfg.max_positions())
    throw ConfigError(detail::concat("--seq-length=", seq, " is out of range: the model of '",
                                     source, "' has ", cfg.max_positions(),
                                     " positions (allowed: 1 to ", cfg.max_positions(), ")"));
  cfg.max_position_embeddings = cfg.max_positions();
  cfg.seq_length = seq;
}

}  // namespace tessera
