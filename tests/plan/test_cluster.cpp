// test_cluster.cpp: cluster files (plan/cluster.hpp) and what --dry-run checks against them
// (options/planning.cpp): --world-size, the memory verdict and the changes it proposes;
// the MoE expert-side buffers a capacity bounds (GPTConfig::moe_received_rows).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "comm/grid_layout.hpp"
#include "core/error.hpp"
#include "options/options.hpp"
#include "plan/cluster.hpp"

using namespace tessera;

namespace {

const std::string kClusters = std::string(TESSERA_SOURCE_DIR) + "/configs/clusters/";

std::string write_file(const std::string& text) {
  char name[] = "/tmp/tessera_cluster_XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(name) << text;
  const std::string ini = std::string(name) + ".ini";
  std::rename(name, ini.c_str());
  return ini;
}

std::string error_of(const std::string& name_or_file) {
  try {
    load_cluster(name_or_file);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

RunOptions parsed(std::vector<std::string> args) {
  args.insert(args.begin(), "tessera-train");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  RunOptions o;
  EXPECT_TRUE(parse_run_options(static_cast<int>(argv.size()), argv.data(), o));
  return o;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The figure after `key` in `text` (the verdict's GiB).
double figure_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  EXPECT_NE(at, std::string::npos) << key << " not in: " << text;
  return at == std::string::npos ? -1 : std::atof(text.c_str() + at + key.size());
}

}  // namespace

TEST(Cluster, ShippedKindsLoadWithTheirDatasheetFigures) {
  const ClusterSpec h100 = load_cluster(kClusters + "dgx-h100.ini");
  EXPECT_EQ(h100.name, "dgx-h100");
  EXPECT_EQ(h100.gpu, "NVIDIA H100 SXM5 80GB");
  EXPECT_DOUBLE_EQ(h100.gpu_memory_gib, 79.65);  // 81,559 MiB
  EXPECT_DOUBLE_EQ(h100.bf16_tflops, 989.4);
  EXPECT_DOUBLE_EQ(h100.fp8_tflops, 1978.9);
  EXPECT_DOUBLE_EQ(h100.hbm_tbs, 3.35);
  EXPECT_EQ(h100.gpus_per_node, 8);
  EXPECT_DOUBLE_EQ(h100.intra_node.bandwidth_gbs, 450);  // NVLink 4: 900 GB/s both ways
  EXPECT_TRUE(h100.intra_node.sharp);
  EXPECT_DOUBLE_EQ(h100.inter_node.bandwidth_gbs, 50);  // 400 Gb/s NDR per GPU
  const ClusterSpec a100 = load_cluster(kClusters + "dgx-a100.ini");
  EXPECT_DOUBLE_EQ(a100.bf16_tflops, 312);
  EXPECT_DOUBLE_EQ(a100.fp8_tflops, 0);  // Ampere has no FP8
  EXPECT_FALSE(a100.intra_node.sharp);
  EXPECT_DOUBLE_EQ(a100.inter_node.bandwidth_gbs, 25);  // 200 Gb/s HDR per GPU
  const ClusterSpec h200 = load_cluster(kClusters + "dgx-h200.ini");
  EXPECT_DOUBLE_EQ(h200.gpu_memory_gib, 140.40);  // 143,771 MiB, measured on the lent H200
  EXPECT_DOUBLE_EQ(h200.hbm_tbs, 4.8);
  EXPECT_NE(describe_cluster(h200).find("dgx-h200: 8 x NVIDIA H200 SXM 141GB (140.4 GiB"),
            std::string::npos)
      << describe_cluster(h200);
}

TEST(Cluster, BadFilesAreOneLineErrorsNamingTheFile) {
  const std::string good =
      "description = x\n[gpu]\nmodel = G\nmemory-gib = 80\nhbm-tbs = 2\nbf16-tflops = 300\n"
      "fp8-tflops = 0\n[node]\ngpus = 8\n[intra-node]\nfabric = N\nbandwidth-gbs = 300\n"
      "latency-us = 3\n[inter-node]\nfabric = I\nbandwidth-gbs = 25\nlatency-us = 9\n";
  EXPECT_EQ(error_of(write_file(good)), "");
  std::string f = write_file(good + "[gpu]\ntflops = 3\n");
  std::string e = error_of(f);
  EXPECT_NE(e.find("cluster file '" + f + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("gpu.tflops"), std::string::npos) << e;
  f = write_file(good.substr(0, good.find("[inter-node]")));
  e = error_of(f);
  EXPECT_NE(e.find("the option 'inter-node."), std::string::npos) << e;
  EXPECT_NE(e.find("is required but missing"), std::string::npos) << e;
  std::string zero = good;
  zero.replace(zero.find("memory-gib = 80"), 15, "memory-gib = 0");
  f = write_file(zero);
  e = error_of(f);
  EXPECT_NE(e.find("[gpu] memory-gib = 0"), std::string::npos) << e;
  e = error_of("dgx-b300");
  EXPECT_NE(e.find("no such cluster kind"), std::string::npos) << e;
  EXPECT_NE(e.find("dgx-a100, dgx-h100, dgx-h200"), std::string::npos) << e;
  e = error_of("/nonexistent/cluster.ini");
  EXPECT_NE(e.find("'/nonexistent/cluster.ini' cannot be read"), std::string::npos) << e;
  for (const std::string& err : {e}) EXPECT_EQ(err.find('\n'), std::string::npos) << err;
}

// The verdict is the estimate's: fits when the fullest rank's estimate plus the reserve is within
// the GPU's memory; otherwise each change that fits, with the estimate under that change.
TEST(Cluster, DryRunVerdictIsTheEstimateAgainstTheGpu) {
  // A 1.3B-shaped GPT at a large micro-batch on one A100 80 GB: too big unless recomputed.
  const std::vector<std::string> model = {"--num-layers",
                                          "24",
                                          "--hidden-size",
                                          "2048",
                                          "--num-attention-heads",
                                          "16",
                                          "--seq-length",
                                          "2048",
                                          "--max-position-embeddings",
                                          "2048",
                                          "--vocab-size",
                                          "50257",
                                          "--bf16",
                                          "--micro-batch-size",
                                          "32",
                                          "--global-batch-size",
                                          "256",
                                          "--dry-run",
                                          "--cluster",
                                          "dgx-a100",
                                          "--world-size",
                                          "8"};
  RunOptions o = parsed(model);
  ASSERT_TRUE(o.cluster_spec);
  const GridLayout layout = GridLayout::make(8, 1, 1, 1);
  const double need = estimate_rank_memory(o.model, o.train, layout, 0).total_bytes();
  TrainConfig full = o.train;
  full.recompute = recompute_options("full", "uniform", 1, false, 0);
  const double need_full = estimate_rank_memory(o.model, full, layout, 0).total_bytes();
  ASSERT_GT(need + kRuntimeReserveGiB * kGiB, 80.0 * kGiB);  // the case is what it says
  ASSERT_LT(need_full + kRuntimeReserveGiB * kGiB, 80.0 * kGiB);
  std::string r = dry_run_report(o, 1);
  EXPECT_NE(r.find("layout: world 8 = TP 1 x PP 1 x DP 8;"), std::string::npos) << r;
  EXPECT_NE(r.find("memory verdict: does not fit dgx-a100's NVIDIA A100 SXM4 80GB (80.0 GiB)"),
            std::string::npos)
      << r;
  EXPECT_NEAR(figure_after(r, "the fullest rank (stage 0) needs "), need / kGiB, 0.05);
  EXPECT_NEAR(figure_after(r, "--recompute-granularity full would fit ("), need_full / kGiB, 0.05);
  // The micro-batch of 1 fits too; the distributed optimizer alone does not (activations).
  EXPECT_NE(r.find("--micro-batch-size 1 would fit"), std::string::npos) << r;
  EXPECT_EQ(r.find("--use-distributed-optimizer would fit"), std::string::npos) << r;
  // With full recomputation it fits, and the spare is the capacity less the need and reserve.
  std::vector<std::string> fits = model;
  fits.insert(fits.end(), {"--recompute-granularity", "full"});
  r = dry_run_report(parsed(fits), 1);
  EXPECT_NE(r.find("memory verdict: fits dgx-a100's"), std::string::npos) << r;
  EXPECT_NEAR(figure_after(r, "runtime reserve, "), 80.0 - kRuntimeReserveGiB - need_full / kGiB,
              0.06);
}

TEST(Cluster, WorldSizeAndClusterAreForADryRunOnly) {
  std::vector<std::string> args = {"tessera-train", "--train-iters", "1", "--world-size", "8"};
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  RunOptions o;
  try {
    parse_run_options(static_cast<int>(argv.size()), argv.data(), o);
    FAIL() << "--world-size without --dry-run accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--world-size plans a run: it needs --dry-run"),
              std::string::npos)
        << e.what();
  }
}

// Dropless, one rank's experts can receive every copy each rank routes to them; a capacity factor
// bounds each expert's copies per rank (Megatron's get_capacity, as moe_route drops).
TEST(Cluster, MoeExpertBuffersFollowTheCapacity) {
  GPTConfig c;
  c.num_experts = 8;
  c.moe_router_topk = 2;
  const int64_t N = 64;
  EXPECT_EQ(c.moe_received_rows(N, 1), N * 2);      // no EP: the N*K copies themselves
  EXPECT_EQ(c.moe_received_rows(N, 4), 4 * N * 2);  // 2 local experts: N each from 4 ranks
  EXPECT_EQ(c.moe_received_rows(N, 8), 8 * N * 1);  // 1 local expert: N from each of 8 ranks
  c.moe_expert_capacity_factor = 1.0;               // capacity ceil(64 * 2 / 8) = 16
  EXPECT_EQ(c.moe_received_rows(N, 4), 4 * 2 * 16);
  EXPECT_EQ(c.moe_received_rows(N, 8), 8 * 1 * 16);
  c.moe_expert_capacity_factor = 1.3;  // ceil(20.8) = 21
  EXPECT_EQ(c.moe_received_rows(N, 4), 4 * 2 * 21);
  c.moe_expert_capacity_factor = 10;  // 160 > N: nothing dropped, the dropless bound holds
  EXPECT_EQ(c.moe_received_rows(N, 4), 4 * N * 2);
}
