// test_phase_breakdown.cpp: the phase timer over real training steps on the CPU backend with the
// host clock (runtime/select.hpp make_phase_clock): one step of a 2-layer model in two
// micro-batches yields exactly the expected op-kind phases with the expected call counts, their
// sum is at most the step's wall time and most of it, and timing changes no result bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/phase_timer.hpp"
#include "data/dataset.hpp"
#include "runtime/select.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {

// 2 layers, hidden 128, seq 64, vocabulary 500 (padded to 512): big enough that the ops, not the
// host bookkeeping between them, fill a step.
GPTConfig model() {
  return testing_util::small_gpt(128, 4, 64, 500, 2);
}
TrainConfig schedule(DType d = DType::F32) {
  TrainConfig t;
  t.micro_batch_size = 4;
  t.global_batch_size = 8;  // two micro-batches
  t.train_iters = 3;
  t.lr = 1e-3;
  t.log_interval = 1000;
  t.compute_dtype = d;
  return t;
}

struct TimerOff {  // leaves the global timer off and empty whatever the test did
  ~TimerOff() {
    PhaseTimer::global().disable();
    PhaseTimer::global().reset();
  }
};

}  // namespace

TEST(PhaseBreakdown, OneCpuTrainingStepByOpKind) {
  TimerOff off;
  auto be = make_cpu_backend();
  const GPTConfig m = model();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, 5);
  Trainer tr(m, schedule(), *be, *data);
  tr.train_step();  // the first step sets up lazily built tables; time the second
  PhaseTimer& pt = PhaseTimer::global();
  pt.reset();
  pt.enable(make_phase_clock(*be));
  const StepStats st = tr.train_step();
  pt.collect();
  const std::vector<PhaseTotal> totals = pt.totals();
  pt.disable();

  std::map<std::string, PhaseTotal> got;
  for (const PhaseTotal& t : totals) got[t.name] = t;
  // Layers L = 2, micro-batches M = 2; TP = PP = DP = 1, so no TP, pipeline or tied-embedding
  // collectives, and f32, so no compute-weight cast.
  const int L = 2, M = 2;
  const std::map<std::string, int64_t> expected_calls = {
      {"data-wait", 1},
      {"zero-grads", 1},
      {"batch-to-device", M},
      {"embedding-forward", M},
      {"layernorm-forward", (2 * L + 1) * M},  // ln1, the fused residual add + ln2, final ln
      {"qkv-gemm-forward", L * M},
      {"attention-core-forward", L * M},
      {"proj-gemm-forward", L * M},
      {"fc1-gemm-forward", L * M},
      {"gelu-forward", L * M},
      {"fc2-gemm-forward", L * M},
      {"residual-add", L * M},
      {"lm-head-gemm-forward", M},
      {"cross-entropy", M},
      {"lm-head-gemm-backward", M},
      {"layernorm-backward", (2 * L + 1) * M},
      {"fc2-gemm-backward", L * M},  // GELU's backward inside (Backend::matmul_gelu_backward)
      {"fc1-gemm-backward", L * M},
      {"proj-gemm-backward", L * M},
      {"attention-core-backward", L * M},
      {"qkv-gemm-backward", L * M},
      {"embedding-backward", M},
      {"loss-readback", 1},
      {"dp-grad-reduce-wait", 1},
      {"grad-norm", 1},
      {"optimizer-step", 1},  // the clip factor inside it (no grad-clip pass without fp16)
  };
  std::set<std::string> names, want;
  for (const auto& [n, t] : got) names.insert(n);
  for (const auto& [n, c] : expected_calls) want.insert(n);
  EXPECT_EQ(names, want);
  for (const auto& [n, c] : expected_calls) {
    if (!got.count(n)) continue;
    EXPECT_EQ(got[n].calls, c) << n;
    EXPECT_GE(got[n].ms, 0.0) << n;
  }
  // The work that dominates a step on the CPU is measured as such.
  for (const char* n :
       {"qkv-gemm-forward", "fc1-gemm-forward", "fc2-gemm-backward", "attention-core-forward",
        "attention-core-backward", "lm-head-gemm-forward", "optimizer-step"})
    EXPECT_GT(got[n].ms, 0.0) << n;
  // The phases are disjoint and inside the step: at most its wall time, and most of it (the rest
  // is host bookkeeping between phases).
  const double step_ms = st.seconds * 1e3, sum = pt.total_ms();
  EXPECT_LE(sum, step_ms);
  EXPECT_GT(sum, 0.5 * step_ms) << "phases cover " << sum << " of " << step_ms << " ms";
  // Sorted longest first.
  for (size_t i = 1; i < totals.size(); ++i) EXPECT_GE(totals[i - 1].ms, totals[i].ms);
}

