// test_lr_schedule.cpp: the learning-rate and weight-decay schedules against formulas written
// here from Megatron-LM's OptimizerParamScheduler (get_lr, get_wd) in another form, at every step
// of a run and at the boundaries (last warm-up step, start of WSD's decay, end of the decay);
// sample-based variants; the bad options; the weight decay reaching AdamW in a training run.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "data/dataset.hpp"
#include "step/lr_schedule.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {

constexpr double kMax = 3e-4, kMin = 3e-5;

// Megatron's get_lr written independently: the fraction f of (max - min) left at step n.
// Warm-up interpolates init -> max; after `decay` the rate is min.
double ref_lr(int64_t n, double init, int64_t warmup, int64_t decay,
              const std::function<double(int64_t)>& f) {
  if (warmup > 0 && n <= warmup) {
    const double a = static_cast<double>(n) / static_cast<double>(warmup);
    return (1 - a) * init + a * kMax;
  }
  if (n > decay) return kMin;
  return kMin + f(n) * (kMax - kMin);
}

// WSD's fraction: 1 until decay - wsd, then the annealing curve of r in (0, 1].
std::function<double(int64_t)> wsd_fraction(int64_t decay, int64_t wsd, const std::string& style) {
  return [=](int64_t n) {
    const int64_t start = decay - wsd;
    if (n <= start) return 1.0;
    const double r = static_cast<double>(n - start) / static_cast<double>(wsd);
    if (style == "linear") return static_cast<double>(decay - n) / static_cast<double>(wsd);
    if (style == "cosine") return std::pow(std::cos(M_PI * r / 2), 2);  // (1 + cos(pi r)) / 2
    if (style == "exponential") return std::exp2(1 - r) - 1;            // 2 * 0.5^r - 1
    return 1 - std::pow(r, 0.5);                                        // minus_sqrt
  };
}

LrSchedule wsd(const std::string& style, int64_t warmup, int64_t decay, int64_t length,
               double init = 0) {
  LrScheduleSpec s;
  s.max_lr = kMax;
  s.min_lr = kMin;
  s.init_lr = init;
  s.warmup = warmup;
  s.decay = decay;
  s.style = "WSD";
  s.wsd_decay = length;
  s.wsd_style = style;
  return LrSchedule(s);
}

// Throws ConfigError whose message contains `what` (the option it names).
template <class F>
void expect_config_error(F f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no ConfigError (expected one naming " << what << ")";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

}  // namespace

// Every WSD style at every step of a run: warm-up 10, decay phase to step 100, the last 40 steps
// annealing (from step 60), then min-lr.
TEST(LrSchedule, WsdEveryStyleAtEveryStep) {
  for (const std::string style : {"exponential", "linear", "cosine", "minus_sqrt"}) {
    const LrSchedule s = wsd(style, 10, 100, 40);
    const auto f = wsd_fraction(100, 40, style);
    for (int64_t n = 1; n <= 130; ++n)
      EXPECT_NEAR(s.lr(n), ref_lr(n, 0, 10, 100, f), 1e-12 * kMax) << style << " step " << n;
    EXPECT_EQ(s.lr(10), kMax) << style;             // the last warm-up step
    EXPECT_NEAR(s.lr(11), kMax, 1e-15) << style;    // stable: min + (max - min)
    EXPECT_NEAR(s.lr(60), kMax, 1e-15) << style;    // the anneal's start: still max
    EXPECT_LT(s.lr(61), s.lr(60) - 1e-9) << style;  // then it falls
    EXPECT_NEAR(s.lr(100), kMin, 1e-15) << style;   // the decay's end
    EXPECT_EQ(s.lr(101), kMin) << style;            // after it
    for (int64_t n = 61; n <= 100; ++n) EXPECT_LE(s.lr(n), s.lr(n - 1)) << style << " " << n;
  }
  // Hand values halfway (r = 0.5, step 80) and a quarter in (r = 0.25, step 70).
  const double d = kMax - kMin;
  EXPECT_NEAR(wsd("linear", 10, 100, 40).lr(80), kMin + 0.5 * d, 1e-15);
  EXPECT_NEAR(wsd("cosine", 10, 100, 40).lr(80), kMin + 0.5 * d, 1e-15);
  EXPECT_NEAR(wsd("exponential", 10, 100, 40).lr(80), kMin + (std::sqrt(2.0) - 1) * d, 1e-15);
  EXPECT_NEAR(wsd("minus_sqrt", 10, 100, 40).lr(70), kMin + 0.5 * d, 1e-15);
  // WSD filling the whole decay phase (90 = 100 - 10 steps) anneals right after the warm-up.
  const LrSchedule full = wsd("linear", 10, 100, 90);
  EXPECT_EQ(full.lr(10), kMax);
  EXPECT_NEAR(full.lr(55), kMin + 0.5 * d, 1e-15);
  // No warm-up: stable from step 1.
  EXPECT_NEAR(wsd("cosine", 0, 100, 40).lr(1), kMax, 1e-15);
}

