// test_memory.cpp (mpirun -np 1 and -np 8): the memory features of issue 13 through the whole
// trainer on the process grid (TP 2 x PP 2 x DP 2 at 8 ranks, one rank otherwise), with the 1F1B
// schedule keeping several micro-batches in flight per stage.
//
// Activation recomputation: every iteration's loss and gradient norm, and at the end every
// rank's parameters and gradients, are bitwise those of the run that stores every activation, in
// f32 and bf16, for full (uniform and block) and selective recomputation.
#include <gtest/gtest.h>

#include <cstring>

#include "backend/backend.hpp"
#include "comm/process_grid.hpp"
#include "data/dataset.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {

struct RunResult {
  std::vector<double> losses, norms;
  std::vector<char> params, grads;  // this rank's flat f32 buffers, as bytes
};

std::vector<char> bytes_of(const Tensor& t) {
  const char* p = static_cast<const char*>(t.raw());
  return std::vector<char>(p, p + t.nbytes());
}

class Grid {
 public:
  Grid() {
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int tp = world >= 8 ? 2 : 1, pp = world >= 4 ? 2 : 1;
    grid_ = std::make_unique<ProcessGrid>(tp, pp);
  }
  ParallelContext context() { return grid_->context(); }

 private:
  std::unique_ptr<ProcessGrid> grid_;
};

GPTConfig model() {
  GPTConfig c;
  c.num_layers = 4;  // 2 per stage at PP 2
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.seq_length = 16;
  c.vocab_size = 200;
  c.make_vocab_size_divisible_by = 64;
  return c;
}

TrainConfig schedule(DType dt) {
  TrainConfig t;
  t.micro_batch_size = 1;
  t.global_batch_size = 8;  // 4 micro-batches per DP rank at DP 2
  t.train_iters = 3;
  t.lr = 3e-3;
  t.lr_warmup_iters = 1;
  t.log_interval = 1000;
  t.compute_dtype = dt;
  return t;
}

RunResult train(Grid& grid, const TrainConfig& t) {
  auto be = make_cpu_backend();
  const GPTConfig m = model();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, 7);
  Trainer trainer(m, t, *be, *data, grid.context());
  RunResult r;
  for (int i = 0; i < t.train_iters; ++i) {
    const StepStats s = trainer.train_step();
    r.losses.push_back(s.loss);
    r.norms.push_back(s.grad_norm);
  }
  r.params = bytes_of(trainer.model().params().flat_params());
  r.grads = bytes_of(trainer.model().params().flat_grads());
  return r;
}

RecomputeConfig recompute(RecomputeGranularity g, RecomputeMethod m = RecomputeMethod::Uniform,
                          int n = 1) {
  RecomputeConfig rc;
  rc.granularity = g;
  rc.method = m;
  rc.num_layers = n;
  return rc;
}

}  // namespace

TEST(Memory, RecomputationIsBitwiseTheStoredRun) {
  Grid grid;
  for (DType dt : {DType::F32, DType::BF16}) {
    const RunResult ref = train(grid, schedule(dt));
    ASSERT_GT(ref.losses[0], 4.0);
    ASSERT_LT(ref.losses[2], ref.losses[0]);  // it trains
    for (const RecomputeConfig& rc :
         {recompute(RecomputeGranularity::Full),
          recompute(RecomputeGranularity::Full, RecomputeMethod::Uniform, 2),
          recompute(RecomputeGranularity::Full, RecomputeMethod::Block, 1),
          recompute(RecomputeGranularity::Selective)}) {
      TrainConfig t = schedule(dt);
      t.recompute = rc;
      const RunResult got = train(grid, t);
      const std::string what = std::string(dtype_name(dt)) + ", " + rc.describe();
      for (size_t i = 0; i < ref.losses.size(); ++i) {
        EXPECT_EQ(got.losses[i], ref.losses[i]) << what << ", iteration " << i + 1;
        EXPECT_EQ(got.norms[i], ref.norms[i]) << what << ", iteration " << i + 1;
      }
      ASSERT_EQ(got.params.size(), ref.params.size());
      EXPECT_EQ(std::memcmp(got.params.data(), ref.params.data(), ref.params.size()), 0) << what;
      EXPECT_EQ(std::memcmp(got.grads.data(), ref.grads.data(), ref.grads.size()), 0) << what;
    }
  }
}
