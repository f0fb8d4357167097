// Loss masks (data/dataset.hpp, step/step_executor.cpp) through the trainer: a target whose mask
// is 0 does not count, and the objective is Megatron's mean per micro-batch averaged over the
// micro-batches, or with --calculate-per-token-loss the global batch's mean per token.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "data/dataset.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {

// Samples and masks held in memory: sample i is tokens[i], its mask masks[i].
class MaskedSamples final : public TokenDataset {
 public:
  MaskedSamples(int seq, std::vector<std::vector<int32_t>> tokens,
                std::vector<std::vector<uint8_t>> masks)
      : seq_(seq), tokens_(std::move(tokens)), masks_(std::move(masks)) {}
  std::string describe() const override { return "masked samples"; }
  int seq_length() const override { return seq_; }
  int64_t num_samples() const override { return static_cast<int64_t>(tokens_.size()); }
  void get(int64_t i, int32_t* out) const override {
    const auto& t = tokens_[static_cast<size_t>(i % num_samples())];
    std::copy(t.begin(), t.end(), out);
  }
  bool has_loss_mask() const override { return true; }
  void get_loss_mask(int64_t i, uint8_t* out) const override {
    const auto& m = masks_[static_cast<size_t>(i % num_samples())];
    std::copy(m.begin(), m.end(), out);
  }
  int seq_;
  std::vector<std::vector<int32_t>> tokens_;
  std::vector<std::vector<uint8_t>> masks_;
};

constexpr int kSeq = 16, kVocab = 64;

// Four samples: two micro-batches of two at a global batch of 4. Micro-batch 0's masks are about
// half ones; micro-batch 1's all zero when `empty_second`, else about a quarter ones.
MaskedSamples samples(bool empty_second) {
  std::mt19937 g(3);
  std::uniform_int_distribution<int> tok(0, kVocab - 1), bit(0, 3);
  std::vector<std::vector<int32_t>> t(4, std::vector<int32_t>(kSeq + 1));
  std::vector<std::vector<uint8_t>> m(4, std::vector<uint8_t>(kSeq + 1));
  for (int s = 0; s < 4; ++s)
    for (int p = 0; p <= kSeq; ++p) {
      t[s][p] = tok(g);
      const int b = bit(g);
      m[s][p] = s < 2 ? (b < 2) : (!empty_second && b == 0);
    }
  m[0][kSeq] = 1;  // the last target of sample 0 counts, that of sample 1 does not
  m[1][kSeq] = 0;
  return MaskedSamples(kSeq, t, m);
}

StepStats first_step(TokenDataset& data, bool per_token) {
  const GPTConfig m = testing_util::small_gpt(32, 4, kSeq, kVocab);
  TrainConfig t = testing_util::tiny_schedule();
  t.micro_batch_size = 2;
  t.global_batch_size = 4;
  t.train_iters = 1;
  t.per_token_loss = per_token;
  auto be = make_cpu_backend();
  Trainer tr(m, t, *be, data);
  return tr.train().at(0);
}

}  // namespace

TEST(LossMask, OnlyTargetsWhoseMaskIsOneCount) {
  MaskedSamples data = samples(false);
  const StepStats base = first_step(data, false);
  // The loss tokens: the mask ones at positions 1..seq.
  int64_t ones = 0;
  for (const auto& m : data.masks_)
    for (int p = 1; p <= kSeq; ++p) ones += m[p];
  EXPECT_EQ(base.loss_tokens, ones);
  EXPECT_GT(base.loss, 3.0);
  // A sample's last token is only a target: changing it changes the loss when its mask is 1.
  MaskedSamples uncounted = data, counted = data;
  uncounted.tokens_[1][kSeq] = (uncounted.tokens_[1][kSeq] + 7) % kVocab;
  counted.tokens_[0][kSeq] = (counted.tokens_[0][kSeq] + 7) % kVocab;
  EXPECT_EQ(first_step(uncounted, false).loss, base.loss);
  EXPECT_NE(first_step(counted, false).loss, base.loss);
  // Every mask 1 again: the same as data without masks.
  for (auto& m : data.masks_) std::fill(m.begin(), m.end(), uint8_t(1));
  EXPECT_EQ(first_step(data, false).loss_tokens, 4 * kSeq);
}