TEST(LrSchedule, WarmupInit) {
  LrScheduleSpec s;
  s.max_lr = kMax;
  s.min_lr = kMin;
  s.init_lr = 1e-5;
  s.warmup = 8;
  s.decay = 40;
  s.style = "cosine";
  const LrSchedule lr(s);
  const auto cos_f = [](int64_t n) { return std::pow(std::cos(M_PI * (n - 8) / 32.0 / 2), 2); };
  for (int64_t n = 1; n <= 50; ++n)
    EXPECT_NEAR(lr.lr(n), ref_lr(n, 1e-5, 8, 40, cos_f), 1e-12 * kMax) << n;
  EXPECT_NEAR(lr.lr(4), 1e-5 + 0.5 * (kMax - 1e-5), 1e-18);  // halfway through the warm-up
  EXPECT_EQ(lr.lr(8), kMax);
  EXPECT_NEAR(lr.lr(0), 1e-5, 1e-18);  // Megatron's num_steps 0: the init value
  // WSD with an init value too.
  const LrSchedule w = wsd("minus_sqrt", 10, 100, 40, 2e-5);
  for (int64_t n = 1; n <= 110; ++n)
    EXPECT_NEAR(w.lr(n), ref_lr(n, 2e-5, 10, 100, wsd_fraction(100, 40, "minus_sqrt")),
                1e-12 * kMax)
        << n;
}

// max_lr x sqrt(max(warm-up, 1)) / sqrt(max(step, 1)) counted in samples, floored at min-lr.
TEST(LrSchedule, InverseSquareRoot) {
  LrScheduleSpec s;
  s.max_lr = kMax;
  s.min_lr = kMin;
  s.warmup = 16;
  s.decay = 2000;
  s.style = "inverse-square-root";
  s.samples_per_step = 8;
  const LrSchedule a(s);
  EXPECT_EQ(a.lr(8), kMax / 2);  // warm-up
  EXPECT_EQ(a.lr(16), kMax);
  EXPECT_NEAR(a.lr(64), kMax / 2, 1e-18);                        // sqrt(16 / 64)
  EXPECT_NEAR(a.lr(400), kMax / 5, 1e-18);                       // sqrt(16 / 400)
  EXPECT_NEAR(a.lr(1000), kMax * 4 / std::sqrt(1000.0), 1e-18);  // 3.79e-5, above min-lr
  EXPECT_EQ(a.lr(1700), kMin);  // 3e-4 x 4 / sqrt(1700) = 2.9e-5: floored at min-lr
  EXPECT_EQ(a.lr(2001), kMin);  // after the decay: min-lr
  for (int64_t n = 17; n <= 2000; ++n)
    EXPECT_NEAR(a.lr(n), std::max(kMin, kMax * 4 / std::sqrt(double(n))), 1e-12 * kMax) << n;
  // Without warm-up Megatron's step count (samples) shows: max_lr / sqrt(8 n).
  s.warmup = 0;
  s.min_lr = 0;
  const LrSchedule b(s);
  EXPECT_NEAR(b.lr(2), kMax / 4, 1e-18);
  EXPECT_NEAR(b.lr(1), kMax / std::sqrt(8.0), 1e-18);
  s.samples_per_step = 1;  // sample-based schedule (a ramp): the step is the samples
  EXPECT_NEAR(LrSchedule(s).lr(16), kMax / 4, 1e-18);
}

