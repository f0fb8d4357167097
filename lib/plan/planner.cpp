// planner.cpp: tessera-plan's enumeration (plan/planner.hpp).
#include "plan/planner.hpp"

#include <algorithm>

#include "comm/grid_layout.hpp"
#include "core/error.hpp"
#include "run/layout.hpp"
#include "run/memory_estimate.hpp"

namespace tessera {

namespace {

std::vector<int> divisors(int n, int limit) {
  std::vector<int> d;
  for (int i = 1; i <= std::min(n, limit); ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

}  // namespace

std::string PlanCandidate::options() const {
  // Every layout setting spelled out, on or off, so that a config file's own (sequence
  // parallelism, the distributed optimizer, recomputation, EP) never stays in force where the
  // row chose otherwise.
  std::string o = "--tensor-model-parallel-size " + std::to_string(tp) +
                  " --pipeline-model-parallel-size " + std::to_string(pp);
  if (v > 1) o += " --virtual-pipeline-model-parallel-size " + std::to_string(v);
  o += " --context-parallel-size " + std::to_string(cp);
  o += " --expert-model-parallel-size " + std::to_string(ep);
  o += " --micro-batch-size " + std::to_string(micro_batch);
  o += sequence_parallel ? " --sequence-parallel" : " --no-sequence-parallel";
  switch (sharding) {
    case Sharding::None:
      o += " --no-use-distributed-optimizer --no-overlap-param-gather --no-use-megatron-fsdp";
      break;
    case Sharding::DistOpt:
      o += " --use-distributed-optimizer --overlap-param-gather --no-use-megatron-fsdp";
      break;
    case Sharding::Fsdp:
    case Sharding::Hsdp:
      o += " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
           "--no-overlap-param-gather";
      break;
  }
  o += " --num-distributed-optimizer-instances " + std::to_string(instances);
  if (recompute == RecomputeGranularity::None) o += " --recompute-granularity none";
  if (recompute == RecomputeGranularity::Selective) o += " --recompute-granularity selective";
  if (recompute == RecomputeGranularity::Full)
    o += " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1";
  return o;
}

std::string PlanCandidate::sharding_name() const {
  switch (sharding) {
    case Sharding::DistOpt:
      return "dist-opt";
    case Sharding::Fsdp:
      return "fsdp";
    case Sharding::Hsdp:
      return "hsdp/" + std::to_string(instances);
    default:
      return "none";
  }
}

PlanResult plan_layouts(const GPTConfig& cfg, const TrainConfig& base, int world,
                        const ClusterSpec& cluster) {
  const GpuRates rates = rates_for(cluster);
  const double capacity = (cluster.gpu_memory_gib - kRuntimeReserveGiB) * 1073741824.0;
  PlanResult r;
  PieceCallsCache pieces;  // the layouts' pieces share their recordings (plan/collectives.hpp)
  const int global = base.global_batch_size;
  if (global <= 0)
    throw ConfigError("tessera-plan needs the global batch: give --global-batch-size");
  const std::vector<RecomputeGranularity> recomputes = {
      RecomputeGranularity::None, RecomputeGranularity::Selective, RecomputeGranularity::Full};
  for (int tp : divisors(world, cluster.gpus_per_node))
    for (int cp : divisors(world / tp, 64))
      for (int pp : divisors(world / (tp * cp), cfg.num_layers)) {
        const int dp = world / (tp * cp * pp);
        const std::vector<int> eps =
            cfg.moe() ? divisors(dp, cfg.num_experts) : std::vector<int>{1};
        for (int ep : eps)
          for (int v = 1; v <= (pp > 1 ? 8 : 1); ++v)
            for (int mb : {1, 2, 4, 8})
              for (RecomputeGranularity rc : recomputes)
                for (int mode = 0; mode < 4; ++mode) {
                  using S = PlanCandidate::Sharding;
                  const S sharding = static_cast<S>(mode);
                  // HSDP: one instance per node the data-parallel ranks (with TP and CP) span.
                  const int nodes = tp * cp * dp / std::max(1, cluster.gpus_per_node);
                  const int n = sharding == S::Hsdp ? nodes : 1;
                  if ((sharding != S::None && dp * cp == 1) ||
                      (sharding == S::DistOpt && dp == 1) ||
                      (sharding == S::Hsdp && (n < 2 || (dp * cp) % n != 0 ||
                                               (tp * cp * dp) % cluster.gpus_per_node != 0)) ||
                      (ep > 1 && cfg.num_experts % ep != 0))
                    continue;
                  ++r.considered;
                  PlanCandidate c;
                  c.tp = tp, c.pp = pp, c.v = v, c.cp = cp, c.dp = dp, c.ep = ep;
                  c.micro_batch = mb;
                  c.sequence_parallel = tp > 1;
                  c.sharding = sharding;
                  c.instances = n;
                  c.recompute = rc;
                  const bool fsdp = sharding == S::Fsdp || sharding == S::Hsdp;
                  TrainConfig t = base;
                  t.micro_batch_size = mb;
                  t.virtual_pipeline_size = v;
                  t.sequence_parallel = c.sequence_parallel;
                  t.use_distributed_optimizer = sharding != S::None;
                  t.overlap_param_gather = sharding == S::DistOpt;
                  t.megatron_fsdp = fsdp;
                  t.dp_sharding = fsdp ? TrainConfig::DpSharding::OptimGradsParams
                                       : TrainConfig::DpSharding::NoShard;
                  t.dist_opt_instances = n;
                  t.recompute = RecomputeConfig{};
                  t.recompute.granularity = rc;
                  if (global % (mb * dp) != 0) continue;
                  GridLayout layout;
                  try {
                    layout = GridLayout::make(world, tp, pp, cp);
                    check_expert_parallel(layout, ep);
                    if (n > 1) check_optimizer_instances(layout, ep, n);
                    validate_layout(cfg, t, tp, pp, dp, cp);
                    t = t.resolved(dp);
                  } catch (const ConfigError&) {
                    continue;  // not a layout of this model and batch
                  }
                  ++r.valid;
                  // The fullest rank is on the first stage (the most micro-batches in flight, the
                  // embedding) or the last (the output layer, multi-token prediction); with
                  // uneven stages it may be any.
                  for (int s = 0; s < pp; ++s)
                    if (s == 0 || s == pp - 1 || t.pipeline_split.uneven())
                      c.memory = std::max(
                          c.memory, estimate_rank_memory(cfg, t, layout, s, ep).total_bytes());
                  if (c.memory > capacity) continue;
                  ++r.fitting;
                  c.prediction = predict_step(cfg, t, layout, ep, cluster, rates, &pieces);
                  r.ranked.push_back(c);
                }
      }
  // Fastest first; among equally fast layouts, the one that needs the least memory.
  std::stable_sort(r.ranked.begin(), r.ranked.end(),
                   [](const PlanCandidate& a, const PlanCandidate& b) {
                     if (a.prediction.tokens_per_s != b.prediction.tokens_per_s)
                       return a.prediction.tokens_per_s > b.prediction.tokens_per_s;
                     return a.memory < b.memory;
                   });
  return r;
}

}  // namespace tessera
