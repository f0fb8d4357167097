// test_device_staging.cpp: the trainer, checkpoints and generation reach backend memory only
// through the backend (DESIGN.md: the CPU backend is the reference, a device backend must give the
// same model). Runs everything on the simulated device of tests/backend/sim_device_backend.hpp,
// whose memory is unreadable from the host outside backend calls, and compares with the CPU run.
#include <gtest/gtest.h>

#include <functional>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "backend/sim_device_backend.hpp"
#include "comm/communicator.hpp"
#include "core/dtype.hpp"
#include "data/dataset.hpp"
#include "inference/engine.hpp"
#include "inference/generator.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;
namespace fs = std::filesystem;

namespace {
GPTConfig tiny_model() {
  return testing_util::small_gpt(32, 4, 16, 60);  // padded to 128: padding stays out of the loss
}
TrainConfig tiny_train(const std::string& save) {
  TrainConfig t;
  t.micro_batch_size = 2;
  t.global_batch_size = 4;  // two micro-batches: gradient accumulation in backend memory
  t.train_iters = 4;
  t.lr = 1e-2;
  t.lr_warmup_iters = 1;
  t.lr_decay_iters = 10;  // the same schedule for runs of different lengths
  t.log_interval = 1000;
  t.save = save;
  return t;
}
std::string temp_dir(const char* name) {
  const fs::path p = fs::temp_directory_path() /
                     (std::string("tessera_staging_") + name + "_" + std::to_string(getpid()));
  fs::remove_all(p);
  return p.string();
}
struct RunResult {
  std::vector<double> losses, norms;
  std::vector<float> params;
};
RunResult train(Backend& be, const std::string& save, int64_t iters, const std::string& load = "",
                DType dtype = DType::F32, const std::function<void(TrainConfig&)>& options = {}) {
  const GPTConfig m = tiny_model();
  TrainConfig t = tiny_train(save);
  t.train_iters = iters;
  t.compute_dtype = dtype;
  if (options) options(t);
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
  Trainer tr(m, t, be, *data);
  if (!load.empty()) tr.load_checkpoint(load);
  RunResult r;
  for (const StepStats& s : tr.train()) {
    r.losses.push_back(s.loss);
    r.norms.push_back(s.grad_norm);
  }
  if (!tr.model().params().has_master()) return r;  // the distributed optimizer holds them
  Tensor& flat = tr.model().params().flat_params();
  r.params.resize(static_cast<size_t>(flat.numel()));
  be.copy_to_host(r.params.data(), flat);
  return r;
}
}  // namespace

TEST(SimDevice, HostAccessOutsideTheBackendCrashes) {
  // The guard this file relies on: reading sim-device memory from the host is fatal.
  auto be = simdev::make_sim_device_backend();
  Tensor t({1024}, DType::F32, be->allocator());
  be->zero(t);
  std::vector<float> h(1024, 1.f);
  be->copy_to_host(h.data(), t);
  EXPECT_EQ(h[17], 0.f);
  EXPECT_DEATH(
      {
        volatile float x = t.f32()[17];
        (void)x;
      },
      "");
}

TEST(SimDevice, TrainingEqualsTheCpuBackendBitwise) {
  auto cpu = make_cpu_backend();
  auto sim = simdev::make_sim_device_backend();
  const std::string dc = temp_dir("cpu"), ds = temp_dir("sim");
  const RunResult a = train(*cpu, dc, 4), b = train(*sim, ds, 4);
  ASSERT_EQ(a.losses.size(), 4u);
  EXPECT_NEAR(a.losses[0], std::log(60.0), 0.2);
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "iteration " << i + 1;
    EXPECT_EQ(a.norms[i], b.norms[i]) << "iteration " << i + 1;
  }
  EXPECT_EQ(a.params, b.params);
  // The checkpoints (written from host staging on the device path) hold the same state: resuming
  // either on the sim device continues exactly like the CPU run that never stopped.
  const RunResult cont_cpu = train(*cpu, temp_dir("cpu6"), 6);
  const RunResult resumed = train(*sim, temp_dir("sim_resumed"), 6, ds);
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[0], cont_cpu.losses[4]);
  EXPECT_EQ(resumed.losses[1], cont_cpu.losses[5]);
  EXPECT_EQ(resumed.params, cont_cpu.params);
  for (const std::string& d : {dc, ds}) fs::remove_all(d);
}

