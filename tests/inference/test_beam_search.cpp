// test_beam_search.cpp: beam search against an exhaustive search on a tiny model, beam 1 against
// greedy, log-probabilities against a full recomputation, prompt checks, per-request sampling
// streams and the server's request parsing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "backend/backend.hpp"
#include "inference/generator.hpp"
#include "inference/text_server.hpp"
#include "model/params.hpp"

using namespace tessera;

namespace {
// A 2-layer model over a 6-token vocabulary (token 5 ends a document) whose weights are scaled up
// so that its next-token distributions are far from uniform (beam search has choices to make).
struct TinyLm {
  static constexpr int64_t kVocab = 6;
  static constexpr int32_t kEod = 5;
  GPTConfig cfg;
  std::unique_ptr<Backend> be = make_cpu_backend();
  ParallelContext ctx = ParallelContext::single();
  std::unique_ptr<GPTModel> model;
  TinyLm() {
    cfg.num_layers = 2;
    cfg.hidden_size = 16;
    cfg.num_attention_heads = 2;
    cfg.seq_length = 16;
    cfg.vocab_size = kVocab;
    cfg.make_vocab_size_divisible_by = 1;
    model = std::make_unique<GPTModel>(cfg, model_shard_for(cfg, 1, 0, 1, 0), *be, *ctx.tp);
    model->init_parameters(11);
    for (const ParamSpec& s : model->params().specs()) {
      Tensor p = model->params().param(s);
      be->scale(p, 6.f);
    }
  }
  // log p(tokens[j] | tokens[<j]) summed over j >= from, by one forward pass over the whole
  // sequence (no cache reuse between sequences).
  double sum_log_prob(const std::vector<int32_t>& tokens, size_t from) {
    InferenceEngine e(*model, ctx, 1, static_cast<int64_t>(tokens.size()));
    std::vector<float> logits;
    e.forward({{0, 0, static_cast<int64_t>(tokens.size())}}, tokens, logits, true);
    double s = 0;
    for (size_t j = from; j < tokens.size(); ++j)
      s += token_log_prob(logits.data() + (j - 1) * kVocab, kVocab, tokens[j]);
    return s;
  }
};
}  // namespace

// With beam_size >= every live prefix (5^2 = 25 after two steps, 150 candidates at the third:
// 2 x 150 covers them) and length_penalty 0, beam search cannot prune the best sequence: its
// finished hypotheses are the best of all 156 sequences of at most 3 new tokens (ending at the
// end-of-document token or at the limit), best first, with the exhaustive search's scores.
TEST(BeamSearch, WideBeamEqualsExhaustiveSearch) {
  TinyLm lm;
  const std::vector<int32_t> prompt{1, 2};
  GenerationOptions o;
  o.max_new_tokens = 3;
  o.eod_id = TinyLm::kEod;
  o.beam_size = 150;
  o.length_penalty = 0;
  InferenceEngine engine(*lm.model, lm.ctx, o.beam_size, 8);
  const GenerationResult r = beam_search(engine, lm.ctx, prompt, o);

  std::vector<std::pair<double, std::vector<int32_t>>> all;
  std::function<void(std::vector<int32_t>)> walk = [&](std::vector<int32_t> gen) {
    if (!gen.empty() && (gen.back() == TinyLm::kEod || gen.size() == 3)) {
      std::vector<int32_t> seq = prompt;
      seq.insert(seq.end(), gen.begin(), gen.end());
      all.push_back({lm.sum_log_prob(seq, prompt.size()), gen});
      return;
    }
    for (int32_t t = 0; t < TinyLm::kVocab; ++t) {
      gen.push_back(t);
      walk(gen);
      gen.pop_back();
    }
  };
  walk({});
  ASSERT_EQ(all.size(), 156u);
  std::stable_sort(all.begin(), all.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  ASSERT_GE(r.completions.size(), 10u);
  for (size_t k = 0; k < 10; ++k) {
    EXPECT_EQ(r.completions[k], all[k].second) << "rank " << k;
    EXPECT_NEAR(r.beam_scores[k], all[k].first, 1e-5 * std::max(1.0, std::fabs(all[k].first)))
        << "rank " << k;
  }
  // The distributions are far from uniform, so the search had something to find.
  EXPECT_GT(all.front().first - all.back().first, 5.0);
}

// Beam 1 keeps the most likely token each step and stops at the end-of-document token: greedy.
TEST(BeamSearch, OneBeamIsGreedy) {
  TinyLm lm;
  for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{1, 2}, {3}, {0, 4, 4, 1}}) {
    for (double lp : {0.0, 1.0, 2.0}) {
      GenerationOptions o;
      o.max_new_tokens = 10;
      o.eod_id = TinyLm::kEod;
      o.sampling.temperature = 0;
      o.length_penalty = lp;
      InferenceEngine e1(*lm.model, lm.ctx, 1, 16), e2(*lm.model, lm.ctx, 1, 16);
      const GenerationResult greedy = generate(e1, lm.ctx, {prompt}, o);
      const GenerationResult beam = beam_search(e2, lm.ctx, prompt, o);
      ASSERT_EQ(beam.completions.size(), 1u);
      EXPECT_EQ(beam.completions[0], greedy.completions[0]) << "length penalty " << lp;
    }
  }
}

