// test_memory.cpp (mpirun -np 1 and -np 8): the memory features of issue 13 through the whole
// trainer on the process grid (TP 2 x PP 2 x DP 2 at 8 ranks, one rank otherwise), with the 1F1B
// schedule keeping several micro-batches in flight per stage.
//
// Activation recomputation: every iteration's loss and gradient norm, and at the end every
// rank's parameters and gradients, are bitwise those of the run that stores every activation, in
// f32 and bf16, for full (uniform and block) and selective recomputation.
//
// The distributed optimizer: the same losses and gradient norms as the replicated optimizer (to
// fp32 reduction-order rounding, 1e-6 relative) at DP 1, 2 and 4 with TP and PP, in f32 and
// bf16, with and without the overlapped parameter gather; each rank keeps 1/DP of the Adam
// moments (and of the master weights in bf16).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "backend/backend.hpp"
#include "data/dataset.hpp"
#include "runtime/process_grid.hpp"
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

int world_size() {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  return world;
}

class Grid {
 public:
  // TP 2 x PP 2 (x DP 2) at 8 ranks, one rank otherwise; or the given sizes.
  Grid() : Grid(world_size() >= 8 ? 2 : 1, world_size() >= 8 ? 2 : 1) {}
  Grid(int tp, int pp) : grid_(std::make_unique<ProcessGrid>(tp, pp)) {}
  int dp() const { return grid_->layout().dp; }
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

RunResult train(Grid& grid, const TrainConfig& t, const std::function<void(Trainer&)>& check = {}) {
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
  trainer.sync_params();
  ParamStore& ps = trainer.model().params();
  if (ps.has_master()) r.params = bytes_of(ps.flat_params());
  r.grads = bytes_of(ps.flat_grads());
  if (check) check(trainer);
  return r;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], rel * std::fabs(want[i])) << what << ", iteration " << i + 1;
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

TEST(Memory, DistributedOptimizerMatchesTheReplicatedOne) {
  // At 8 ranks: TP2 x PP2 x DP2 and TP2 x PP1 x DP4; at one rank: DP 1.
  std::vector<std::pair<int, int>> layouts = {{1, 1}};
  if (world_size() == 8) layouts = {{2, 2}, {2, 1}};
  for (auto [tp, pp] : layouts) {
    Grid grid(tp, pp);
    for (DType dt : {DType::F32, DType::BF16}) {
      TrainConfig base = schedule(dt);
      base.train_iters = 4;
      base.ddp_bucket_size = 3000;  // several buckets, most of them padded
      const RunResult ref = train(grid, base);
      for (int variant = 0; variant < 3; ++variant) {
        TrainConfig t = base;
        t.use_distributed_optimizer = true;
        t.overlap_param_gather = variant == 1;
        t.overlap_grad_reduce = variant != 2;
        const std::string what = detail::concat("TP ", tp, " PP ", pp, " DP ", grid.dp(), " ",
                                                dtype_name(dt), " variant ", variant);
        const RunResult got = train(grid, t, [&](Trainer& tr) {
          DistributedAdamW* opt = tr.distributed_optimizer();
          ASSERT_NE(opt, nullptr);
          ParamStore& ps = tr.model().params();
          EXPECT_EQ(opt->shard_numel() * grid.dp(), ps.numel()) << what;
          EXPECT_EQ(ps.has_master(), dt == DType::F32) << what;  // bf16: master in the blocks
          EXPECT_EQ(opt->owns_master(), dt != DType::F32) << what;
          EXPECT_EQ(tr.optimizer_steps(), 4);
        });
        expect_close(got.losses, ref.losses, 1e-6, what + " loss");
        expect_close(got.norms, ref.norms, 1e-6, what + " grad norm");
      }
    }
  }
}
