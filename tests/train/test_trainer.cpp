// test_trainer.cpp: the training loop: learning, micro-batch invariance, determinism, the LR
// schedule, clipping, AdamW against PyTorch's formula, and the NaN stop.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <utility>

#include "backend/backend.hpp"
#include "data/dataset.hpp"
#include "step/lr_schedule.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {
GPTConfig tiny_model() {
  return testing_util::small_gpt(32, 4, 32, 64);
}
TrainConfig tiny_train() {
  return testing_util::tiny_schedule();
}
std::vector<double> run(const GPTConfig& m, const TrainConfig& t) {
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
  Trainer tr(m, t, *be, *data);
  std::vector<double> losses;
  for (const StepStats& s : tr.train()) losses.push_back(s.loss);
  return losses;
}
}  // namespace

TEST(Trainer, LossFallsOnTinyModelIn50Steps) {
  const std::vector<double> l = run(tiny_model(), tiny_train());
  ASSERT_EQ(l.size(), 50u);
  EXPECT_NEAR(l.front(), std::log(64.0), 0.15);  // starts at chance
  double last5 = 0;
  for (int i = 45; i < 50; ++i) last5 += l[i] / 5;
  // The mock data's floor is 1.21 nats; 50 steps of the tiny model get well below chance (4.16).
  EXPECT_LT(last5, 2.6) << "loss after 50 steps: " << last5;
  EXPECT_GT(last5, kMockDataEntropyNats - 0.05);
}

TEST(Trainer, MicroBatchSizeDoesNotChangeTheTrajectory) {
  TrainConfig t = tiny_train();
  t.train_iters = 8;
  std::vector<std::vector<double>> runs;
  for (int mbs : {1, 2, 8}) {
    t.micro_batch_size = mbs;
    runs.push_back(run(tiny_model(), t));
  }
  for (int k = 1; k < 3; ++k)
    for (size_t i = 0; i < runs[0].size(); ++i)
      EXPECT_NEAR(runs[k][i], runs[0][i], 1e-5 * runs[0][i]) << "run " << k << " step " << i;
}

TEST(Trainer, SameSeedSameLossesBitwise) {
  TrainConfig t = tiny_train();
  t.train_iters = 5;
  const auto a = run(tiny_model(), t), b = run(tiny_model(), t);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]);
  t.seed = 99;
  const auto c = run(tiny_model(), t);
  EXPECT_NE(a[0], c[0]);
}

TEST(Trainer, NonFiniteLossStopsNamingTheIteration) {
  TrainConfig t = tiny_train();
  t.lr = 1e6;
  t.lr_warmup_iters = 0;
  t.clip_grad = 0;
  t.lr_decay_style = "constant";
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(64, 32, t.seed);
  Trainer tr(tiny_model(), t, *be, *data);
  try {
    tr.train();
    FAIL() << "training with lr 1e6 did not stop";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("iteration "), std::string::npos) << e.what();
    EXPECT_GT(tr.iteration(), 0);
  }
}

TEST(LrSchedule, WarmupThenDecay) {
  LrSchedule cos(1.0, 0.1, 10, 110, "cosine");
  EXPECT_DOUBLE_EQ(cos.lr(1), 0.1);
  EXPECT_DOUBLE_EQ(cos.lr(5), 0.5);
  EXPECT_DOUBLE_EQ(cos.lr(10), 1.0);
  EXPECT_NEAR(cos.lr(60), 0.55, 1e-12);  // halfway: min + (max-min)/2
  EXPECT_DOUBLE_EQ(cos.lr(110), 0.1);
  EXPECT_DOUBLE_EQ(cos.lr(500), 0.1);
  LrSchedule lin(1.0, 0.0, 0, 100, "linear");
  EXPECT_DOUBLE_EQ(lin.lr(25), 0.75);
  LrSchedule con(0.3, 0.0, 4, 100, "constant");
  EXPECT_DOUBLE_EQ(con.lr(2), 0.15);
  EXPECT_DOUBLE_EQ(con.lr(80), 0.3);
  EXPECT_THROW(LrSchedule(1, 0, 0, 10, "step"), ConfigError);
}

