// planning.cpp: what a --dry-run checks the layout against (issue 57, docs/planning.md): the
// cluster (--cluster, a kind of configs/clusters or a file) and the GPUs of the plan
// (--world-size, instead of the MPI world); their checks, and the memory verdict the report ends
// with: whether the fullest rank fits the cluster's GPU (or this host's GPU, or on the CPU this
// host's memory), and when it does not, which single change would make it fit.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"
#include "plan/cluster.hpp"
#include "plan/collectives.hpp"
#include "plan/predict.hpp"
#include "run/layout.hpp"

namespace tessera {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string gib_text(double bytes) {
  char buf[32];
  if (bytes < kGiB)
    std::snprintf(buf, sizeof buf, "%.0f MiB", bytes / (1024.0 * 1024.0));
  else
    std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / kGiB);
  return buf;
}

// The largest of one rank's estimates over the pipeline stages under `t`.
std::pair<double, int> fullest_rank(const RunOptions& o, const TrainConfig& t,
                                    const GridLayout& layout) {
  double need = 0;
  int stage = 0;
  for (int s = 0; s < layout.pp; ++s) {
    const double b = estimate_rank_memory(o.model, t, layout, s, o.ep).total_bytes();
    if (b > need) need = b, stage = s;
  }
  return {need, stage};
}

class PlanningOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    p.group("Planning")
        .add_options()(
            "cluster", po::value(&o.cluster),
            "with --dry-run: the cluster to check the layout against, a kind of configs/clusters "
            "(dgx-a100, dgx-h100, dgx-h200) or a cluster file's path (docs/planning.md); the "
            "report ends with whether the fullest rank fits its GPU")(
            "world-size", po::value(&o.world_size),
            "with --dry-run: the GPUs (ranks) of the plan, instead of the MPI world the dry run "
            "runs in (a multiple of TP x CP x PP, and of EP)")(
            "collective-plan", po::value(&o.collective_plan),
            "with --dry-run: write the collectives each rank issues in one training step, in "
            "order, to PREFIX.rank<R> (one line per call: group, operation, elements, bytes per "
            "element, peer; docs/planning.md)");
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes&) override {
    if (o.world_size < 0 || (p.given("world-size") && o.world_size == 0))
      throw ConfigError(detail::concat("--world-size=", o.world_size,
                                       " is out of range (allowed: >= 1, the ranks of the plan)"));
    for (const char* name : {"cluster", "world-size", "collective-plan"})
      if (p.given(name) && !o.train.dry_run)
        throw ConfigError(std::string("--") + name +
                          " plans a run: it needs --dry-run (a real run takes its world from "
                          "mpirun/srun and its GPUs from the node)");
    if (!o.cluster.empty()) o.cluster_spec = std::make_shared<ClusterSpec>(load_cluster(o.cluster));
    o.host_memory_bytes = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    if (s == DryRunSection::Setup && d.o.cluster_spec)
      out << "cluster: " << describe_cluster(*d.o.cluster_spec) << " (" << d.o.cluster_spec->file
          << ")\n";
    if (s == DryRunSection::Verdict) {
      verdict(d, out);
      if (!d.o.collective_plan.empty()) write_collective_plan(d, out);
      if (d.o.cluster_spec) {  // the predicted step (plan/predict.hpp)
        const GpuRates rates = rates_for(*d.o.cluster_spec);
        out << prediction_report(
            predict_step(d.o.model, d.o.train, d.layout, d.o.ep, *d.o.cluster_spec, rates),
            *d.o.cluster_spec, rates);
      }
    }
  }

 private:
  // --collective-plan: every rank's planned step (plan/collectives.hpp), one file each.
  static void write_collective_plan(const DryRunContext& d, std::ostream& out) {
    const std::string& prefix = d.o.collective_plan;
    for (int r = 0; r < d.world; ++r) {
      const CollectivePlan plan(d.o.model, d.o.train, d.layout, d.o.ep, r, d.o.device == "cuda");
      const std::string path = prefix + ".rank" + std::to_string(r);
      std::FILE* f = std::fopen(path.c_str(), "w");
      if (!f)
        throw ConfigError("--collective-plan: cannot write " + path +
                          " (check that its folder exists and is writable)");
      for (const PlannedCall& c : plan.step()) std::fprintf(f, "%s\n", c.line().c_str());
      const bool written = std::fclose(f) == 0;
      if (!written) throw ConfigError("--collective-plan: writing " + path + " failed");
    }
    out << "collective plan: " << d.world << " file" << (d.world == 1 ? "" : "s") << " " << prefix
        << ".rank0..." << d.world - 1 << "\n";
  }

  static void verdict(const DryRunContext& d, std::ostream& out) {
    const RunOptions& o = d.o;
    double capacity = 0, reserve = 0;
    std::string what;
    // Ranks whose estimates share the capacity: the CPU run's on the host's memory, or
    // --ranks-per-gpu on a GPU (each with its own runtime reserve).
    int sharing = 1;
    const std::string shared = o.ranks_per_gpu > 1 ? ", shared by --ranks-per-gpu " +
                                                         std::to_string(o.ranks_per_gpu) + " ranks"
                                                   : std::string();
    if (o.cluster_spec) {
      capacity = o.cluster_spec->gpu_memory_gib * kGiB;
      sharing = o.ranks_per_gpu;
      reserve = kRuntimeReserveGiB * kGiB * sharing;
      what = o.cluster_spec->name + "'s " + o.cluster_spec->gpu + " (" + gib_text(capacity) +
             shared + ")";
    } else if (o.device == "cuda" && o.local_gpu_bytes > 0) {
      capacity = o.local_gpu_bytes;
      sharing = o.ranks_per_gpu;
      reserve = kRuntimeReserveGiB * kGiB * sharing;
      what = "this host's " + o.local_gpu + " (" + gib_text(capacity) + shared + ")";
    } else if (o.device == "cuda") {
      out << "memory verdict: none: no GPU on this host to check against; give --cluster "
             "(dgx-a100, dgx-h100, dgx-h200 or a cluster file, docs/planning.md)\n";
      return;
    } else {
      capacity = o.host_memory_bytes;
      sharing = d.world;
      what = "this host's memory (" + gib_text(capacity) + ", shared by the " +
             std::to_string(sharing) + " rank" + (sharing == 1 ? "" : "s") +
             " of the CPU run; --cluster checks GPUs)";
    }
    const auto [need, stage] = fullest_rank(o, o.train, d.layout);
    const double total = need * sharing + reserve;
    const std::string needs =
        "the fullest rank (stage " + std::to_string(stage) + ") needs " + gib_text(need) +
        (sharing > 1 ? ", " + std::to_string(sharing) + " ranks " + gib_text(need * sharing) : "") +
        (reserve > 0 ? " + " + gib_text(reserve) + " runtime reserve" : "");
    if (total <= capacity) {
      out << "memory verdict: fits " << what << ": " << needs << ", " << gib_text(capacity - total)
          << " to spare\n";
      return;
    }
    out << "memory verdict: does not fit " << what << ": " << needs << "; "
        << cures(d, capacity, reserve, sharing) << "\n";
  }

  // The changes that would make the fullest rank fit, each with what it would need: single ones
  // first; pairs of them when no single one does.
  static std::string cures(const DryRunContext& d, double capacity, double reserve, int sharing) {
    const RunOptions& o = d.o;
    struct Change {
      std::string option;
      std::function<void(RunOptions&)> apply;
    };
    std::vector<Change> changes;
    if (o.train.recompute.granularity != RecomputeGranularity::Full)
      changes.push_back({"--recompute-granularity full", [](RunOptions& r) {
                           r.train.recompute = recompute_options("full", "uniform", 1, false, 0);
                         }});
    if (o.train.micro_batch_size > 1)
      changes.push_back(
          {"--micro-batch-size 1", [](RunOptions& r) { r.train.micro_batch_size = 1; }});
    // Under Megatron-FSDP's no_shard the distributed optimizer has no effect: its next strategy
    // shards the optimizer state.
    if (o.train.megatron_fsdp && o.train.dp_sharding == TrainConfig::DpSharding::NoShard &&
        d.layout.dp * d.layout.cp > 1)
      changes.push_back({"--data-parallel-sharding-strategy optim", [](RunOptions& r) {
                           r.train.dp_sharding = TrainConfig::DpSharding::Optim;
                           r.train.use_distributed_optimizer = true;
                         }});
    else if (!o.train.use_distributed_optimizer && d.layout.dp > 1)
      changes.push_back({"--use-distributed-optimizer",
                         [](RunOptions& r) { r.train.use_distributed_optimizer = true; }});
    if (!o.train.sequence_parallel && d.layout.tp > 1)
      changes.push_back(
          {"--sequence-parallel", [](RunOptions& r) { r.train.sequence_parallel = true; }});
    // Dropless MoE buffers the most copies a layer can receive (every token to each expert with
    // EP); a capacity drops the rest (Megatron's option, GPTConfig::moe_received_rows).
    if (o.model.moe() && o.model.moe_dropless() && o.ep > 1)
      changes.push_back({"--moe-expert-capacity-factor 1.0",
                         [](RunOptions& r) { r.model.moe_expert_capacity_factor = 1.0; }});
    auto need_with = [&](std::initializer_list<const Change*> cs) {
      RunOptions r = o;
      for (const Change* c : cs) c->apply(r);
      return fullest_rank(r, r.train, d.layout).first;
    };
    auto fits = [&](double need) { return need * sharing + reserve <= capacity; };
    std::string out;
    for (const Change& c : changes)
      if (const double need = need_with({&c}); fits(need))
        out += (out.empty() ? "" : "; ") + c.option + " would fit (" + gib_text(need) + ")";
    for (size_t i = 0; out.empty() && i < changes.size(); ++i)
      for (size_t j = i + 1; j < changes.size(); ++j)
        if (const double need = need_with({&changes[i], &changes[j]}); fits(need))
          out += (out.empty() ? "" : "; ") + changes[i].option + " with " + changes[j].option +
                 " would fit (" + gib_text(need) + ")";
    return out.empty() ? "no change of recomputation, micro-batch, distributed optimizer, "
                         "sequence parallelism or MoE capacity (alone or two together) makes it "
                         "fit: spread the model over more GPUs (--tensor-model-parallel-size, "
                         "--pipeline-model-parallel-size, --expert-model-parallel-size) or shrink "
                         "it"
                       : out;
  }
};

}  // namespace

std::unique_ptr<OptionGroup> make_planning_options() {
  return std::make_unique<PlanningOptions>();
}

}  // namespace tessera