// The styles Tessera had before stay bit for bit what they were (the old formula, iter >= decay
// at min-lr), with and without warm-up.
TEST(LrSchedule, ExistingStylesUnchanged) {
  auto old_lr = [](double max_lr, double min_lr, int64_t warmup, int64_t decay,
                   const std::string& style, int64_t iter) {
    if (warmup > 0 && iter <= warmup) return max_lr * static_cast<double>(iter) / warmup;
    if (style == "constant") return max_lr;
    if (iter >= decay) return min_lr;
    const double span = static_cast<double>(decay - warmup);
    const double ratio = span > 0 ? static_cast<double>(iter - warmup) / span : 1.0;
    const double coeff = style == "linear" ? 1.0 - ratio : 0.5 * (std::cos(M_PI * ratio) + 1.0);
    return min_lr + coeff * (max_lr - min_lr);
  };
  for (const std::string style : {"constant", "linear", "cosine"})
    for (int64_t warmup : {0, 7})
      for (int64_t decay : {7, 50, 333}) {
        const LrSchedule s(6e-4, 6e-5, warmup, decay, style);
        for (int64_t n = 1; n <= 400; ++n)
          EXPECT_EQ(s.lr(n), old_lr(6e-4, 6e-5, warmup, decay, style, n))
              << style << " warm-up " << warmup << " decay " << decay << " step " << n;
      }
}

// Megatron's get_wd: start + coeff x (end - start) over the run, end after it.
TEST(WeightDecaySchedule, ConstantLinearCosine) {
  const WeightDecaySchedule c(0.1, 0.1, 50, "constant");
  EXPECT_FALSE(c.scheduled());
  for (int64_t n : {0, 1, 25, 50, 51}) EXPECT_EQ(c.wd(n), 0.1);
  const WeightDecaySchedule lin(0.01, 0.1, 50, "linear"), cos(0.01, 0.1, 50, "cosine");
  EXPECT_TRUE(lin.scheduled());
  for (int64_t n = 0; n <= 60; ++n) {
    const double r = std::min(1.0, n / 50.0);
    EXPECT_NEAR(lin.wd(n), 0.01 * (1 - r) + 0.1 * r, 1e-15) << n;
    EXPECT_NEAR(cos.wd(n), 0.01 + 0.09 * std::pow(std::sin(M_PI * r / 2), 2), 1e-15) << n;
  }
  EXPECT_EQ(lin.wd(0), 0.01);
  EXPECT_NEAR(lin.wd(25), 0.055, 1e-15);
  EXPECT_NEAR(cos.wd(25), 0.055, 1e-15);
  EXPECT_NEAR(cos.wd(50), 0.1, 1e-15);
  EXPECT_EQ(cos.wd(51), 0.1);
}