// Megatron's ramp (RampupBatchsizeNumMicroBatchesCalculator): START 32, INCR 32, 1000 samples up to
// 256: 7 increments of 1000/7 = 142.857 samples; then the global batch.
TEST(TrainConfig, RampupBatchSizeFollowsMegatron) {
  TrainConfig t;
  t.micro_batch_size = 4;
  t.global_batch_size = 256;
  t.rampup_batch_size = {32, 32, 1000};
  t.train_samples = 5000;
  EXPECT_EQ(t.global_batch_at(8, 0), 32);
  EXPECT_EQ(t.global_batch_at(8, 142), 32);
  EXPECT_EQ(t.global_batch_at(8, 143), 64);
  EXPECT_EQ(t.global_batch_at(8, 285), 64);
  EXPECT_EQ(t.global_batch_at(8, 286), 96);
  EXPECT_EQ(t.global_batch_at(8, 999), 224);
  EXPECT_EQ(t.global_batch_at(8, 1000), 256);
  EXPECT_EQ(t.global_batch_at(8, 1001), 256);
  EXPECT_EQ(t.global_batches(8), (std::vector<int>{32, 64, 96, 128, 160, 192, 224, 256}));
  // Megatron's update_train_iters: ramp steps while consumed <= 1000 (5 x 32, 2 x 64, 2 x 96,
  // 1 x 128, 1 x 160, 1 x 192, 1 x 224: 1184 samples, 13 iterations), then (5000 - 1184) / 256.
  const TrainConfig r = t.resolved(8);
  EXPECT_EQ(r.train_iters, 13 + (5000 - 1184) / 256);
  EXPECT_TRUE(r.lr_schedule_in_samples);
  EXPECT_EQ(r.lr_decay_iters, 5000);  // the schedule counts samples
  TrainConfig bad = t;
  bad.rampup_batch_size = {32, 48, 1000};  // 256 - 32 = 224 is not a multiple of 48
  EXPECT_THROW(bad.resolved(8), ConfigError);
  bad.rampup_batch_size = {16, 16, 1000};  // 16 is not a multiple of micro 4 x DP 8
  EXPECT_THROW(bad.resolved(8), ConfigError);
  bad = t;
  bad.train_samples = 0;
  bad.train_iters = 100;  // Megatron: iteration-based training has no ramp
  EXPECT_THROW(bad.resolved(8), ConfigError);
}

// The ramp's first phase is the constant-batch run at START: the same samples and (in samples) the
// same learning rates, so the same losses bitwise; then the batch grows by INCR.
TEST(Trainer, RampupStartsAsTheConstantBatchRun) {
  const GPTConfig m = tiny_model();
  TrainConfig constant = tiny_train();
  constant.global_batch_size = 4;
  constant.train_iters = 8;
  constant.lr_warmup_iters = 10;
  constant.lr_decay_iters = 50;
  TrainConfig ramp = tiny_train();
  ramp.global_batch_size = 12;
  ramp.train_iters = 0;
  ramp.lr_warmup_iters = 0;
  ramp.train_samples = 200;
  ramp.lr_warmup_samples = 40;          // 10 steps of 4
  ramp.lr_decay_samples = 200;          // 50 steps of 4
  ramp.rampup_batch_size = {4, 4, 64};  // batch 4 below 32 samples, 8 below 64, then 12
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, ramp.seed);
  Trainer tr(m, ramp, *be, *data);
  std::vector<StepStats> stats = tr.train();
  const std::vector<double> base = run(m, constant);
  // 8 x 4 (to 32 samples), 4 x 8 (to 64), one of 12 at 64 (the ramp lasts while consumed <=
  // 64), then (200 - 76) / 12 = 10 of 12: 23 iterations.
  ASSERT_EQ(tr.config().train_iters, 23);
  ASSERT_EQ(stats.size(), 23u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(stats[i].global_batch, 4) << i;
    EXPECT_EQ(stats[i].loss, base[i]) << "iteration " << i + 1;
  }
  int64_t consumed = 0;
  for (const StepStats& s : stats) {
    EXPECT_EQ(s.global_batch, ramp.global_batch_at(1, consumed)) << s.iteration;
    consumed += s.global_batch;
  }
  EXPECT_EQ(stats[8].global_batch, 8);
  EXPECT_EQ(stats.back().global_batch, 12);
  EXPECT_EQ(tr.consumed_samples(), consumed);
}