TEST(SimDevice, MixedPrecisionEqualsTheCpuBackendBitwise) {
  // bf16 and fp16: the compute copy of the weights, its refresh after each update and after a
  // load, and (fp16) the loss scale all live in backend memory.
  auto cpu = make_cpu_backend();
  auto sim = simdev::make_sim_device_backend();
  for (DType d : {DType::BF16, DType::F16}) {
    const std::string dc = temp_dir("cpu_mp"), ds = temp_dir("sim_mp");
    const RunResult a = train(*cpu, dc, 4, "", d), b = train(*sim, ds, 4, "", d);
    EXPECT_EQ(a.losses, b.losses) << dtype_name(d);
    EXPECT_EQ(a.params, b.params) << dtype_name(d);
    const RunResult cont = train(*cpu, temp_dir("cpu_mp6"), 6, "", d);
    const RunResult resumed = train(*sim, temp_dir("sim_mp6"), 6, ds, d);
    ASSERT_EQ(resumed.losses.size(), 2u);
    EXPECT_EQ(resumed.losses[1], cont.losses[5]) << dtype_name(d);
    EXPECT_EQ(resumed.params, cont.params) << dtype_name(d);
    for (const std::string& dir : {dc, ds}) fs::remove_all(dir);
  }
}

TEST(SimDevice, RecomputeAndDistributedOptimizerEqualTheCpuBackendBitwise) {
  // Issue 13's paths in backend memory: the recompute working set, the optimizer's blocks (master
  // weights and moments set from host values, gathered to the host for a checkpoint) and the
  // parameter gather into the compute copy.
  auto cpu = make_cpu_backend();
  auto sim = simdev::make_sim_device_backend();
  for (DType d : {DType::F32, DType::BF16}) {
    auto opts = [](TrainConfig& t) {
      t.use_distributed_optimizer = true;
      t.overlap_param_gather = true;
      t.ddp_bucket_size = 3000;
      t.recompute.granularity = RecomputeGranularity::Selective;
    };
    const std::string dc = temp_dir("cpu_mem"), ds = temp_dir("sim_mem");
    const RunResult a = train(*cpu, dc, 4, "", d, opts), b = train(*sim, ds, 4, "", d, opts);
    ASSERT_EQ(a.losses.size(), 4u);
    EXPECT_EQ(a.losses, b.losses) << dtype_name(d);
    EXPECT_EQ(a.norms, b.norms) << dtype_name(d);
    EXPECT_EQ(a.params, b.params) << dtype_name(d);
    const RunResult cont = train(*cpu, temp_dir("cpu_mem6"), 6, "", d, opts);
    const RunResult resumed = train(*sim, temp_dir("sim_mem6"), 6, ds, d, [](TrainConfig& t) {
      t.use_distributed_optimizer = true;
      t.recompute.granularity = RecomputeGranularity::Full;
      t.ddp_bucket_size = 3000;
    });
    ASSERT_EQ(resumed.losses.size(), 2u);
    EXPECT_EQ(resumed.losses[0], cont.losses[4]) << dtype_name(d);
    EXPECT_EQ(resumed.losses[1], cont.losses[5]) << dtype_name(d);
    for (const std::string& dir : {dc, ds}) fs::remove_all(dir);
  }
}