// The schedules a TrainConfig resolves to: iterations from samples without a ramp, samples under
// one; the weight decay over the whole run in the same unit.
TEST(LrSchedule, FromTrainConfigIterationsAndSamples) {
  TrainConfig t;
  t.micro_batch_size = 4;
  t.global_batch_size = 16;
  t.lr = kMax;
  t.min_lr = kMin;
  t.train_samples = 1600;  // 100 iterations
  t.lr_warmup_samples = 160;
  t.lr_decay_style = "WSD";
  t.lr_wsd_decay_samples = 640;  // 40 iterations
  t.lr_wsd_decay_style = "cosine";
  t.weight_decay_incr_style = "linear";
  t.start_weight_decay = 0.0;
  t.end_weight_decay = 0.2;
  const TrainConfig r = t.resolved(1);
  EXPECT_EQ(r.train_iters, 100);
  EXPECT_EQ(r.lr_wsd_decay_iters, 40);
  EXPECT_EQ(r.weight_decay_incr_iters, 100);
  const LrSchedule s = LrSchedule::of(r, 1);
  const auto f = wsd_fraction(100, 40, "cosine");
  for (int64_t n = 1; n <= 100; ++n)
    EXPECT_NEAR(s.lr(n), ref_lr(n, 0, 10, 100, f), 1e-12 * kMax) << n;
  const WeightDecaySchedule w = WeightDecaySchedule::of(r);
  EXPECT_NEAR(w.wd(30), 0.06, 1e-15);

  // A batch-size ramp: the schedule counts samples.
  TrainConfig ramp = t;
  ramp.rampup_batch_size = {8, 8, 64};
  ramp.lr_decay_samples = 1200;
  ramp.lr_wsd_decay_samples = 300;
  const TrainConfig q = ramp.resolved(1);
  EXPECT_TRUE(q.lr_schedule_in_samples);
  EXPECT_EQ(q.lr_wsd_decay_iters, 300);
  EXPECT_EQ(q.weight_decay_incr_iters, 1600);
  const LrSchedule sq = LrSchedule::of(q, 1);
  const auto fq = wsd_fraction(1200, 300, "cosine");
  for (int64_t n = 8; n <= 1700; n += 8)
    EXPECT_NEAR(sq.lr(n), ref_lr(n, 0, 160, 1200, fq), 1e-12 * kMax) << n;
  EXPECT_EQ(sq.lr(160), kMax);           // the last warm-up sample
  EXPECT_NEAR(sq.lr(900), kMax, 1e-15);  // the anneal starts after 1200 - 300 samples
  EXPECT_NEAR(sq.lr(1050), kMin + 0.5 * (kMax - kMin), 1e-15);
  EXPECT_NEAR(WeightDecaySchedule::of(q).wd(800), 0.1, 1e-15);

  TrainConfig bad = ramp;  // iterations do not measure a ramped run
  bad.lr_wsd_decay_samples = 0;
  bad.lr_wsd_decay_iters = 10;
  expect_config_error([&] { bad.resolved(1); }, "--lr-wsd-decay-iters=10");
  bad = t;
  bad.lr_wsd_decay_samples = 8;  // under one global batch
  expect_config_error([&] { bad.resolved(1); }, "--lr-wsd-decay-samples=8");
}

