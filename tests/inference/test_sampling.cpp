// test_sampling.cpp: sampling rules on hand-made logits, and evaluation == the training loss.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "backend/backend.hpp"
#include "data/dataset.hpp"
#include "inference/sampling.hpp"
#include "train/trainer.hpp"

using namespace tessera;

TEST(Sampling, GreedyTopKAndTopP) {
  const float logits[5] = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f};  // a tie at 1 and 3: first index wins
  SamplingOptions o;
  o.temperature = 0;
  EXPECT_EQ(sample_token(logits, 5, o, 0.99), 1);
  o.temperature = 1.0;
  o.top_k = 1;
  for (double u : {0.0, 0.5, 0.999})
    EXPECT_EQ(sample_token(logits, 5, o, u), 1) << "top-k 1 is greedy";
  o.top_k = 2;  // only indices 1 and 3 (equal logits): u < 0.5 -> 1, else 3
  EXPECT_EQ(sample_token(logits, 5, o, 0.25), 1);
  EXPECT_EQ(sample_token(logits, 5, o, 0.75), 3);
  o.top_k = 0;
  o.top_p = 0.3;  // p(1) = p(3) ~ 0.39 each: the nucleus is {1} alone
  for (double u : {0.0, 0.9}) EXPECT_EQ(sample_token(logits, 5, o, u), 1);
  // Full distribution: the CDF in decreasing-probability order 1, 3, 2, 0, 4.
  o.top_p = 1.0;
  const double e[5] = {std::exp(1.0), std::exp(3.0), std::exp(2.0), std::exp(3.0), std::exp(-1.0)};
  const double z = e[0] + e[1] + e[2] + e[3] + e[4];
  EXPECT_EQ(sample_token(logits, 5, o, (e[1] + e[3] + 0.5 * e[2]) / z), 2);
  EXPECT_EQ(sample_token(logits, 5, o, 1 - 0.5 * e[4] / z), 4);
  // Low temperature sharpens towards the best token.
  o.temperature = 0.01;
  EXPECT_EQ(sample_token(logits, 5, o, 0.49), 1);
}

// Backend::sample_tokens reads each row across the tensor-parallel pieces all_gather leaves,
// (pieces, rows, Vl) with padding columns past the vocabulary: the same ids as sample_token on the
// assembled rows, for greedy, top-k, top-p and plain temperature rows.
TEST(Sampling, BackendSamplesRowsAcrossVocabularyPieces) {
  const int64_t P = 3, S = 4, Vl = 7, V = 19;  // 21 columns, the last 2 padding
  std::mt19937 g(5);
  std::normal_distribution<float> nd(0.f, 2.f);
  Tensor pieces({P, S, Vl});
  for (int64_t e = 0; e < pieces.numel(); ++e) pieces.f32()[e] = nd(g);
  std::vector<TokenSampling> how(S);
  how[0].temperature = 0;
  how[1].top_k = 5;
  how[2].top_p = 0.6;
  how[3].temperature = 0.7;
  auto be = make_cpu_backend();
  std::uniform_real_distribution<double> ud(0, 1);
  for (int draw = 0; draw < 50; ++draw) {
    for (TokenSampling& h : how) h.u = ud(g);
    const std::vector<int32_t> ids = be->sample_tokens(pieces, P, S, V, how);
    ASSERT_EQ(ids.size(), static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) {
      std::vector<float> row(V);
      for (int64_t c = 0; c < V; ++c) row[c] = pieces.f32()[((c / Vl) * S + i) * Vl + c % Vl];
      EXPECT_EQ(ids[i], cpu::sample_token(row.data(), V, how[i])) << "row " << i;
      EXPECT_LT(ids[i], V);
    }
  }
  EXPECT_THROW(be->sample_tokens(pieces, P, S, 22, how), Error);  // more than the columns
}

TEST(Sampling, FrequenciesFollowTheSoftmax) {
  const float logits[3] = {0.0f, std::log(2.0f), std::log(5.0f)};  // probabilities 1/8, 2/8, 5/8
  SamplingOptions o;
  std::map<int, int> count;
  const int n = 8000;
  for (int i = 0; i < n; ++i) count[sample_token(logits, 3, o, (i + 0.5) / n)]++;
  EXPECT_NEAR(count[0], n / 8, 2);
  EXPECT_NEAR(count[1], n / 4, 2);
  EXPECT_NEAR(count[2], 5 * n / 8, 2);
}

TEST(Sampling, BadOptionsAreRejected) {
  SamplingOptions o;
  o.top_p = 1.5;
  EXPECT_THROW(o.validate(), ConfigError);
  o.top_p = 0;
  EXPECT_THROW(o.validate(), ConfigError);
  o.top_p = 1;
  o.temperature = -1;
  EXPECT_THROW(o.validate(), ConfigError);
}

namespace {
// A 2-layer model and 4 micro-batches of 2 per step, for the evaluation tests.
GPTConfig eval_model() {
  GPTConfig m;
  m.num_layers = 2;
  m.hidden_size = 32;
  m.num_attention_heads = 4;
  m.seq_length = 16;
  m.vocab_size = 64;
  return m;
}
TrainConfig eval_training() {
  TrainConfig t;
  t.micro_batch_size = 2;
  t.global_batch_size = 8;
  t.train_iters = 10;
  t.lr = 1e-2;
  t.log_interval = 1000;
  return t;
}
}  // namespace

TEST(Evaluation, EqualsTheTrainingLossOnTheSameBatch) {
  const GPTConfig m = eval_model();
  const TrainConfig t = eval_training();
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(64, 16, 7);
  Trainer tr(m, t, *be, *data);
  for (int step = 0; step < 3; ++step) {
    const double eval = tr.evaluate(*data, tr.consumed_samples(), 1);
    const StepStats s = tr.train_step();  // its loss is measured before this step's update
    EXPECT_NEAR(eval, s.loss, 1e-12 * s.loss) << "step " << step;
  }
}

// With dropout on, training draws masks and evaluation does not: evaluation equals the run
// without dropout (same weights: initialization does not depend on dropout), the training loss on
// the same batch differs, and after the step evaluation is still mask-free (deterministic).
TEST(Evaluation, RunsWithoutDropout) {
  const GPTConfig m = eval_model();
  const TrainConfig t = eval_training();
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(64, 16, 7);
  GPTConfig dropped = m;
  dropped.attention_dropout = dropped.hidden_dropout = 0.3;
  Trainer plain(m, t, *be, *data), tr(dropped, t, *be, *data);
  const double eval = tr.evaluate(*data, 0, 1);
  EXPECT_EQ(eval, plain.evaluate(*data, 0, 1));
  const StepStats s = tr.train_step();  // the same batch, with dropout
  // Without dropout the two agree to 1e-12 (the test above); measured here 1.8e-4 relative.
  EXPECT_GT(std::fabs(s.loss - eval), 1e-5 * eval) << "training drew no masks";
  EXPECT_EQ(tr.evaluate(*data, 0, 1), tr.evaluate(*data, 0, 1));
}
