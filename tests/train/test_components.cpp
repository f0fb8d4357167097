// test_components.cpp: the training side's components on their own: a figure declared once
// reaches the log line and the metrics file, "one rank tries, every rank agrees", and the
// optimizer set's step returns Megatron's (update, gradient norm, zeros) figures, checked against
// the gradient itself.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "backend/backend.hpp"
#include "data/dataset.hpp"
#include "train/metrics.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;

TEST(FigureSink, OneDeclarationFeedsTheLineAndTheMetricsFile) {
  const Figure both{"params norm", "%.3f", "params_norm", "%.17g"};
  const Figure percent{"MFU", "%.1f%%"};
  const Figure fraction{nullptr, nullptr, "mfu", "%.6f"};
  const Figure line_only{"loss scale", "%.1f"};
  std::string line = " iteration 1", json = "{\"iteration\": 1";
  FigureSink at_log(&line, &json, nullptr, 1);
  at_log.add(both, 1.25);
  at_log.add(percent, 43.21);
  at_log.add(fraction, 0.4321);
  at_log.add(line_only, 65536);
  EXPECT_EQ(line, " iteration 1 | params norm: 1.250 | MFU: 43.2% | loss scale: 65536.0");
  EXPECT_EQ(json, "{\"iteration\": 1, \"params_norm\": 1.25, \"mfu\": 0.432100");
  // At a step only TensorBoard's every-step figures are written: the line stays as it is.
  FigureSink at_step(nullptr, 1);
  at_step.add(both, 2.0);
  EXPECT_EQ(line, " iteration 1 | params norm: 1.250 | MFU: 43.2% | loss scale: 65536.0");
}

TEST(OneRankTries, SuccessFailureAndAnEmptyMessage) {
  LocalCommunicator comm;
  int ran = 0;
  EXPECT_EQ(one_rank_tries(
                comm, 0, [&] { ++ran; }, "elsewhere"),
            "");
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(one_rank_tries(
                comm, 0, [] { throw ConfigError("--save '/x' is not writable"); }, "elsewhere"),
            "--save '/x' is not writable");
  EXPECT_EQ(one_rank_tries(
                comm, 0, [] { throw std::runtime_error(""); }, "failed on rank 0"),
            "failed on rank 0");
}

namespace {
// Sum of squares and zeros of the model's whole gradient, read directly (one rank: every
// parameter counted once).
void gradient_figures(Trainer& tr, double& norm, double& zeros) {
  const Tensor& g = tr.model().params().flat_grads();
  norm = 0;
  zeros = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    const double v = g.f32()[i];
    norm += v * v;
    zeros += v == 0;
  }
  norm = std::sqrt(norm);
}
}  // namespace

TEST(OptimizerSet, StepReturnsTheGradientNormAndZerosOfTheGradient) {
  const GPTConfig m = testing_util::small_gpt(32, 4, 32, 64);
  TrainConfig t = testing_util::tiny_schedule();
  t.clip_grad = 0;  // the gradient stays as the backward left it
  t.log_num_zeros_in_grad = true;
  t.train_iters = 3;
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
  Trainer tr(m, t, *be, *data);
  for (int i = 0; i < 3; ++i) {
    const StepStats s = tr.train_step();
    double norm = 0, zeros = 0;
    gradient_figures(tr, norm, zeros);
    ASSERT_GT(norm, 0);
    EXPECT_FALSE(s.skipped);
    EXPECT_NEAR(s.grad_norm, norm, 1e-9 * norm) << "iteration " << s.iteration;
    EXPECT_EQ(s.num_zeros, zeros) << "iteration " << s.iteration;
    // The padded vocabulary's rows of the embedding never get a gradient.
    EXPECT_GE(s.num_zeros, double(m.padded_vocab_size(1) - m.vocab_size) * m.hidden_size);
    EXPECT_EQ(tr.optimizer_steps(), i + 1);
  }
}

TEST(TrainingMetrics, TheMetricsFileCarriesEachSourcesFigureInOrder) {
  const GPTConfig m = testing_util::small_gpt(32, 4, 32, 64);
  TrainConfig t = testing_util::tiny_schedule();
  t.train_iters = 2;
  t.log_interval = 1;
  t.log_params_norm = true;
  t.log_num_zeros_in_grad = true;
  t.peak_tflops = 1;
  const std::string path =
      (std::filesystem::temp_directory_path() / "tessera_test_components.jsonl").string();
  std::filesystem::remove(path);
  t.metrics_file = path;
  std::vector<StepStats> steps;
  {
    auto be = make_cpu_backend();
    auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
    Trainer tr(m, t, *be, *data);
    steps = tr.train();
  }
  std::ifstream in(path);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ASSERT_LT(n, 2);
    const size_t mfu = line.find("\"mfu\": "), pn = line.find("\"params_norm\": "),
                 nz = line.find("\"num_zeros_in_grad\": ");
    ASSERT_NE(mfu, std::string::npos) << line;
    ASSERT_NE(pn, std::string::npos) << line;
    ASSERT_NE(nz, std::string::npos) << line;
    EXPECT_LT(mfu, pn);
    EXPECT_LT(pn, nz);
    EXPECT_GT(std::stod(line.substr(pn + 15)), 0.0);
    EXPECT_EQ(std::stod(line.substr(nz + 21)), steps[n].num_zeros);
    // The loss of a one-step interval is the step's, to the last digit.
    const size_t loss = line.find("\"lm_loss\": ");
    EXPECT_EQ(std::stod(line.substr(loss + 11)), steps[n].loss);
    ++n;
  }
  EXPECT_EQ(n, 2);
  std::filesystem::remove(path);
}