TEST(SimDevice, Bf16HeadReadsOnlyWrittenMemory) {
  // What compute-sanitizer's initcheck asked about the bf16 LM head (docs/testing.md): fresh sim
  // allocations are all ones (NaN in bf16), so any logit the cross-entropy reads that the head
  // GEMM did not write, or a padded vocabulary row of the bf16 weight copy left uncast, would
  // surface here as a NaN. The vocabulary (60) is padded to 128 and each micro-batch row counts.
  auto sim = simdev::make_sim_device_backend();
  const GPTConfig cfg = tiny_model();
  LocalCommunicator tp;
  ModelShard whole;
  whole.chunks = {{0, cfg.num_layers}};
  GPTModel model(cfg, whole, *sim, tp, DType::BF16);
  model.init_parameters(3);
  const int B = 2, T = cfg.seq_length, N = B * T;
  const int64_t V = model.padded_vocab(), valid = cfg.vocab_size;
  ASSERT_GT(V, valid);
  std::vector<uint16_t> wte(static_cast<size_t>(V * cfg.hidden_size));
  sim->copy_to_host(wte.data(), model.params().compute_param("wte"));
  for (int64_t i = valid * cfg.hidden_size; i < V * cfg.hidden_size; ++i)
    ASSERT_EQ(wte[static_cast<size_t>(i)], 0) << "padded wte row " << i / cfg.hidden_size;
  for (int64_t i = 0; i < valid * cfg.hidden_size; ++i)
    ASSERT_TRUE(std::isfinite(bf16_to_f32(wte[static_cast<size_t>(i)])));

  Activations a = model.make_activations(B, T);  // poisoned
  std::vector<int32_t> ids(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  for (int i = 0; i < N; ++i) {
    ids[static_cast<size_t>(i)] = (7 * i + 3) % valid;
    targets[static_cast<size_t>(i)] = i == 5 ? -1 : (11 * i + 1) % valid;  // one without loss
  }
  sim->copy_from_host(a.ids, ids.data());
  sim->copy_from_host(a.targets, targets.data());
  const double loss = model.forward(a, 1.0f) / (N - 1);
  EXPECT_NEAR(loss, std::log(double(valid)), 0.5);  // finite, and near uniform at init
  std::vector<float> rowmax(static_cast<size_t>(N)), sumexp(static_cast<size_t>(N));
  sim->copy_to_host(rowmax.data(), a.rowmax);
  sim->copy_to_host(sumexp.data(), a.sumexp);
  std::vector<uint16_t> dlogits(static_cast<size_t>(N * V));
  sim->copy_to_host(dlogits.data(), a.logits);
  for (int n = 0; n < N; ++n) {
    ASSERT_TRUE(std::isfinite(rowmax[n]) && std::isfinite(sumexp[n]) && sumexp[n] >= 1.f) << n;
    double row = 0;
    for (int64_t j = 0; j < V; ++j) {
      const float g = bf16_to_f32(dlogits[static_cast<size_t>(n * V + j)]);
      ASSERT_TRUE(std::isfinite(g)) << "dlogits[" << n << ", " << j << "]";
      if (j >= valid || n == 5) {
        ASSERT_EQ(g, 0.f) << "dlogits[" << n << ", " << j << "]";
      }
      row += g;
    }
    EXPECT_NEAR(row, 0.0, 2e-2) << "softmax - one-hot sums to 0, row " << n;
  }
}

TEST(SimDevice, EvaluationAndGenerationEqualTheCpuBackend) {
  auto cpu = make_cpu_backend();
  auto sim = simdev::make_sim_device_backend();
  const GPTConfig m = tiny_model();
  TrainConfig t = tiny_train("");
  t.train_iters = 3;
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
  Trainer tc(m, t, *cpu, *data), ts(m, t, *sim, *data);
  tc.train();
  ts.train();
  EXPECT_EQ(tc.evaluate(*data, 100, 2), ts.evaluate(*data, 100, 2));

  const ParallelContext ctx = ParallelContext::single();
  InferenceEngine ec(tc.model(), ctx, 3, m.seq_length), es(ts.model(), ctx, 3, m.seq_length);
  GenerationOptions g;
  g.max_new_tokens = 6;
  g.sampling.temperature = 0.8;
  g.sampling.seed = 7;
  const std::vector<std::vector<int32_t>> prompts{{1, 2, 3}, {5}, {9, 8, 7, 6, 5}};
  const GenerationResult rc = generate(ec, ctx, prompts, g), rs = generate(es, ctx, prompts, g);
  ASSERT_EQ(rc.completions.size(), 3u);
  EXPECT_EQ(rc.completions, rs.completions);
  EXPECT_EQ(rc.generated_tokens, 18);
}

// ---- device selection (DESIGN.md invariant 1) ---------------------------------------------------

#include "options/options.hpp"
#include "runtime/select.hpp"

TEST(DeviceSelection, EachLocalRankTakesItsOwnGpu) {
  for (int r = 0; r < 8; ++r) EXPECT_EQ(choose_gpu(r, 8, 8, "node1"), r);
  EXPECT_EQ(choose_gpu(1, 2, 4, "node1"), 1);  // fewer ranks than GPUs: the first ones
  EXPECT_EQ(choose_gpu(3, 4, 1, "node1"), 0);  // srun --gpus-per-task=1: each sees its own
}

TEST(DeviceSelection, TwoRanksOnOneGpuAreRefused) {
  EXPECT_NO_THROW(check_distinct_gpus({"0000:1B:00.0", "0000:1C:00.0", "0000:9A:00.0"}, "n"));
  EXPECT_NO_THROW(check_distinct_gpus({"", ""}, "n"));  // CPU ranks
  try {
    check_distinct_gpus({"0000:1B:00.0", "0000:1C:00.0", "0000:1B:00.0"}, "node3");
    FAIL() << "a shared GPU accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("local ranks 0 and 2 on node3 would share the GPU at PCI 0000:1B:00.0"),
              std::string::npos)
        << m;
  }
}

