// planner.cpp: tessera-plan's enumeration (plan/planner.hpp).
#include "plan/planner.hpp"

#include <algorithm>
#include <map>
#include <set>

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

bool valid_split(const PipelineSplitOptions& s, int layers, int mtp, int pp, int v) {
  try {
    split_stages(s, layers, mtp, pp, s.layout.empty() ? v : 0);
    return s.layout.empty() || layout_virtual_stages(s.layout, pp) == v;
  } catch (const ConfigError&) {
    return false;
  }
}

// The largest stage, counting the embedding and the loss as one layer each and multi-token
// prediction's layers as one each: the balance the pruning keeps.
int heaviest_stage(const PipelineSplitOptions& s, int layers, int mtp, int pp, int v) {
  int worst = 0;
  for (const StageSpan& sp : split_stages(s, layers, mtp, pp, s.layout.empty() ? v : 0))
    worst = std::max(worst, sp.layers() + sp.embedding + sp.loss + sp.mtp);
  return worst;
}

}  // namespace

std::vector<PipelineSplitOptions> plan_splits(int L, int mtp, int pp, int v) {
  // The candidates, each kept once per distinct placement of the layers, then only the most
  // balanced of them (the lightest heaviest stage, counting the embedding and the loss as a layer
  // each); multi-token prediction's own stage is a structure of its own and always offered.
  std::vector<PipelineSplitOptions> cands{PipelineSplitOptions{}};  // even
  if (pp > 1) {
    for (int k = 1; k <= 3; ++k) {  // the embedding and/or the loss counted
      PipelineSplitOptions s;
      s.account_embedding = k & 1;
      s.account_loss = k & 2;
      cands.push_back(s);
    }
    // First and last stages around middle ones of m layers (a multiple of V near L / PP).
    const int lo = std::max(v, L / pp / v * v);
    for (int m = lo; m <= lo + v; m += v) {
      const int rest = pp > 2 ? L - (pp - 2) * m : L;
      for (int first = v; first < rest; first += v) {
        PipelineSplitOptions s;
        s.first = first;
        s.last = rest - first;
        cands.push_back(s);
      }
    }
  }
  std::vector<PipelineSplitOptions> out;
  std::set<std::string> placements;
  int best = 1 << 30;
  std::vector<std::pair<int, PipelineSplitOptions>> weighed;
  for (const PipelineSplitOptions& s : cands) {
    if (!valid_split(s, L, mtp, pp, v)) continue;
    if (!placements.insert(layout_string(split_stages(s, L, mtp, pp, v))).second) continue;
    const int w = heaviest_stage(s, L, mtp, pp, v);
    best = std::min(best, w);
    weighed.emplace_back(w, s);
  }
  for (const auto& [w, s] : weighed)
    if (w == best && out.size() < 2) out.push_back(s);
  // Multi-token prediction on a stage of its own (Megatron's DeepSeek-V3 layout): the loss alone
  // in the last stage, the MTP layers in the one before (its rank's last virtual stage), the
  // decoder layers and the embedding spread over the rest, the extra ones first.
  const int S = pp * v;
  if (mtp > 0 && S >= 3) {
    const int units = L + 1, stages = S - 2;
    std::string layout;
    for (int s = 0; s < stages; ++s) {
      const int n = units / stages + (s < units % stages ? 1 : 0);
      if (s) layout += '|';
      layout += s == 0 ? "E" + std::string(static_cast<size_t>(std::max(0, n - 1)), 't')
                       : std::string(static_cast<size_t>(n), 't');
    }
    layout += "|" + std::string(static_cast<size_t>(mtp), 'm') + "|L";
    PipelineSplitOptions s;
    s.layout = layout;
    if (valid_split(s, L, mtp, pp, v)) out.push_back(s);
  }
  return out;
}

std::string PlanCandidate::split_name() const {
  if (!split.layout.empty()) return "layout";
  if (split.first > 0 || split.last > 0)
    return std::to_string(split.first) + "/" + std::to_string(split.last);
  if (split.account_embedding && split.account_loss) return "E+L";
  if (split.account_embedding) return "E";
  if (split.account_loss) return "L";
  return "even";
}

