// generator.cpp: the prefill/decode loop and token sampling across the pipeline.
#include "inference/generator.hpp"

#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/timer.hpp"

namespace tessera {

namespace {
// Rank (tp 0, last stage, dp 0) samples; everyone learns the tokens from it.
int sampler_world_rank(const ParallelContext& c) {
  return c.tp_size * (c.dp_size * (c.pp_size - 1));
}
}  // namespace

GenerationResult generate(InferenceEngine& engine, const ParallelContext& ctx,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const GenerationOptions& o,
                          const std::function<void(int, int32_t)>& on_token) {
  o.sampling.validate();
  const int B = static_cast<int>(prompts.size());
  GenerationResult res;
  res.completions.resize(B);
  for (int i = 0; i < B; ++i) {
    if (prompts[i].empty()) throw ConfigError(detail::concat("prompt ", i + 1, " is empty"));
    if (static_cast<int64_t>(prompts[i].size()) >= engine.max_positions())
      throw ConfigError(detail::concat("prompt ", i + 1, " has ", prompts[i].size(),
                                       " tokens; the context holds ", engine.max_positions(),
                                       " positions (the prompt plus at least one new token)"));
    res.prompt_tokens += static_cast<int64_t>(prompts[i].size());
  }
  const CounterRng rng(o.sampling.seed, stable_hash("generate.sample"));
  const bool sampler = ctx.world_rank == sampler_world_rank(ctx);
  std::vector<std::vector<int32_t>> seqs = prompts;
  std::vector<bool> done(B, false);
  std::vector<float> logits;
  Tensor chosen({B});
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    Timer t;
    std::vector<TokenSegment> segs;
    std::vector<int32_t> toks;
    std::vector<int> who;
    for (int i = 0; i < B; ++i) {
      if (done[i]) continue;
      const int64_t len = static_cast<int64_t>(seqs[i].size());
      // First step (or no cache): the whole sequence from position 0; then only the newest token.
      const int64_t from = (step == 0 || !o.use_kv_cache) ? 0 : len - 1;
      segs.push_back({i, from, len - from});
      toks.insert(toks.end(), seqs[i].begin() + from, seqs[i].end());
      who.push_back(i);
    }
    if (segs.empty()) break;
    engine.forward(segs, toks, logits);
    if (sampler) {
      const int64_t V = static_cast<int64_t>(logits.size() / segs.size());
      for (size_t k = 0; k < who.size(); ++k) {
        const double u =
            rng.uniform(static_cast<uint64_t>(who[k]) << 32 | static_cast<uint64_t>(step));
        chosen.f32()[k] = static_cast<float>(sample_token(logits.data() + k * V, V, o.sampling, u));
      }
    }
    ctx.world->broadcast(chosen, sampler_world_rank(ctx));
    for (size_t k = 0; k < who.size(); ++k) {
      const int i = who[k];
      const int32_t tok = static_cast<int32_t>(chosen.f32()[k]);
      seqs[i].push_back(tok);
      res.completions[i].push_back(tok);
      ++res.generated_tokens;
      if (on_token) on_token(i, tok);
      if (tok == o.eod_id || static_cast<int64_t>(seqs[i].size()) >= engine.max_positions())
        done[i] = true;
    }
    (step == 0 ? res.prefill_seconds : res.decode_seconds) += t.seconds();
  }
  return res;
}

}  // namespace tessera
