// planner.hpp: the layouts of a model on a cluster's GPUs that fit in memory, ranked by predicted
// throughput (issue 57's tessera-plan; docs/planning.md, "tessera-plan").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/gpt_config.hpp"
#include "plan/cluster.hpp"
#include "plan/predict.hpp"
#include "run/train_config.hpp"

namespace tessera {

struct PlanCandidate {
  int tp = 1, pp = 1, v = 1, cp = 1, dp = 1, ep = 1, micro_batch = 1;
  bool sequence_parallel = false;
  // How the data-parallel ranks share the weights and optimizer state: replicated, the
  // distributed optimizer, Megatron-FSDP (optim_grads_params), or HSDP (FSDP inside each of
  // `instances` groups of one node's data-parallel ranks, replicated across them).
  enum class Sharding { None, DistOpt, Fsdp, Hsdp } sharding = Sharding::None;
  int instances = 1;
  RecomputeGranularity recompute = RecomputeGranularity::None;
  double memory = 0;  // the fullest rank's estimate, bytes (the runtime reserve not included)
  StepPrediction prediction;
  // The tessera-train options of this layout ("--tensor-model-parallel-size 8 ...").
  std::string options() const;
  // "none", "dist-opt", "fsdp", "hsdp/N".
  std::string sharding_name() const;
};

struct PlanResult {
  std::vector<PlanCandidate> ranked;  // the layouts that fit, fastest first
  int64_t considered = 0, valid = 0, fitting = 0;
};

// Every layout of `world` GPUs: TP (up to a node, dividing the heads), CP, PP (dividing the
// layers), virtual stages, EP (MoE), micro-batch (1, 2, 4, 8), recomputation (none, selective,
// full) and the data-parallel sharding (with DP x CP > 1: the distributed optimizer, Megatron-FSDP,
// and HSDP with one instance per node when the data-parallel ranks span nodes); sequence
// parallelism whenever TP > 1. `base`
// holds the run's global batch, sequence, precision and FP8 settings. A layout fits when its
// fullest rank's estimate plus kRuntimeReserveGiB fits the cluster's GPU; those are predicted and
// ranked by tokens/s.
PlanResult plan_layouts(const GPTConfig& cfg, const TrainConfig& base, int world,
                        const ClusterSpec& cluster);

}  // namespace tessera