// The log-probabilities generation reports are the model's: equal to a full recomputation.
TEST(Generation, LogProbsEqualAFullRecomputation) {
  TinyLm lm;
  const std::vector<std::vector<int32_t>> prompts{{1, 2, 3}, {4}};
  GenerationOptions o;
  o.max_new_tokens = 5;
  o.sampling.temperature = 0.7;
  o.sampling.seed = 3;
  o.log_probs = o.prompt_log_probs = true;
  InferenceEngine e(*lm.model, lm.ctx, 2, 16);
  const GenerationResult r = generate(e, lm.ctx, prompts, o);
  ASSERT_EQ(r.completion_log_probs.size(), 2u);
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::vector<int32_t> seq = prompts[i];
    ASSERT_EQ(r.completion_log_probs[i].size(), r.completions[i].size());
    ASSERT_EQ(r.prompt_log_probs[i].size(), prompts[i].size() - 1);
    for (size_t t = 0; t < r.completions[i].size(); ++t) {
      seq.push_back(r.completions[i][t]);
      const double want = lm.sum_log_prob(seq, seq.size() - 1);
      EXPECT_NEAR(r.completion_log_probs[i][t], want, 1e-5) << "prompt " << i << " token " << t;
    }
    for (size_t j = 1; j < prompts[i].size(); ++j)
      EXPECT_NEAR(r.prompt_log_probs[i][j - 1],
                  lm.sum_log_prob({prompts[i].begin(), prompts[i].begin() + j + 1}, j), 1e-5);
  }
}

