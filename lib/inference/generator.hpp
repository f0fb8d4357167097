// generator.hpp: text generation over InferenceEngine: prefill every prompt in one pass, then one
// token per step for all unfinished sequences, until <|endoftext|> or the token budget. The
// sampling draw of sequence i at step t is u(seed, i, t) from the counter RNG, so a seed gives the
// same text in every layout.
#pragma once

#include <functional>
#include <vector>

#include "inference/engine.hpp"
#include "inference/sampling.hpp"

namespace tessera {

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  SamplingOptions sampling;
  bool use_kv_cache = true;  // false: recompute every sequence from position 0 at each step
  int32_t eod_id = -1;       // stop token (-1: none)
};

struct GenerationResult {
  std::vector<std::vector<int32_t>> completions;  // new tokens of each prompt
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

// Collective over all ranks of the engine's layout; every rank returns the same result.
// on_token(sequence, token) is called on every rank as tokens are chosen (for streaming).
GenerationResult generate(InferenceEngine& engine, const ParallelContext& ctx,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const GenerationOptions& opts,
                          const std::function<void(int, int32_t)>& on_token = nullptr);

}  // namespace tessera
