// reference_gpt.hpp: an independent, naive double-precision GPT-2 forward (plain loops, the full
// T x T attention matrix, HF GPT2LMHeadModel semantics) for checking the real model against.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "model/gpt_config.hpp"

namespace tessera::testing {

// Parameters by name in their global layout (TP = 1): wte is [V_padded, C] (only rows < vocab_size
// are read), qkv.weight [3, H, hd, C], proj.weight [C, H*hd], fc1.weight [F, C], fc2.weight [C, F]
// (hd = kv_channels, else C / H).
using RefParams = std::map<std::string, std::vector<double>>;

// Documents inside the samples, (B,T) each; an empty table is off. positions: each token's
// position id (the position embedding's row, RoPE's angle, ALiBi's distance); key_begin: the
// first key each token attends to.
struct RefDocuments {
  std::vector<int> positions, key_begin;
};

// Mean cross-entropy over all positions with target >= 0, plus with MoE layers their
// load-balancing and z losses over the B*T tokens as one micro-batch. ids, targets are (B,T).
double reference_loss(const GPTConfig& cfg, const RefParams& p, const std::vector<int>& ids,
                      const std::vector<int>& targets, int B, int T,
                      const RefDocuments* docs = nullptr);

}  // namespace tessera::testing