// A bf16 model generates through a bf16 KV cache: its logits, prefilled at once or decoded one
// token at a time through the cache, stay within bf16's rounding of the f32 model's (same
// weights), and a 1-token prefill plus cached decoding equals the prefill's all-row logits to
// bf16 rounding too. The checked values are of the order of 10 (the scaled-up weights).
TEST(Generation, Bf16KvCacheFollowsTheF32Model) {
  TinyLm lm;
  GPTModel bf(lm.cfg, model_shard_for(lm.cfg, 1, 0, 1, 0), *lm.be, *lm.ctx.tp, DType::BF16);
  for (const ParamSpec& s : lm.model->params().specs()) {
    std::vector<float> host(static_cast<size_t>(s.numel()));
    lm.be->copy_to_host(host.data(), lm.model->params().param(s));
    Tensor p = bf.params().param(s);
    lm.be->copy_from_host(p, host.data());
  }
  bf.sync_compute_weights();
  const std::vector<int32_t> tokens{1, 2, 3, 4, 0, 2, 1, 3, 3, 4, 1, 0};
  const int64_t n = static_cast<int64_t>(tokens.size()), V = TinyLm::kVocab;
  std::vector<float> want, all, step;
  InferenceEngine ef(*lm.model, lm.ctx, 1, 16), eb(bf, lm.ctx, 1, 16), ec(bf, lm.ctx, 1, 16);
  ef.forward({{0, 0, n}}, tokens, want, true);
  eb.forward({{0, 0, n}}, tokens, all, true);
  std::vector<float> cached;
  for (int64_t t = 0; t < n; ++t) {
    ec.forward({{0, t, 1}}, {tokens[t]}, step);
    cached.insert(cached.end(), step.begin(), step.end());
  }
  ASSERT_EQ(all.size(), static_cast<size_t>(n * V));
  ASSERT_EQ(cached.size(), all.size());
  double m = 0, err_all = 0, err_cached = 0, err_self = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(want[i])));
    err_all = std::max(err_all, std::fabs(static_cast<double>(all[i]) - want[i]));
    err_cached = std::max(err_cached, std::fabs(static_cast<double>(cached[i]) - want[i]));
    err_self = std::max(err_self, std::fabs(static_cast<double>(cached[i]) - all[i]));
  }
  ASSERT_GT(m, 1.0);
  EXPECT_GT(err_all, 0.0);  // bf16 really ran
  EXPECT_LE(err_all, 0.05 * m) << "bf16 prefill against f32";
  EXPECT_LE(err_cached, 0.05 * m) << "bf16 cached decoding against f32";
  EXPECT_LE(err_self, 0.05 * m) << "bf16 cached decoding against bf16 prefill";
}

// A server batches requests: with sample_stream, a prompt's draws are those of its request run
// alone, whatever else shares the batch.
TEST(Generation, SampleStreamsMakeBatchingInvisible) {
  TinyLm lm;
  GenerationOptions a;
  a.max_new_tokens = 6;
  a.sampling.seed = 5;
  a.sampling.temperature = 1.5;
  GenerationOptions b = a;
  b.sampling.seed = 9;
  b.max_new_tokens = 3;
  InferenceEngine e1(*lm.model, lm.ctx, 1, 16), e2(*lm.model, lm.ctx, 3, 16);
  const GenerationResult alone = generate(e1, lm.ctx, {{2, 2}}, a);
  GenerationOptions a0 = a, b0 = b, b1 = b;
  a0.sample_stream = 0;
  b0.sample_stream = 0;
  b1.sample_stream = 1;
  const GenerationResult batched = generate(e2, lm.ctx, {{1}, {2, 2}, {3, 0}}, {b0, a0, b1});
  EXPECT_EQ(batched.completions[1], alone.completions[0]);
  EXPECT_EQ(batched.completions[0].size(), 3u);
}

TEST(Generation, PromptIdsOutsideTheVocabularyAreRefused) {
  try {
    check_prompts({{1, 2}, {3, 99999999}}, 50257, 1024);
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "prompt 2: token id 99999999 (position 2) is outside the vocabulary of 50257 "
                 "tokens (ids 0 to 50256)");
  }
  EXPECT_THROW(check_prompts({{-1}}, 10, 8), ConfigError);
  EXPECT_THROW(check_prompts({{}}, 10, 8), ConfigError);
  EXPECT_NO_THROW(check_prompts({{9, 0}}, 10, 8));
}

TEST(Sampling, TopPDecaysToItsBound) {
  SamplingOptions o;
  o.top_p = 0.9;
  EXPECT_EQ(o.top_p_at(5), 0.9);  // no decay
  o.top_p_decay = 0.5;
  o.top_p_bound = 0.2;
  EXPECT_DOUBLE_EQ(o.top_p_at(1), 0.45);
  EXPECT_DOUBLE_EQ(o.top_p_at(2), 0.225);
  EXPECT_DOUBLE_EQ(o.top_p_at(3), 0.2);
  EXPECT_NO_THROW(o.validate());
  o.top_p_bound = 0.95;  // above top_p
  EXPECT_THROW(o.validate(), ConfigError);
  o.top_p_bound = 0;
  o.top_p_decay = 1.5;
  EXPECT_THROW(o.validate(), ConfigError);
}

