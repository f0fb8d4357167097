// generator.hpp: text generation over InferenceEngine: prefill every prompt in one pass, then one
// token per step for all unfinished sequences, until the end-of-document token or the token
// budget; or beam search over one prompt. The sampling draw of sequence i at step t is
// u(seed, i, t) from the counter RNG, so a seed gives the same text in every layout.
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
  // The index i of this prompt's draws u(seed, i, t); -1: its position in the batch. A server
  // batching several requests passes each prompt's index within its request, so a request's text
  // does not depend on what it was batched with.
  int64_t sample_stream = -1;
  // Log-probabilities (under the model, before temperature and truncation) of every generated
  // token, and of every prompt token after the first (the prefill then computes the logits of
  // every prompt row: tokens x vocabulary floats).
  bool log_probs = false;
  bool prompt_log_probs = false;
  // Beam search (beam_search()): beams kept per step, and the score of a finished beam,
  // sum of log-probabilities / (generated tokens)^length_penalty (Megatron-LM / Hugging Face).
  int beam_size = 1;
  double length_penalty = 1.0;
};

struct GenerationResult {
  std::vector<std::vector<int32_t>> completions;  // new tokens of each prompt (or each beam)
  // With log_probs: log p of each completion token; with prompt_log_probs, of each prompt token
  // after the first (one list per prompt; per beam, the completion's and the prompt's).
  std::vector<std::vector<float>> completion_log_probs, prompt_log_probs;
  std::vector<double> beam_scores;  // beam_search: each beam's score, best first
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

// Throws ConfigError naming the prompt, the token and the vocabulary when a prompt is empty, has
// an id outside [0, vocab_size), or leaves no room in a context of `max_positions`.
void check_prompts(const std::vector<std::vector<int32_t>>& prompts, int64_t vocab_size,
                   int64_t max_positions);

// Collective over all ranks of the engine's layout; every rank returns the same result.
// on_token(sequence, token) is called on every rank as tokens are chosen (for streaming).
GenerationResult generate(InferenceEngine& engine, const ParallelContext& ctx,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const GenerationOptions& opts,
                          const std::function<void(int, int32_t)>& on_token = nullptr);

// The same with options per prompt (max_new_tokens, sampling, stop token, sample_stream and
// log_probs may differ; use_kv_cache is the first prompt's). beam_size must be 1.
GenerationResult generate(InferenceEngine& engine, const ParallelContext& ctx,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const std::vector<GenerationOptions>& per_prompt,
                          const std::function<void(int, int32_t)>& on_token = nullptr);

// Beam search from one prompt (Megatron-LM's beam_search_and_return_on_first_stage): each step
// extends every live beam by every token, keeps the 2·beam_size best candidates by summed
// log-probability, moves those ending in eod_id (within the first beam_size) to the finished
// hypotheses, and continues the best beam_size others; it stops when no live beam can beat the
// worst of beam_size finished hypotheses, or after max_new_tokens (the live beams then finish).
// Returns up to beam_size completions, best score first. The engine needs beam_size slots.
// Collective; every rank returns the same result. Beam size 1 is greedy.
GenerationResult beam_search(InferenceEngine& engine, const ParallelContext& ctx,
                             const std::vector<int32_t>& prompt, const GenerationOptions& opts);

}  // namespace tessera
