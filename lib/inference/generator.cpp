// generator.cpp: the prefill/decode loop, token sampling and beam search across the pipeline.
#include "inference/generator.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/timer.hpp"

namespace tessera {

namespace {
// Rank (tp 0, last stage, dp 0) samples; everyone learns the tokens from it.
int sampler_world_rank(const ParallelContext& c) {
  return c.tp_size * (c.dp_size * (c.pp_size - 1));
}

// log p of prompt[j] (j >= 1) from the logits after every prompt token (rows row0...).
std::vector<float> prompt_log_probs(const std::vector<float>& logits, int64_t row0, int64_t V,
                                    const std::vector<int32_t>& prompt) {
  std::vector<float> lp;
  for (size_t j = 1; j < prompt.size(); ++j)
    lp.push_back(static_cast<float>(
        token_log_prob(logits.data() + (row0 + static_cast<int64_t>(j) - 1) * V, V, prompt[j])));
  return lp;
}

// Appends a list of floats to a serialized message, and reads it back.
void put_list(std::vector<double>& msg, const std::vector<float>& v) {
  msg.push_back(static_cast<double>(v.size()));
  msg.insert(msg.end(), v.begin(), v.end());
}
std::vector<float> get_list(const std::vector<double>& msg, size_t& at) {
  const size_t n = static_cast<size_t>(msg.at(at++));
  std::vector<float> v(msg.begin() + at, msg.begin() + at + n);
  at += n;
  return v;
}
}  // namespace

void check_prompts(const std::vector<std::vector<int32_t>>& prompts, int64_t vocab_size,
                   int64_t max_positions) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) throw ConfigError(detail::concat("prompt ", i + 1, " is empty"));
    for (size_t j = 0; j < prompts[i].size(); ++j)
      if (prompts[i][j] < 0 || prompts[i][j] >= vocab_size)
        throw ConfigError(detail::concat("prompt ", i + 1, ": token id ", prompts[i][j],
                                         " (position ", j + 1, ") is outside the vocabulary of ",
                                         vocab_size, " tokens (ids 0 to ", vocab_size - 1, ")"));
    if (static_cast<int64_t>(prompts[i].size()) >= max_positions)
      throw ConfigError(detail::concat("prompt ", i + 1, " has ", prompts[i].size(),
                                       " tokens; the context holds ", max_positions,
                                       " positions (the prompt plus at least one new token)"));
  }
}

GenerationResult generate(InferenceEngine& engine, const ParallelContext& ctx,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const GenerationOptions& o,
                          const std::function<void(int, int32_t)>& on_token) {
  return generate(engine, ctx, prompts, std::vector<GenerationOptions>(prompts.size(), o),
                  on_token);
}

