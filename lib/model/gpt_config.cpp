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
  if (hidden_size % num_attention_heads != 0)
    throw ConfigError(detail::concat("--num-attention-heads=", num_attention_heads,
                                     " must divide --hidden-size=", hidden_size,
                                     " (allowed: a divisor of ", hidden_size, ")"));
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
  if (!(attention_dropout >= 0 && attention_dropout < 1))
    throw ConfigError(detail::concat("--attention-dropout=", attention_dropout,
                                     " is out of range (allowed: 0 <= p < 1)"));
  if (!(hidden_dropout >= 0 && hidden_dropout < 1))
    throw ConfigError(detail::concat("--hidden-dropout=", hidden_dropout,
                                     " is out of range (allowed: 0 <= p < 1)"));
}

int64_t GPTConfig::num_parameters() const {
  const int64_t h = hidden_size, f = ffn(), L = num_layers;
  const int64_t per_layer =
      2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (f * h + f) + (h * f + h);
  return vocab_size * h + static_cast<int64_t>(max_positions()) * h + L * per_layer + 2 * h;
}

double GPTConfig::train_flops_per_token() const {
  const double h = hidden_size, L = num_layers, s = seq_length, V = static_cast<double>(vocab_size);
  const double f = ffn();
  // matmul parameters per layer: qkv 3h^2, proj h^2, mlp 2*h*f (= 8h^2 for f = 4h)
  const double matmul_params = L * (4 * h * h + 2 * h * f) + V * h;
  return 6.0 * matmul_params + 12.0 * L * s * h;
}

}  // namespace tessera
