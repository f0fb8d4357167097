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
  // The stage split (model/pipeline_split.hpp): even, the embedding and loss counted, first/last
  // stages, or a layout string (multi-token prediction on a stage of its own).
  PipelineSplitOptions split;
  bool zero_bubble = false;  // the pipeline schedule: zero-bubble (ZB-H1), else 1F1B
  double memory = 0;  // the fullest rank's estimate, bytes (the runtime reserve not included)
  StepPrediction prediction;
  // The tessera-train options of this layout ("--tensor-model-parallel-size 8 ...").
  std::string options() const;
  // "none", "dist-opt", "fsdp", "hsdp/N".
  std::string sharding_name() const;
  // "even", "E+L" (counted), "E", "L", "3/2" (first/last layers), "layout".
  std::string split_name() const;
};

// What the command line fixed (tessera-plan: any layout option given restricts the search to
// it): 0 / unset leaves a dimension free.
struct PlanConstraints {
  int tp = 0, pp = 0, cp = 0, ep = 0, v = 0, micro_batch = 0;
  bool recompute_set = false;
  RecomputeGranularity recompute = RecomputeGranularity::None;
  bool sharding_set = false;
  PlanCandidate::Sharding sharding = PlanCandidate::Sharding::None;
  bool split_set = false;  // the split options given: that split only
  PipelineSplitOptions split;
  bool schedule_set = false;  // --pipeline-schedule (or --enable-zero-bubble) given: that one only
  bool zero_bubble = false;
};

constexpr int kZeroBubbleTried = 16;

struct PlanResult {
  std::vector<PlanCandidate> ranked;  // the layouts that fit, fastest first
  int64_t considered = 0, valid = 0, fitting = 0;
};

// Every layout of `world` GPUs: TP (up to a node, dividing the heads), CP, PP (up to the layers),
// virtual stages, the stage split (plan_splits), EP (MoE), micro-batch (1, 2, 4, 8),
// recomputation (none, selective, full) and the data-parallel sharding (with DP x CP > 1: the
// distributed optimizer, Megatron-FSDP, and HSDP with one instance per node when the data-parallel
// ranks span nodes); sequence parallelism whenever TP > 1; the pipeline schedule (1F1B, and the
// zero-bubble variant of the kZeroBubbleTried fastest pipelined layouts where it applies: not
// with FSDP or FP8); each dimension `fixed` sets is held there. `base` holds the run's global
// batch, sequence, precision and FP8 settings. A layout fits when its fullest rank's estimate plus
// kRuntimeReserveGiB fits the cluster's GPU; those are predicted and ranked by tokens/s.
PlanResult plan_layouts(const GPTConfig& cfg, const TrainConfig& base, int world,
                        const ClusterSpec& cluster, const PlanConstraints& fixed = {});

// The stage splits worth predicting for `layers` decoder layers (and `mtp` MTP layers) at PP x V,
// pruned to the balanced ones: the even split where PP x V divides the layers; the embedding and
// the loss counted as layers (both, or the one that divides); the first and last stages' layers
// around balanced middle stages, when the even split does not exist; and for a model with
// multi-token prediction, a layout with the MTP layers on a stage of their own before the loss's,
// the decoder layers spread over the stages before them (the embedding counted as one), as
// Megatron's DeepSeek-V3 layout does. Each is valid (split_stages accepts it).
std::vector<PipelineSplitOptions> plan_splits(int layers, int mtp, int pp, int v);

}  // namespace tessera