// --ranks-per-gpu N (issue 56: several ranks on the one lent GPU, through NCCL): local rank r
// takes GPU r % gpus, at most N ranks a GPU, and ranks that share one must report different NCCL
// hosts (NCCL_HOSTID), or NCCL would refuse them.
TEST(DeviceSelection, RanksPerGpuSharesAGpuWithItsOwnNcclHost) {
  EXPECT_EQ(choose_gpu(3, 4, 2, "n", 2), 1);
  EXPECT_EQ(choose_gpu(2, 4, 2, "n", 2), 0);
  EXPECT_THROW(choose_gpu(0, 5, 2, "n", 2), ConfigError);  // 5 ranks, 2 GPUs x 2
  const std::vector<std::string> one(3, "0000:1B:00.0");
  EXPECT_NO_THROW(check_distinct_gpus(one, "n", 3, {"r0", "r1", "r2"}));
  try {
    check_distinct_gpus(one, "node3", 2, {"r0", "r1", "r2"});
    FAIL() << "three ranks on a GPU under --ranks-per-gpu 2";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("3 local ranks on node3 (0, ..., 2) would share the GPU "
                                         "at PCI 0000:1B:00.0; --ranks-per-gpu 2 allows 2"),
              std::string::npos)
        << e.what();
  }
  try {
    check_distinct_gpus({"0000:1B:00.0", "0000:1B:00.0"}, "node3", 2, {"", ""});
    FAIL() << "two ranks of one NCCL host on one GPU";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("local ranks 0 and 1 on node3 share the GPU at PCI 0000:1B:00.0 with the "
                     "same NCCL host (NCCL_HOSTID unset)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("scripts/nccl-share-gpu.sh"), std::string::npos) << m;
  }
}

TEST(DeviceSelection, MoreRanksThanGpusIsAnErrorNamingTheHost) {
  try {
    choose_gpu(0, 8, 4, "node7");
    FAIL() << "8 ranks on 4 GPUs accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("8 ranks share node7, which has 4 visible GPUs"), std::string::npos) << m;
    EXPECT_NE(m.find("--ntasks-per-node=4"), std::string::npos) << m;
  }
  EXPECT_THROW(choose_gpu(0, 1, 0, "node7"), ConfigError);
}

TEST(DeviceSelection, DeviceOptionValues) {
  EXPECT_EQ(resolve_device("cpu", "h"), "cpu");
  EXPECT_THROW(resolve_device("tpu", "h"), ConfigError);
  const std::string a = resolve_device("auto", "h");
  EXPECT_EQ(a, visible_gpus() > 0 && cuda_built() ? "cuda" : "cpu");
  if (visible_gpus() == 0) {
    try {
      resolve_device("cuda", "nodeX");
      FAIL() << "--device cuda accepted without a GPU";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(cuda_built() ? "no CUDA device is visible on nodeX" : "no CUDA backend"),
                std::string::npos)
          << m;
    }
  }
}

TEST(DeviceSelection, ProfileRankLists) {
  EXPECT_EQ(parse_rank_list("0", "--profile-ranks"), std::vector<int>{0});
  EXPECT_EQ(parse_rank_list("0,8,16", "--profile-ranks"), (std::vector<int>{0, 8, 16}));
  EXPECT_TRUE(parse_rank_list("all", "--profile-ranks").empty());
  EXPECT_THROW(parse_rank_list("0,x", "--profile-ranks"), ConfigError);
  EXPECT_THROW(parse_rank_list("-1", "--profile-ranks"), ConfigError);
  EXPECT_THROW(parse_rank_list("", "--profile-ranks"), ConfigError);
}