GenerationResult generate(InferenceEngine& engine, const ParallelContext& ctx,
                          const std::vector<std::vector<int32_t>>& prompts,
                          const std::vector<GenerationOptions>& opts,
                          const std::function<void(int, int32_t)>& on_token) {
  const int B = static_cast<int>(prompts.size());
  TESSERA_CHECK(opts.size() == prompts.size(), "one set of generation options per prompt");
  TESSERA_CHECK(B <= engine.max_sequences(), B, " prompts for a cache of ", engine.max_sequences());
  check_prompts(prompts, engine.vocab_size(), engine.max_positions());
  GenerationResult res;
  res.completions.resize(B);
  bool any_log_probs = false, any_prompt_lp = false;
  int64_t steps = 0;
  std::vector<CounterRng> rngs;
  for (int i = 0; i < B; ++i) {
    opts[i].sampling.validate();
    TESSERA_CHECK(opts[i].beam_size == 1, "beam search goes through beam_search()");
    TESSERA_CHECK(opts[i].max_new_tokens >= 0, "a negative token budget");
    any_log_probs = any_log_probs || opts[i].log_probs;
    any_prompt_lp = any_prompt_lp || opts[i].prompt_log_probs;
    steps = std::max(steps, opts[i].max_new_tokens);
    rngs.emplace_back(opts[i].sampling.seed, stable_hash("generate.sample"));
    res.prompt_tokens += static_cast<int64_t>(prompts[i].size());
  }
  const bool use_cache = B == 0 || opts[0].use_kv_cache;
  const bool sampler = ctx.world_rank == sampler_world_rank(ctx);
  std::vector<std::vector<int32_t>> seqs = prompts;
  std::vector<bool> done(B, false);
  for (int i = 0; i < B; ++i) done[i] = opts[i].max_new_tokens == 0;
  std::vector<std::vector<float>> comp_lp(B), prompt_lp(B);
  std::vector<float> logits, last;
  Tensor chosen({std::max(B, 1)});
  // Step 0 runs every prompt (the prefill; prompt log-probabilities need it even with no token to
  // generate); a later step runs every unfinished sequence.
  for (int64_t step = 0; step < std::max<int64_t>(steps, any_prompt_lp ? 1 : 0); ++step) {
    Timer t;
    std::vector<TokenSegment> segs;
    std::vector<int32_t> toks;
    std::vector<int> who;
    for (int i = 0; i < B; ++i) {
      if (done[i] && step > 0) continue;
      const int64_t len = static_cast<int64_t>(seqs[i].size());
      // First step (or no cache): the whole sequence from position 0; then only the newest token.
      const int64_t from = (step == 0 || !use_cache) ? 0 : len - 1;
      segs.push_back({i, from, len - from});
      toks.insert(toks.end(), seqs[i].begin() + from, seqs[i].end());
      who.push_back(i);
    }
    if (segs.empty()) break;
    const bool all_rows = step == 0 && any_prompt_lp;
    // The draw and the rule of each row: the same on every rank (a counter RNG).
    std::vector<TokenSampling> how(segs.size());
    bool row_log_probs = false;
    for (size_t k = 0; k < who.size(); ++k) {
      const int i = who[k];
      if (done[i]) continue;  // a prompt with no token to generate: greedy, and ignored
      const int64_t stream = opts[i].sample_stream >= 0 ? opts[i].sample_stream : i;
      const double u =
          rngs[i].uniform(static_cast<uint64_t>(stream) << 32 | static_cast<uint64_t>(step));
      SamplingOptions so = opts[i].sampling;
      so.top_p = so.top_p_at(step);
      how[k] = so.token_sampling(u);
      row_log_probs = row_log_probs || opts[i].log_probs;
    }
    if (!all_rows && !row_log_probs) {
      // The logits stay where they are (on the GPU, only the ids come back).
      const std::vector<int32_t> ids = engine.forward_sample(segs, toks, how);
      if (sampler)
        for (size_t k = 0; k < who.size(); ++k) chosen.f32()[k] = static_cast<float>(ids[k]);
    } else {
      engine.forward(segs, toks, logits, all_rows);
    }
    if (sampler && (all_rows || row_log_probs)) {
      const int64_t V = engine.vocab_size();
      const float* rows = logits.data();
      if (all_rows) {  // the prompts' log-probabilities, then each segment's last row
        last.resize(segs.size() * static_cast<size_t>(V));
        int64_t row = 0;
        for (size_t k = 0; k < segs.size(); ++k) {
          const int i = who[k];
          if (opts[i].prompt_log_probs) prompt_lp[i] = prompt_log_probs(logits, row, V, prompts[i]);
          row += segs[k].count;
          std::copy_n(logits.data() + (row - 1) * V, V, last.data() + k * V);
        }
        rows = last.data();
      }
      for (size_t k = 0; k < who.size(); ++k) {
        const int i = who[k];
        if (done[i]) continue;
        const int32_t tok = cpu::sample_token(rows + k * V, V, how[k]);
        chosen.f32()[k] = static_cast<float>(tok);
        if (opts[i].log_probs)
          comp_lp[i].push_back(static_cast<float>(token_log_prob(rows + k * V, V, tok)));
      }
    }
    ctx.world->broadcast(chosen, sampler_world_rank(ctx));
    for (size_t k = 0; k < who.size(); ++k) {
      const int i = who[k];
      if (done[i]) continue;
      const int32_t tok = static_cast<int32_t>(chosen.f32()[k]);
      seqs[i].push_back(tok);
      res.completions[i].push_back(tok);
      ++res.generated_tokens;
      if (on_token) on_token(i, tok);
      if (tok == opts[i].eod_id || static_cast<int64_t>(seqs[i].size()) >= engine.max_positions() ||
          static_cast<int64_t>(res.completions[i].size()) >= opts[i].max_new_tokens)
        done[i] = true;
    }
    (step == 0 ? res.prefill_seconds : res.decode_seconds) += t.seconds();
  }
  if (any_log_probs || any_prompt_lp) {  // the sampler's lists, on every rank
    std::vector<double> msg;
    if (sampler)
      for (int i = 0; i < B; ++i) {
        put_list(msg, comp_lp[i]);
        put_list(msg, prompt_lp[i]);
      }
    broadcast_f64(*ctx.world, msg, sampler_world_rank(ctx));
    size_t at = 0;
    for (int i = 0; i < B; ++i) {
      res.completion_log_probs.push_back(get_list(msg, at));
      res.prompt_log_probs.push_back(get_list(msg, at));
    }
  }
  return res;
}

