// tiny.hpp: the small models and the short schedule the trainer tests share.
#pragma once

#include "model/gpt_config.hpp"
#include "run/train_config.hpp"

namespace tessera::testing_util {

// A GPT small enough for a test: `layers` x `hidden`, `heads` heads, `seq` tokens, `vocab` tokens
// (padded to a multiple of 128 x TP).
inline GPTConfig small_gpt(int hidden, int heads, int seq, int64_t vocab, int layers = 2) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.seq_length = seq;
  c.vocab_size = vocab;
  c.make_vocab_size_divisible_by = 128;
  return c;
}

// 50 iterations of AdamW with warm-up and cosine decay, global batch 8 in micro-batches of 4: on
// the mock data the 2 x 32 model falls from ln(64) = 4.16 to below 2.6.
inline TrainConfig tiny_schedule(DType compute = DType::F32) {
  TrainConfig t;
  t.micro_batch_size = 4;
  t.global_batch_size = 8;
  t.train_iters = 50;
  t.lr = 1e-2;
  t.min_lr = 1e-3;
  t.lr_decay_style = "cosine";
  t.lr_warmup_iters = 5;
  t.weight_decay = 0.1;
  t.adam_beta2 = 0.95;
  t.log_interval = 1000;
  t.compute_dtype = compute;
  return t;
}

}  // namespace tessera::testing_util