std::string PlanCandidate::options() const {
  // Every layout setting spelled out, on or off, so that a config file's own (sequence
  // parallelism, the distributed optimizer, recomputation, EP) never stays in force where the
  // row chose otherwise.
  std::string o = "--tensor-model-parallel-size " + std::to_string(tp) +
                  " --pipeline-model-parallel-size " + std::to_string(pp);
  if (!split.layout.empty()) {  // it sets the virtual stages itself; written out, no repeats
    std::string flat;
    for (const std::string& s : parse_pipeline_layout(split.layout))
      flat += (flat.empty() ? "" : "|") + s;
    o += " --pipeline-model-parallel-layout " + flat;
  } else if (v > 1)
    o += " --virtual-pipeline-model-parallel-size " + std::to_string(v);
  if (split.first > 0) o += " --decoder-first-pipeline-num-layers " + std::to_string(split.first);
  if (split.last > 0) o += " --decoder-last-pipeline-num-layers " + std::to_string(split.last);
  if (split.account_embedding) o += " --account-for-embedding-in-pipeline-split";
  if (split.account_loss) o += " --account-for-loss-in-pipeline-split";
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
  if (pp > 1) o += zero_bubble ? " --pipeline-schedule zero-bubble" : " --pipeline-schedule 1f1b";
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
                        const ClusterSpec& cluster, const PlanConstraints& fixed) {
  const GpuRates rates = rates_for(cluster);
  const double capacity = (cluster.gpu_memory_gib - kRuntimeReserveGiB) * 1073741824.0;
  PlanResult r;
  PieceCallsCache pieces;  // the layouts' pieces share their recordings (plan/collectives.hpp)
  const int global = base.global_batch_size;
  if (global <= 0)
    throw ConfigError("tessera-plan needs the global batch: give --global-batch-size");
  const std::vector<RecomputeGranularity> recomputes = {
      RecomputeGranularity::None, RecomputeGranularity::Selective, RecomputeGranularity::Full};
  auto held = [](int fixed_value, int x) { return fixed_value == 0 || fixed_value == x; };
  // The fullest rank's estimate: on the first stage (the most micro-batches in flight, the
  // embedding) or the last (the output layer, multi-token prediction); with uneven stages, or
  // zero-bubble's W operands held on the later stages, it may be any.
  auto fullest = [&](const TrainConfig& t, const GridLayout& layout, int ep) {
    double most = 0;
    std::set<std::string> shapes;  // of each shape, the earliest (fullest) stage
    for (int s = 0; s < layout.pp; ++s)
      if (s == 0 || s == layout.pp - 1 || t.zero_bubble ||
          (t.pipeline_split.uneven() &&
           shapes.insert(pipeline_stage_shape(cfg, t, layout, ep, s)).second))
        most = std::max(most, estimate_rank_memory(cfg, t, layout, s, ep).total_bytes());
    return most;
  };
  struct Later {  // a fitting pipelined layout, to predict with zero-bubble too
    PlanCandidate c;
    TrainConfig t;
    GridLayout layout;
  };
  std::vector<Later> zero_bubble_later;
  const int mtp = cfg.mtp() ? cfg.mtp_num_layers : 0;
  std::map<std::pair<int, int>, std::vector<PipelineSplitOptions>> splits;  // by (pp, v)
  auto splits_of = [&](int pp, int v) -> const std::vector<PipelineSplitOptions>& {
    auto it = splits.find({pp, v});
    if (it != splits.end()) return it->second;
    std::vector<PipelineSplitOptions> s;
    if (!fixed.split_set)
      s = plan_splits(cfg.num_layers, mtp, pp, v);
    else if (valid_split(fixed.split, cfg.num_layers, mtp, pp, v))
      s.push_back(fixed.split);
    return splits[{pp, v}] = s;
  };
  for (int tp : divisors(world, cluster.gpus_per_node))
    for (int cp : divisors(world / tp, 64))
      for (int pp : divisors(world / (tp * cp), cfg.num_layers)) {
        if (!held(fixed.tp, tp) || !held(fixed.cp, cp) || !held(fixed.pp, pp)) continue;
        const int dp = world / (tp * cp * pp);
        const std::vector<int> eps =
            cfg.moe() ? divisors(dp, cfg.num_experts) : std::vector<int>{1};
        for (int ep : eps)
          for (int v = 1; v <= (pp > 1 ? 8 : 1); ++v) {
            // No valid split at (pp, v): its layouts count as considered, none as valid.
            if (splits_of(pp, v).empty()) r.considered += 4 * int64_t(recomputes.size()) * 4;
            for (const PipelineSplitOptions& split : splits_of(pp, v))
              for (int mb : {1, 2, 4, 8})
                for (RecomputeGranularity rc : recomputes)
                  for (int mode = 0; mode < 4; ++mode) {
                    using S = PlanCandidate::Sharding;
                    const S sharding = static_cast<S>(mode);
                    if (!held(fixed.ep, ep) || !held(fixed.v, v) || !held(fixed.micro_batch, mb) ||
                        (fixed.recompute_set && fixed.recompute != rc) ||
                        (fixed.sharding_set && fixed.sharding != sharding &&
                         !(fixed.sharding == S::Fsdp && sharding == S::Hsdp)))
                      continue;
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
                    c.split = split;
                    const bool fsdp = sharding == S::Fsdp || sharding == S::Hsdp;
                    TrainConfig t = base;
                    t.micro_batch_size = mb;
                    t.virtual_pipeline_size = v;
                    t.pipeline_split = split;
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
                    // The zero-bubble schedule where it applies (PP > 1, not FSDP nor FP8).
                    const bool zb_ok = pp > 1 && !fsdp && !t.fp8.enabled;
                    if (fixed.schedule_set && fixed.zero_bubble && !zb_ok) continue;
                    ++r.valid;
                    c.zero_bubble = t.zero_bubble = fixed.schedule_set && fixed.zero_bubble;
                    c.memory = fullest(t, layout, ep);
                    if (c.memory > capacity) continue;
                    ++r.fitting;
                    c.prediction = predict_step(cfg, t, layout, ep, cluster, rates, &pieces);
                    r.ranked.push_back(c);
                    if (zb_ok && !fixed.schedule_set) zero_bubble_later.push_back({c, t, layout});
                  }
          }
      }
  // The zero-bubble variants of the fastest pipelined layouts (their held W operands may need
  // more memory on the later stages: estimated again).
  std::stable_sort(zero_bubble_later.begin(), zero_bubble_later.end(),
                   [](const Later& a, const Later& b) {
                     return a.c.prediction.tokens_per_s > b.c.prediction.tokens_per_s;
                   });
  for (size_t i = 0; i < zero_bubble_later.size() && i < size_t(kZeroBubbleTried); ++i) {
    Later& z = zero_bubble_later[i];
    z.t.zero_bubble = z.c.zero_bubble = true;
    ++r.considered;
    ++r.valid;
    z.c.memory = fullest(z.t, z.layout, z.c.ep);
    if (z.c.memory > capacity) continue;
    ++r.fitting;
    z.c.prediction = predict_step(cfg, z.t, z.layout, z.c.ep, cluster, rates, &pieces);
    r.ranked.push_back(z.c);
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