namespace {
// Megatron-LM's / Hugging Face's BeamHypotheses (early_stopping off): the best `n` finished
// hypotheses by sum_logprobs / length^length_penalty.
struct Hypotheses {
  struct Hyp {
    double score;
    std::vector<int32_t> tokens;
    std::vector<float> log_probs;
  };
  int n;
  double length_penalty;
  std::vector<Hyp> beams;
  double worst = 1e9;
  void add(std::vector<int32_t> tokens, std::vector<float> lp, double sum_logprobs,
           int64_t length) {
    const double score = sum_logprobs / std::pow(static_cast<double>(length), length_penalty);
    if (static_cast<int>(beams.size()) < n || score > worst) {
      beams.push_back({score, std::move(tokens), std::move(lp)});
      if (static_cast<int>(beams.size()) > n) {
        auto lowest = std::min_element(beams.begin(), beams.end(), [](const Hyp& a, const Hyp& b) {
          return a.score < b.score;
        });
        beams.erase(lowest);
        worst = std::min_element(beams.begin(), beams.end(), [](const Hyp& a, const Hyp& b) {
                  return a.score < b.score;
                })->score;
      } else {
        worst = std::min(score, worst);
      }
    }
  }
  bool is_done(double best_sum_logprobs, int64_t cur_len) const {
    if (static_cast<int>(beams.size()) < n) return false;
    return worst >= best_sum_logprobs / std::pow(static_cast<double>(cur_len), length_penalty);
  }
};
}  // namespace

