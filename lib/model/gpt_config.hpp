// gpt_config.hpp: GPT-2 hyper-parameters, vocabulary padding and validation.
#pragma once

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

  int ffn() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  int max_positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  int head_dim() const { return hidden_size / num_attention_heads; }
  // Megatron's padding: the smallest multiple of divisible_by * tp at or above vocab_size. Padded
  // entries are masked out of the loss, so the padding never changes what the model learns.
  int64_t padded_vocab_size(int tp_size) const;

  // Throws ConfigError naming the option, its value and what is allowed.
  void validate() const;

  // Parameters of the whole model at tensor-parallel size 1 (tied head counted once).
  int64_t num_parameters() const;
  // Training FLOPs per token with Megatron's formula (forward + backward, no recompute):
  // 72*L*h^2*(1 + s/(6h) + V/(12*h*L)) per token = 6*(12*L*h^2 + V*h) + 12*L*s*h.
  double train_flops_per_token() const;
};

}  // namespace tessera