TEST(TextServer, RequestsParseWithMegatronDefaults) {
  const ApiRequest q = parse_api_request(R"({"prompts": ["a", "b c"]})");
  EXPECT_EQ(q.prompts, (std::vector<std::string>{"a", "b c"}));
  EXPECT_EQ(q.tokens_to_generate, 64);
  EXPECT_EQ(q.temperature, 1.0);
  EXPECT_EQ(q.top_k, 0);
  EXPECT_EQ(q.beam_width, 0);
  EXPECT_FALSE(q.logprobs);
  const ApiRequest b = parse_api_request(
      R"({"prompts": ["x"], "tokens_to_generate": 5, "beam_width": 4, "length_penalty": 0.5,
          "random_seed": 42, "logprobs": true, "add_BOS": true, "stop_token": 7, "no_log": true})");
  EXPECT_EQ(b.beam_width, 4);
  EXPECT_EQ(b.length_penalty, 0.5);
  EXPECT_EQ(b.random_seed, 42);
  EXPECT_TRUE(b.logprobs && b.add_BOS);
  EXPECT_EQ(b.stop_token, 7);
}

TEST(TextServer, BadRequestsSayWhatIsWrong) {
  auto reason = [](const char* body) -> std::string {
    try {
      parse_api_request(body);
    } catch (const ApiError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(reason("{"), "the body is not JSON: unexpected end of input at byte 1");
  EXPECT_EQ(reason("[1]"), "the body must be a JSON object");
  EXPECT_EQ(reason("{}"), "prompts argument required");
  EXPECT_EQ(reason(R"({"prompts": []})"), "prompts is empty");
  EXPECT_EQ(reason(R"({"prompts": ["a", 3]})"), "prompts is not a list of strings");
  EXPECT_EQ(reason(R"({"prompts": ["a"], "tokens_to_generate": -3})"),
            "tokens_to_generate must be an integer greater than or equal to 0");
  EXPECT_EQ(reason(R"({"prompts": ["a"], "tokens_to_generate": 2.5})"),
            "tokens_to_generate must be an integer greater than or equal to 0");
  EXPECT_EQ(reason(R"({"prompts": ["a"], "tokens_to_generate": 0})"),
            "tokens_to_generate=0 implies logprobs should be True");
  EXPECT_EQ(reason(R"({"prompts": ["a"], "temperature": 101})"),
            "temperature must be a number from 0 (greedy) to 100");
  EXPECT_EQ(reason(R"({"prompts": ["a"], "top_k": 5, "top_p": 0.5})"),
            "cannot set both top-k and top-p samplings");
  EXPECT_EQ(reason(R"({"prompts": ["a"], "top_p_decay": 0.5})"),
            "top_p_decay cannot be set without top_p");
  EXPECT_EQ(reason(R"({"prompts": ["a"], "logprobs": "yes"})"), "logprobs must be a boolean value");
  EXPECT_EQ(reason(R"({"prompts": ["a", "b"], "beam_width": 2})"),
            "beam search takes one prompt per request (beam_width given with 2 prompts)");
  EXPECT_EQ(
      reason(R"({"prompts": ["a"], "stop_on_eol": true})").rfind("unknown field 'stop_on_eol'", 0),
      0u);
  // Issue 27: a key twice was generated twice; 50,000 open brackets crashed the server.
  EXPECT_EQ(reason(R"({"prompts":["Hello"],"prompts":["Bye"]})"),
            "the body is not JSON: duplicate key \"prompts\" at byte 21");
  EXPECT_EQ(reason(("{\"prompts\": " + std::string(50000, '[')).c_str()),
            "the body is not JSON: nesting deeper than 512 levels at byte 523");
}

TEST(TextServer, JsonStringsAreValidUtf8) {
  EXPECT_EQ(json_quote("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\n\\u0001\"");
  EXPECT_EQ(json_quote("caf\xc3\xa9"), "\"caf\xc3\xa9\"");
  EXPECT_EQ(json_quote("x\xe2\x82"), "\"x\xef\xbf\xbd\"");  // a split character: one U+FFFD
}