GenerationResult beam_search(InferenceEngine& engine, const ParallelContext& ctx,
                             const std::vector<int32_t>& prompt, const GenerationOptions& o) {
  const int64_t V = engine.vocab_size();
  const int Bm = o.beam_size;
  TESSERA_CHECK(Bm >= 1 && Bm <= engine.max_sequences(), "beam size ", Bm, " for a cache of ",
                engine.max_sequences(), " sequences");
  check_prompts({prompt}, V, engine.max_positions());
  TESSERA_CHECK(o.max_new_tokens >= 1, "beam search generates at least one token");
  GenerationResult res;
  res.prompt_tokens = static_cast<int64_t>(prompt.size());
  const bool sampler = ctx.world_rank == sampler_world_rank(ctx);
  const int64_t P = static_cast<int64_t>(prompt.size());
  const int64_t steps = std::min(o.max_new_tokens, engine.max_positions() - P);
  Hypotheses hyps{Bm, o.length_penalty, {}, 1e9};
  std::vector<std::vector<int32_t>> gen(1);  // each live beam's generated tokens
  std::vector<std::vector<float>> gen_lp(1);
  std::vector<double> scores(1, 0.0);
  std::vector<float> logits, prompt_lp;
  Tensor msg({2 + 2 * static_cast<int64_t>(Bm)});  // done, live beams, (token, parent) each
  bool done = false;
  int64_t step = 0;
  for (; step < steps; ++step) {
    Timer t;
    std::vector<TokenSegment> segs;
    std::vector<int32_t> toks;
    if (step == 0) {
      segs.push_back({0, 0, P});
      toks = prompt;
    } else {
      for (size_t b = 0; b < gen.size(); ++b) {
        segs.push_back({static_cast<int>(b), P + step - 1, 1});
        toks.push_back(gen[b].back());
      }
    }
    const bool all_rows = step == 0 && o.prompt_log_probs;
    engine.forward(segs, toks, logits, all_rows);
    if (sampler) {
      const float* rows = logits.data();
      if (all_rows) {
        prompt_lp = prompt_log_probs(logits, 0, V, prompt);
        rows = logits.data() + (P - 1) * V;
      }
      // Every (beam, token) candidate's summed log-probability; the best 2·beam_size, ties by
      // (beam, token).
      const int64_t live = static_cast<int64_t>(gen.size());
      std::vector<double> total(static_cast<size_t>(live * V));
      std::vector<double> lps(static_cast<size_t>(live * V));
      for (int64_t b = 0; b < live; ++b) {
        const float* r = rows + b * V;
        const double m = *std::max_element(r, r + V);
        double z = 0;
        for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(r[v]) - m);
        const double lz = m + std::log(z);
        for (int64_t v = 0; v < V; ++v) {
          lps[b * V + v] = static_cast<double>(r[v]) - lz;
          total[b * V + v] = scores[b] + lps[b * V + v];
        }
      }
      const int64_t K = std::min<int64_t>(2 * Bm, live * V);
      std::vector<int64_t> idx(static_cast<size_t>(live * V));
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + K, idx.end(), [&](int64_t a, int64_t b) {
        return total[a] > total[b] || (total[a] == total[b] && a < b);
      });
      std::vector<std::vector<int32_t>> next_gen;
      std::vector<std::vector<float>> next_lp;
      std::vector<double> next_scores;
      float* m = msg.f32();
      std::fill(m, m + msg.numel(), 0.f);
      for (int64_t r = 0; r < K && static_cast<int>(next_gen.size()) < Bm; ++r) {
        const int64_t beam = idx[r] / V;
        const int32_t tok = static_cast<int32_t>(idx[r] % V);
        std::vector<int32_t> g = gen[beam];
        std::vector<float> l = gen_lp[beam];
        g.push_back(tok);
        l.push_back(static_cast<float>(lps[idx[r]]));
        if (tok == o.eod_id) {
          if (r >= Bm) continue;  // an end worse than the beam_size best candidates
          hyps.add(std::move(g), std::move(l), total[idx[r]], step + 1);
        } else {
          const size_t k = next_gen.size();
          m[2 + 2 * k] = static_cast<float>(tok);
          m[3 + 2 * k] = static_cast<float>(beam);
          next_gen.push_back(std::move(g));
          next_lp.push_back(std::move(l));
          next_scores.push_back(total[idx[r]]);
        }
      }
      m[1] = static_cast<float>(next_gen.size());
      done = next_gen.empty() || hyps.is_done(total[idx[0]], step + 1);
      m[0] = done ? 1.f : 0.f;
      if (!done) {
        gen = std::move(next_gen);
        gen_lp = std::move(next_lp);
        scores = std::move(next_scores);
      }
    }
    ctx.world->broadcast(msg, sampler_world_rank(ctx));
    (step == 0 ? res.prefill_seconds : res.decode_seconds) += t.seconds();
    if (msg.f32()[0] != 0.f) {
      done = true;
      break;
    }
    const int live = static_cast<int>(msg.f32()[1]);
    std::vector<int> parents(static_cast<size_t>(live));
    for (int k = 0; k < live; ++k) parents[k] = static_cast<int>(msg.f32()[3 + 2 * k]);
    if (!sampler) {  // the tokens only (the sampler keeps the scores)
      std::vector<std::vector<int32_t>> next(static_cast<size_t>(live));
      for (int k = 0; k < live; ++k) {
        next[k] = gen[parents[k]];
        next[k].push_back(static_cast<int32_t>(msg.f32()[2 + 2 * k]));
      }
      gen = std::move(next);
    }
    engine.reorder_slots(parents);
  }
  // The sampler's hypotheses (with the live beams when no stop came), best first, on every rank.
  std::vector<double> out;
  if (sampler) {
    if (!done)
      for (size_t b = 0; b < gen.size(); ++b)
        hyps.add(gen[b], gen_lp[b], scores[b], static_cast<int64_t>(gen[b].size()));
    std::stable_sort(
        hyps.beams.begin(), hyps.beams.end(),
        [](const Hypotheses::Hyp& a, const Hypotheses::Hyp& b) { return a.score > b.score; });
    out.push_back(static_cast<double>(hyps.beams.size()));
    for (const auto& h : hyps.beams) {
      out.push_back(h.score);
      put_list(out, std::vector<float>(h.tokens.begin(), h.tokens.end()));
      put_list(out, h.log_probs);
    }
    put_list(out, prompt_lp);
  }
  broadcast_f64(*ctx.world, out, sampler_world_rank(ctx));
  size_t at = 0;
  const int n = static_cast<int>(out.at(at++));
  for (int k = 0; k < n; ++k) {
    res.beam_scores.push_back(out.at(at++));
    const std::vector<float> toks = get_list(out, at);
    res.completions.emplace_back(toks.begin(), toks.end());
    res.completion_log_probs.push_back(get_list(out, at));
    res.generated_tokens += static_cast<int64_t>(toks.size());
  }
  const std::vector<float> plp = get_list(out, at);
  if (o.prompt_log_probs) res.prompt_log_probs.assign(static_cast<size_t>(n), plp);
  if (!o.log_probs) res.completion_log_probs.clear();
  return res;
}

}  // namespace tessera
