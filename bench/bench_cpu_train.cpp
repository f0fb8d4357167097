// bench_cpu_train: tokens/s and achieved GFLOP/s of a CPU training step of GPT-2-small-shaped
// layers (hidden 768, 12 heads, seq 1024, vocab 50257), next to the sgemm GFLOP/s of this machine
// measured in the same run. Target: the step reaches >= 50% of the sgemm rate. Usage:
// bench_cpu_train [layers=2] [steps=3] [micro_batch=1] [seq=1024]
#include <cblas.h>
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/backend.hpp"
#include "core/timer.hpp"
#include "data/dataset.hpp"
#include "options/options.hpp"
#include "train/rank_setup.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {
// Best-of sgemm rate on the shapes a GPT-2-small step runs (tokens x 768 -> 3072 and back).
double sgemm_gflops(int64_t tokens) {
  const int64_t M = tokens, N = 3072, K = 768;
  std::vector<float> a(M * K, 0.5f), b(N * K, 0.25f), c(M * N);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    Timer t;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.f, a.data(), K, b.data(), K,
                0.f, c.data(), N);
    const double s = t.seconds();
    best = std::max(best, 2.0 * M * N * K / s / 1e9);
  }
  return best;
}
}  // namespace

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 2;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 3;
  const int mbs = argc > 3 ? std::atoi(argv[3]) : 1;
  const int seq = argc > 4 ? std::atoi(argv[4]) : 1024;
  const int threads = affinity_cores();
  set_num_threads(threads);

  GPTConfig m;
  m.num_layers = layers;
  m.hidden_size = 768;
  m.num_attention_heads = 12;
  m.seq_length = seq;
  m.max_position_embeddings = 1024 > seq ? 1024 : seq;
  m.vocab_size = 50257;
  TrainConfig t;
  t.micro_batch_size = mbs;
  t.global_batch_size = mbs;
  t.train_iters = steps + 1;
  t.lr = 1e-4;
  t.log_interval = 1000000;
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, 1);
  Trainer trainer(m, t, *be, *data);
  trainer.train_step();  // warm-up: first touch of every buffer
  double best = 1e30;
  for (int i = 0; i < steps; ++i) best = std::min(best, trainer.train_step().seconds);

  const double tokens = double(mbs) * seq;
  const double flops = m.train_flops_per_token() * tokens;
  const double gflops = flops / best / 1e9;
  const double peak = sgemm_gflops(static_cast<int64_t>(tokens));
  std::printf("bench_cpu_train: GPT-2-small-shaped layers on CPU, %d threads\n", threads);
  std::printf(
      "FLOPs counted (Megatron): per token 6*(12*L*h^2 + V*h) + 12*L*s*h = %.4g; full "
      "attention counted, causal half not subtracted\n",
      m.train_flops_per_token());
  std::printf("%-34s %14s\n", "figure", "value");
  std::printf("%-34s %14d\n", "layers", layers);
  std::printf("%-34s %14s\n", "micro-batch x seq",
              (std::to_string(mbs) + " x " + std::to_string(seq)).c_str());
  std::printf("%-34s %14.1f\n", "step time (ms, best)", best * 1e3);
  std::printf("%-34s %14.0f\n", "tokens/s", tokens / best);
  std::printf("%-34s %14.2f\n", "achieved GFLOP/s (train step)", gflops);
  std::printf("%-34s %14.2f\n", "sgemm GFLOP/s (same machine, run)", peak);
  std::printf("%-34s %13.1f%%\n", "step / sgemm (target >= 50%)", 100.0 * gflops / peak);
  return 0;
}