TEST(Optimizer, AdamWDecaysOnlyWeightsAndMatchesTorch) {
  GPTConfig c = tiny_model();
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel m(c, model_shard_for(c, 1, 0, 1, 0), *be, tp);
  m.init_parameters(1);
  ParamStore& ps = m.params();
  Tensor w = ps.param("layers.0.mlp.fc1.weight"), b = ps.param("layers.0.mlp.fc1.bias");
  w.f32()[0] = 1.0f;
  b.f32()[0] = 1.0f;
  ps.flat_grads().fill_(0.5f);
  AdamW opt(ps, *be, 0.9, 0.999, 1e-8);
  opt.step(0.1, 0.1);
  // torch.optim.AdamW(lr=0.1, weight_decay=0.1), p=1, g=0.5: p = 0.99 - 0.1*0.5/(0.5+1e-8)
  const double w1 = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8);
  EXPECT_NEAR(w.f32()[0], w1, 1e-6);
  EXPECT_NEAR(b.f32()[0], 1.0 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-6);  // bias: no decay
  // Second step with another weight decay (a scheduled one): m = 0.095, v = 0.00049975; mhat =
  // 0.5, vhat = 0.25 again; the weight shrinks by 1 - lr x 0.3 this time.
  opt.step(0.1, 0.3);
  EXPECT_NEAR(w.f32()[0], w1 * (1 - 0.1 * 0.3) - 0.1 * 0.5 / (0.5 + 1e-8), 5e-6);
  EXPECT_NEAR(b.f32()[0], 1.0 - 2 * 0.1 * 0.5 / (0.5 + 1e-8), 5e-6);  // fp32 moments, as torch
}

TEST(Optimizer, ClipScalesToMaxNorm) {
  GPTConfig c = tiny_model();
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel m(c, model_shard_for(c, 1, 0, 1, 0), *be, tp);
  ParamStore& ps = m.params();
  ps.flat_grads().fill_(0.01f);
  const double n = std::sqrt(grad_sum_squares(ps, *be));
  EXPECT_NEAR(n, 0.01 * std::sqrt(double(ps.numel())), 1e-6 * n);
  EXPECT_EQ(clip_grads(ps, *be, n, 10 * n), 1.0);  // below the limit: untouched
  const double coef = clip_grads(ps, *be, n, 0.5);
  EXPECT_NEAR(coef, 0.5 / (n + 1e-6), 1e-12);
  EXPECT_NEAR(std::sqrt(grad_sum_squares(ps, *be)), 0.5, 1e-5);
}

// The trainer folds the clip factor into AdamW (each gradient multiplied as it is read): the
// parameters and moments are bitwise those of a scaling pass followed by the plain step.
TEST(Optimizer, FoldedClipEqualsTheScalingPassBitwise) {
  GPTConfig c = tiny_model();
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel a(c, model_shard_for(c, 1, 0, 1, 0), *be, tp),
      b(c, model_shard_for(c, 1, 0, 1, 0), *be, tp);
  ParamStore &pa = a.params(), &pb = b.params();
  for (int64_t i = 0; i < pa.numel(); ++i) {
    pa.flat_grads().f32()[i] = pb.flat_grads().f32()[i] = 0.013f * float((i * 7919) % 101 - 50);
    pb.flat_params().f32()[i] = pa.flat_params().f32()[i];
  }
  const double n = std::sqrt(grad_sum_squares(pa, *be));
  const double coef = clip_coefficient(n, 0.3);
  ASSERT_LT(coef, 0.5);
  AdamW oa(pa, *be, 0.9, 0.95, 1e-8), ob(pb, *be, 0.9, 0.95, 1e-8);
  oa.step(1e-3, 0.1, coef);
  EXPECT_EQ(clip_grads(pb, *be, n, 0.3), coef);
  ob.step(1e-3, 0.1);
  for (const auto& [x, y] : {std::pair<Tensor*, Tensor*>{&pa.flat_params(), &pb.flat_params()},
                             {&oa.exp_avg(), &ob.exp_avg()},
                             {&oa.exp_avg_sq(), &ob.exp_avg_sq()}})
    EXPECT_EQ(std::memcmp(x->raw(), y->raw(), x->nbytes()), 0);
  EXPECT_NE(std::memcmp(pa.flat_grads().raw(), pb.flat_grads().raw(), pa.flat_grads().nbytes()), 0)
      << "the folded clip leaves the gradients as they were";
}