// Bad input: one ConfigError naming the option (Megatron's asserts and choices).
TEST(LrSchedule, BadOptionsNameTheOption) {
  TrainConfig t;
  t.train_iters = 100;
  t.lr = 1e-3;
  t.lr_warmup_iters = 10;
  auto validated = [](const TrainConfig& c) { c.resolved(1).validate(1); };
  TrainConfig b = t;
  b.lr_decay_style = "WSD";
  expect_config_error([&] { validated(b); }, "--lr-decay-style WSD needs --lr-wsd-decay-iters");
  b.lr_wsd_decay_iters = 91;  // 100 - 10 = 90 iterations of decay phase
  expect_config_error([&] { validated(b); }, "--lr-wsd-decay-iters=91 (91 iterations) is longer");
  b.lr_wsd_decay_iters = 90;
  EXPECT_NO_THROW(validated(b));
  b.lr_decay_iters = 60;  // decay phase 50
  expect_config_error([&] { validated(b); }, "60 (--lr-decay-iters/-samples, or the run) - 10");
  b = t;
  b.lr_decay_style = "WSD";
  b.lr_wsd_decay_iters = 10;
  b.lr_wsd_decay_style = "step";
  expect_config_error([&] { validated(b); }, "--lr-wsd-decay-style=step is not a style");
  b = t;
  b.lr_decay_style = "sometimes";
  expect_config_error([&] { validated(b); }, "--lr-decay-style=sometimes is not a style");
  expect_config_error([] { LrSchedule(1, 0, 0, 10, "step"); }, "--lr-decay-style=step");
  b = t;
  b.lr_wsd_decay_iters = 10;  // linear decay
  expect_config_error([&] { validated(b); }, "--lr-wsd-decay-iters applies only to");
  b.lr_wsd_decay_iters = 0;
  b.lr_wsd_decay_style = "cosine";
  expect_config_error([&] { validated(b); }, "--lr-wsd-decay-style applies only to");
  b = t;
  b.lr_decay_style = "WSD";
  b.lr_wsd_decay_iters = -5;
  expect_config_error([&] { validated(b); }, "--lr-wsd-decay-iters=-5");
  b = t;
  b.lr_warmup_init = 2e-3;  // above --lr
  expect_config_error([&] { validated(b); }, "--lr-warmup-init=0.002 is out of range");
  b.lr_warmup_init = -1e-4;
  expect_config_error([&] { validated(b); }, "--lr-warmup-init=-0.0001");
  b = t;
  b.lr_decay_style = "inverse-square-root";  // Megatron takes it without warm-up too
  b.lr_warmup_iters = 0;
  EXPECT_NO_THROW(validated(b));
  b = t;
  b.weight_decay_incr_style = "linear";
  expect_config_error([&] { validated(b); },
                      "--weight-decay-incr-style linear needs --start-weight-decay and "
                      "--end-weight-decay");
  b.start_weight_decay = 0.0;
  expect_config_error([&] { validated(b); }, "--weight-decay-incr-style linear needs");
  b.end_weight_decay = 0.1;
  EXPECT_NO_THROW(validated(b));
  b.start_weight_decay = 0.2;  // Megatron's scheduler: end >= start
  expect_config_error([&] { validated(b); }, "--start-weight-decay=0.2 / --end-weight-decay=0.1");
  b.start_weight_decay = -0.1;
  expect_config_error([&] { validated(b); }, "--start-weight-decay=-0.1");
  b.weight_decay_incr_style = "constant";
  b.start_weight_decay = 0.1;
  expect_config_error([&] { validated(b); },
                      "--start-weight-decay needs --weight-decay-incr-style linear or cosine");
  b = t;
  b.weight_decay_incr_style = "exponential";
  expect_config_error([&] { validated(b); }, "--weight-decay-incr-style=exponential");
}

// The scheduled weight decay reaches AdamW (both optimizers): each step's StepStats carry the
// formula's value, a schedule from 0.05 to 0.05 trains bit for bit as --weight-decay 0.05, and a
// rising one trains differently.
TEST(WeightDecaySchedule, ReachesTheOptimizer) {
  const GPTConfig m = testing_util::small_gpt(32, 4, 32, 64);
  for (const bool dist : {false, true}) {
    auto run = [&](TrainConfig t) {
      t.train_iters = 6;
      t.use_distributed_optimizer = dist;
      auto be = make_cpu_backend();
      auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
      Trainer tr(m, t, *be, *data);
      return tr.train();
    };
    TrainConfig constant = testing_util::tiny_schedule();
    constant.weight_decay = 0.05;
    TrainConfig flat = constant;
    flat.weight_decay = 0.3;  // not used by a scheduled decay
    flat.weight_decay_incr_style = "linear";
    flat.start_weight_decay = flat.end_weight_decay = 0.05;
    TrainConfig rising = flat;
    rising.weight_decay_incr_style = "cosine";
    rising.start_weight_decay = 0.0;
    rising.end_weight_decay = 5.0;  // large enough to move the loss within 6 steps
    const auto a = run(constant), b = run(flat), c = run(rising);
    ASSERT_EQ(a.size(), 6u);
    double differs = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].loss, b[i].loss) << "dist " << dist << " step " << i;
      EXPECT_EQ(a[i].weight_decay, 0.05);
      const double r = static_cast<double>(i + 1) / 6;
      EXPECT_NEAR(c[i].weight_decay, 5.0 * std::pow(std::sin(M_PI * r / 2), 2), 1e-14) << i;
      EXPECT_NEAR(c[i].lr, LrSchedule(1e-2, 1e-3, 5, 6, "cosine").lr(int64_t(i) + 1), 1e-18);
      differs = std::max(differs, std::abs(c[i].loss - a[i].loss));
    }
    EXPECT_EQ(c[0].loss, a[0].loss);  // the first loss is before any update
    EXPECT_GT(differs, 1e-4) << "a rising weight decay left the losses as they were";
  }
}