TEST(LossMask, MegatronsMeanPerMicroBatchAndThePerTokenLoss) {
  // Micro-batch 1 has no loss token: Megatron's objective (S0/n0 + 0) / 2 has half the gradient of
  // the per-token S0/n0; both report the loss S0/n0.
  MaskedSamples one_empty = samples(true);
  const StepStats mean = first_step(one_empty, false), per_token = first_step(one_empty, true);
  EXPECT_TRUE(std::isfinite(mean.loss));
  EXPECT_EQ(mean.loss, per_token.loss);
  EXPECT_GT(per_token.grad_norm, 1e-3);
  EXPECT_NEAR(mean.grad_norm, 0.5 * per_token.grad_norm, 1e-6 * per_token.grad_norm);
  // Micro-batches of n0 != n1 tokens: (S0/n0 + S1/n1) / 2 against (S0 + S1) / (n0 + n1): the same
  // loss reported, another gradient.
  MaskedSamples uneven = samples(false);
  const StepStats a = first_step(uneven, false), b = first_step(uneven, true);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_GT(std::fabs(a.grad_norm - b.grad_norm), 1e-4 * b.grad_norm);
}

TEST(LossMask, EvaluatingMaskedDataLeavesUnmaskedTrainingAlone) {
  // Training on data without masks, evaluating on masked data in between: the training steps
  // are those of a run that never evaluated (no mask of the evaluation is reused).
  const GPTConfig m = testing_util::small_gpt(32, 4, kSeq, kVocab);
  TrainConfig t = testing_util::tiny_schedule();
  t.micro_batch_size = 2;
  t.global_batch_size = 4;
  t.train_iters = 3;
  MaskedSamples valid = samples(false);
  std::vector<double> plain, evaluated;
  for (bool eval : {false, true}) {
    auto be = make_cpu_backend();
    auto data = make_mock_dataset(kVocab, kSeq, 7);
    Trainer tr(m, t, *be, *data);
    for (int i = 0; i < 3; ++i) {
      if (eval) EXPECT_GT(tr.evaluate(valid, 0, 1), 3.0);
      (eval ? evaluated : plain).push_back(tr.train_step().loss);
    }
  }
  EXPECT_EQ(plain, evaluated);
}

// A global batch in which no token counts toward the loss (issue 58): the iteration is skipped
// (no update, its samples consumed, said in a warning), with and without the per-token loss, and
// the next one trains on the next samples; evaluating only such samples has no loss (NaN).
TEST(LossMask, AGlobalBatchWithoutCountedTokensIsSkipped) {
  // Samples 4..7 (the second global batch) have no counted target; 0..3 and 8..11 do.
  MaskedSamples half = samples(false);
  std::vector<std::vector<int32_t>> t;
  std::vector<std::vector<uint8_t>> m;
  for (int s = 0; s < 12; ++s) {
    t.push_back(half.tokens_[static_cast<size_t>(s % 4)]);
    m.push_back(s / 4 == 1 ? std::vector<uint8_t>(kSeq + 1, 0)
                           : half.masks_[static_cast<size_t>(s % 4)]);
  }
  MaskedSamples data(kSeq, t, m);
  const GPTConfig cfg = testing_util::small_gpt(32, 4, kSeq, kVocab);
  for (bool per_token : {false, true}) {
    TrainConfig tc = testing_util::tiny_schedule();
    tc.micro_batch_size = 2;
    tc.global_batch_size = 4;
    tc.train_iters = 3;
    tc.per_token_loss = per_token;
    auto be = make_cpu_backend();
    Trainer tr(cfg, tc, *be, data);
    const std::vector<StepStats> steps = tr.train();
    ASSERT_EQ(steps.size(), 3u);
    EXPECT_FALSE(steps[0].not_run);
    EXPECT_TRUE(steps[1].not_run && steps[1].skipped);
    EXPECT_EQ(steps[1].iteration, 2);
    EXPECT_EQ(steps[1].global_batch, 4);
    EXPECT_FALSE(steps[2].not_run);
    EXPECT_TRUE(std::isfinite(steps[2].loss) && steps[2].loss > 1.0);
    EXPECT_GT(steps[2].grad_norm, 0);
    EXPECT_EQ(tr.iteration(), 3);
    // Iteration 3 read samples 8..11 (those of 0..3) after one update: the loss of iteration 2 of
    // a run without the empty batch, bitwise.
    {
      MaskedSamples plain = samples(false);
      TrainConfig pc = tc;
      pc.train_iters = 2;
      auto be2 = make_cpu_backend();
      Trainer p(cfg, pc, *be2, plain);
      const std::vector<StepStats> ps = p.train();
      EXPECT_EQ(steps[0].loss, ps[0].loss);
      EXPECT_EQ(steps[2].loss, ps[1].loss);
    }
    EXPECT_TRUE(std::isnan(tr.evaluate(data, 4, 1)));
    EXPECT_TRUE(std::isfinite(tr.evaluate(data, 0, 1)));
  }
}