// Mixed precision: the optimizer's pass refreshes the bf16 compute weights (no "weights-cast"
// pass of its own), and after each step they are the master weights rounded, bit for bit.
TEST(PhaseBreakdown, MixedPrecisionRefreshesTheComputeWeightsInTheOptimizerPass) {
  TimerOff off;
  auto be = make_cpu_backend();
  const GPTConfig m = testing_util::small_gpt(32, 4, 16, 60);
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, 5);
  Trainer tr(m, schedule(DType::BF16), *be, *data);
  PhaseTimer::global().enable(make_phase_clock(*be));
  ParamStore& ps = tr.model().params();
  auto compute_bits = [&] {
    std::vector<uint16_t> b(static_cast<size_t>(ps.flat_compute().numel()));
    be->copy_to_host(b.data(), ps.flat_compute());
    return b;
  };
  for (int step = 0; step < 2; ++step) {
    const std::vector<uint16_t> before = compute_bits();
    tr.train_step();
    PhaseTimer::global().collect();
    bool cast = false, optimizer = false;
    for (const PhaseTotal& t : PhaseTimer::global().totals()) {
      cast = cast || t.name == "weights-cast";
      optimizer = optimizer || (t.name == "optimizer-step" && t.calls >= 1);
    }
    EXPECT_FALSE(cast) << "step " << step << ": a weights-cast pass of its own";
    EXPECT_TRUE(optimizer) << "step " << step;
    Tensor want(ps.flat_compute().shape(), DType::BF16);
    be->cast(want, ps.flat_params());
    std::vector<uint16_t> want_bits(before.size());
    be->copy_to_host(want_bits.data(), want);
    const std::vector<uint16_t> got = compute_bits();
    EXPECT_EQ(got, want_bits) << "step " << step << ": not the rounded master weights";
    EXPECT_NE(got, before) << "step " << step << ": the compute copy did not change";
  }
}

TEST(PhaseBreakdown, TimingChangesNoResultBit) {
  TimerOff off;
  auto be = make_cpu_backend();
  const GPTConfig m = testing_util::small_gpt(32, 4, 16, 60);
  auto run = [&](bool timed) {
    auto data = make_mock_dataset(m.vocab_size, m.seq_length, 5);
    Trainer tr(m, schedule(), *be, *data);
    if (timed) PhaseTimer::global().enable(make_phase_clock(*be));
    std::vector<double> losses;
    for (int i = 0; i < 3; ++i) {
      losses.push_back(tr.train_step().loss);
      PhaseTimer::global().collect();
    }
    PhaseTimer::global().disable();
    std::vector<float> p(static_cast<size_t>(tr.model().params().flat_params().numel()));
    be->copy_to_host(p.data(), tr.model().params().flat_params());
    return std::make_pair(losses, p);
  };
  const auto off_run = run(false), on_run = run(true);
  EXPECT_EQ(off_run.first, on_run.first);
  EXPECT_EQ(off_run.second, on_run.second);
  EXPECT_FALSE(PhaseTimer::global().totals().empty());
}
