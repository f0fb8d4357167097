// parallelism.cpp: the layout options (TP, PP, CP, virtual pipeline stages, sequence parallelism,
// data-parallel gradient reduction and the distributed optimizer), their checks and the layout's
// --dry-run lines.
#include <cstdio>
#include <ostream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "model/pipeline_split.hpp"
#include "options/option_group.hpp"
#include "run/context_parallel.hpp"

namespace tessera {
namespace {

class ParallelismOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    TrainConfig& t = o.train;
    p.group("Parallelism")
        .add_options()("tensor-model-parallel-size", po::value(&o.tp)->default_value(1),
                       "tensor-parallel ranks (consecutive ranks; keep them in one node)")(
            "pipeline-model-parallel-size", po::value(&o.pp)->default_value(1),
            "pipeline stages (layers split evenly unless the uneven-stage options below say "
            "otherwise); DP = world / (TP * CP * PP)")(
            "cp-comm-type", po::value(&cp_comm_type_)->default_value("p2p"),
            "context parallelism's communication: p2p (the K/V ring; the only one Tessera has)")(
            "context-parallel-size", po::value(&o.cp)->default_value(1),
            "context parallelism: each sequence split over CP ranks (two of its 2 x CP chunks "
            "each), attention around their ring; same losses (needs --seq-length a multiple of "
            "2 x CP)")(
            "num-layers-per-virtual-pipeline-stage",
            po::value(&layers_per_virtual_stage_)->default_value(0),
            "the interleaved 1F1B schedule: model chunks of N layers, each pipeline rank holding "
            "every PP-th chunk (needs PP > 1 and micro-batches per step a multiple of PP)")(
            "virtual-pipeline-model-parallel-size", po::value(&virtual_size_)->default_value(0),
            "the interleaved 1F1B schedule given as the number of model chunks per pipeline rank")(
            "num-virtual-stages-per-pipeline-rank", po::value(&virtual_stages_)->default_value(0),
            "Megatron-LM's name of --virtual-pipeline-model-parallel-size (the one it asks for "
            "with uneven stages)")(
            "decoder-first-pipeline-num-layers", po::value(&first_)->default_value(0),
            "uneven stages: the transformer layers of the first pipeline rank (default: an even "
            "split); the other ranks' split evenly, a multiple of the virtual stages each")(
            "decoder-last-pipeline-num-layers", po::value(&last_)->default_value(0),
            "uneven stages: the transformer layers of the last pipeline rank")(
            "account-for-embedding-in-pipeline-split",
            po::bool_switch(&t.pipeline_split.account_embedding),
            "count the embedding as a layer when splitting the layers over the stages (the first "
            "stage holds one transformer layer fewer)")(
            "account-for-loss-in-pipeline-split", po::bool_switch(&t.pipeline_split.account_loss),
            "count the loss (final norm, output layer, cross-entropy) as a layer when splitting "
            "(the last stage holds one transformer layer fewer)")(
            "pipeline-model-parallel-layout", po::value(&t.pipeline_split.layout),
            "the layers of every (virtual) stage, as Megatron-LM writes them: E embedding, t "
            "transformer layer, m MTP layer, L loss, | between stages (in order of virtual stage, "
            "then pipeline rank), (...)*N and x*N repeat, commas cosmetic, e.g. "
            "\"Et*3|(tt|)*29,mL\"; the virtual stages per rank are its stages / PP")(
            "pipeline-schedule", po::value(&schedule_)->default_value("1f1b"),
            "1f1b (the default; interleaved with virtual stages) or zero-bubble: ZB-H1, each "
            "backward split into its input-gradient pass B and weight-gradient pass W, the W "
            "passes run later to fill the pipeline's idle time, the same losses bit for bit "
            "(needs PP > 1)")("enable-zero-bubble", po::bool_switch(&enable_zero_bubble_),
                              "the zero-bubble fork's name of --pipeline-schedule zero-bubble")(
            "sequence-parallel", po::bool_switch(&t.sequence_parallel),
            "with TP > 1: split the LayerNorm, dropout and residual regions along the tokens "
            "(each rank 1/TP of a micro-batch's) over the tensor-parallel group (all-gather before "
            "and reduce-scatter after the "
            "tensor-parallel GEMMs instead of all-reduces; activations of those regions / TP)")(
            "ddp-bucket-size", po::value(&t.ddp_bucket_size)->default_value(t.ddp_bucket_size),
            "elements per data-parallel gradient all-reduce bucket")(
            "use-distributed-optimizer", po::bool_switch(&t.use_distributed_optimizer),
            "shard the fp32 master weights and Adam moments over the data-parallel ranks (ZeRO-1): "
            "gradients reduce-scattered, updated weights all-gathered")(
            "overlap-grad-reduce",
            po::value(&t.overlap_grad_reduce)->default_value(true)->implicit_value(true),
            "reduce gradient buckets while the backward runs (true | false; default true)")(
            "overlap-param-gather",
            po::value(&t.overlap_param_gather)->default_value(false)->implicit_value(true),
            "with --use-distributed-optimizer: gather updated weights bucket by bucket while the "
            "next forward runs")(
            "use-megatron-fsdp", po::bool_switch(&t.megatron_fsdp),
            "Megatron-FSDP: one data-parallel bucket per layer (and one for the embedding, one "
            "for the head), sharded over the DP ranks as --data-parallel-sharding-strategy says")(
            "data-parallel-sharding-strategy",
            po::value(&sharding_)->default_value("optim_grads_params"),
            "with --use-megatron-fsdp: no_shard (DDP), optim (optimizer state, ZeRO-1), "
            "optim_grads (and gradients, reduce-scattered each micro-batch, ZeRO-2), "
            "optim_grads_params (and parameters, each layer's gathered for its forward and again "
            "for its backward, ZeRO-3; Megatron's default)")(
            "num-distributed-optimizer-instances",
            po::value(&t.dist_opt_instances)->default_value(1),
            "HSDP / partial distributed optimizer: split the data-parallel ranks (x CP) into N "
            "instances of consecutive ranks (one per node, say); the optimizer state (and FSDP's "
            "gradients and weights) are sharded inside an instance and replicated across them, "
            "gradients summed across instances once per step")(
            "outer-dp-sharding-strategy", po::value(&outer_sharding_)->default_value("no_shard"),
            "with --use-megatron-fsdp and --num-distributed-optimizer-instances > 1: no_shard "
            "(replicated across instances) or optim (the optimizer state also sharded across "
            "them; needs optim_grads_params)");
    p.alternatives({"num-layers-per-virtual-pipeline-stage", "virtual-pipeline-model-parallel-size",
                    "num-virtual-stages-per-pipeline-rank"});
  }

  void resolve(const OptionParser&, RunOptions& o, StartupNotes&) override {
    using detail::concat;
    if (o.tp < 1)
      throw ConfigError(
          concat("--tensor-model-parallel-size=", o.tp, " is out of range (allowed: >= 1)"));
    if (o.pp < 1)
      throw ConfigError(
          concat("--pipeline-model-parallel-size=", o.pp, " is out of range (allowed: >= 1)"));
    if (o.cp < 1)
      throw ConfigError(
          concat("--context-parallel-size=", o.cp, " is out of range (allowed: >= 1)"));
    if (cp_comm_type_ != "p2p")
      throw ConfigError("--cp-comm-type=" + cp_comm_type_ +
                        " is not available: Tessera's context parallelism passes K/V blocks "
                        "around a ring, point to point (allowed: p2p)");
  }

  // The virtual pipeline size: --num-layers-per-virtual-pipeline-stage needs the model's layers,
  // which --use-checkpoint-args (a later group) may have replaced.
  void resolve_late(const OptionParser& p, RunOptions& o, StartupNotes& notes) override {
    using detail::concat;
    resolve_sharding(p, o, notes);  // after the optimizer's group (dist_muon)
    resolve_instances(p, o);
    const GPTConfig& m = o.model;
    TrainConfig& t = o.train;
    const int per_stage = layers_per_virtual_stage_;
    if (virtual_stages_ != 0) virtual_size_ = virtual_stages_;
    const char* vp_name = virtual_stages_ != 0 ? "--num-virtual-stages-per-pipeline-rank"
                                               : "--virtual-pipeline-model-parallel-size";
    if (per_stage < 0)
      throw ConfigError(concat("--num-layers-per-virtual-pipeline-stage=", per_stage,
                               " is out of range (allowed: >= 1)"));
    if (virtual_size_ < 0)
      throw ConfigError(concat(vp_name, "=", virtual_size_, " is out of range (allowed: >= 1)"));
    resolve_split(p, o, per_stage);
    resolve_schedule(p, o);
    PipelineSplitOptions& ps = t.pipeline_split;
    if (!ps.layout.empty()) {
      const int v = layout_virtual_stages(ps.layout, o.pp);
      if (virtual_size_ > 0 && virtual_size_ != v)
        throw ConfigError(concat(vp_name, "=", virtual_size_,
                                 " disagrees with --pipeline-model-parallel-layout: its stages "
                                 "over PP ",
                                 o.pp, " make ", v, " virtual stages per rank (give ", v,
                                 ", or leave it out)"));
      t.virtual_pipeline_size = v;
      if (v > 1) t.virtual_option = "--pipeline-model-parallel-layout";
    } else if (per_stage > 0) {
      // Megatron-LM: the layers per virtual stage count the embedding and the loss when they are
      // counted in the split.
      const int counted = m.num_layers + (ps.account_embedding ? 1 : 0) + (ps.account_loss ? 1 : 0);
      if (counted % (o.pp * per_stage) != 0)
        throw ConfigError(concat("--num-layers=", m.num_layers,
                                 counted != m.num_layers ? concat(" (", counted,
                                                                  " counting the "
                                                                  "embedding and loss)")
                                                         : std::string(),
                                 " is not divisible by --pipeline-model-parallel-size=", o.pp,
                                 " x --num-layers-per-virtual-pipeline-stage=", per_stage, " = ",
                                 o.pp * per_stage));
      const int v = counted / (o.pp * per_stage);
      if (virtual_size_ > 0 && virtual_size_ != v)
        throw ConfigError(concat(vp_name, "=", virtual_size_,
                                 " and --num-layers-per-virtual-pipeline-stage=", per_stage,
                                 " disagree (the latter means ", v, " chunks per rank); give one"));
      t.virtual_pipeline_size = v;
      t.virtual_option = "--num-layers-per-virtual-pipeline-stage";
    } else if (virtual_size_ > 0) {
      t.virtual_pipeline_size = virtual_size_;
      t.virtual_option = vp_name;
    }
    if (t.virtual_pipeline_size == 1 && (per_stage > 0 || virtual_size_ > 0))
      notes.run.push_back(
          per_stage > 0
              ? concat("--num-layers-per-virtual-pipeline-stage=", per_stage,
                       " makes one model chunk per pipeline rank (", m.num_layers, " layers / PP ",
                       o.pp, "): the plain 1F1B schedule runs, as in Megatron-LM")
              : concat(vp_name, "=1: one model chunk per pipeline rank, the plain 1F1B schedule"));
    // Every stage split is checked here, before any rank builds its shard.
    if (ps.uneven())
      split_stages(ps, m.num_layers, m.mtp() ? m.mtp_num_layers : 0, o.pp,
                   ps.layout.empty() ? t.virtual_pipeline_size : 0);
  }

  // The uneven-stage options' values (Megatron's: a count given must be >= 1) and what Megatron
  // refuses beside them.
  void resolve_schedule(const OptionParser& p, RunOptions& o) const {
    using detail::concat;
    TrainConfig& t = o.train;
    if (schedule_ != "1f1b" && schedule_ != "zero-bubble")
      throw ConfigError(concat("--pipeline-schedule=", schedule_,
                               " is not a schedule (allowed: 1f1b, zero-bubble)"));
    if (enable_zero_bubble_ && p.given("pipeline-schedule") && schedule_ != "zero-bubble")
      throw ConfigError(concat("--enable-zero-bubble contradicts --pipeline-schedule=", schedule_,
                               ": give one of them"));
    t.zero_bubble = enable_zero_bubble_ || schedule_ == "zero-bubble";
    if (!t.zero_bubble) return;
    // PP 1 is refused with the layout (run/layout.cpp): tessera-plan searches PP with it given.
    const char* name =
        enable_zero_bubble_ ? "--enable-zero-bubble" : "--pipeline-schedule=zero-bubble";
    if (t.megatron_fsdp)
      throw ConfigError(concat(name,
                               " does not combine with --use-megatron-fsdp (FSDP frees a "
                               "piece's gathered gradients before its W pass): use "
                               "--use-distributed-optimizer, or --pipeline-schedule=1f1b"));
  }

  void resolve_split(const OptionParser& p, RunOptions& o, int per_stage) const {
    using detail::concat;
    PipelineSplitOptions& ps = o.train.pipeline_split;
    for (const auto& [name, v] :
         {std::pair<const char*, int>{"decoder-first-pipeline-num-layers", first_},
          {"decoder-last-pipeline-num-layers", last_}})
      if (p.given(name) && v < 1)
        throw ConfigError(concat("--", name, "=", v, " is out of range (allowed: >= 1)"));
    ps.first = first_;
    ps.last = last_;
    if (p.given("pipeline-model-parallel-layout") && ps.layout.empty())
      throw ConfigError(
          "--pipeline-model-parallel-layout is empty (give the stages' layers, "
          "e.g. \"Ett|ttL\")");
    if (!ps.layout.empty() && per_stage > 0)
      throw ConfigError(
          "--num-layers-per-virtual-pipeline-stage cannot be given with "
          "--pipeline-model-parallel-layout (the layout's stages / PP are the virtual stages; "
          "as Megatron-LM)");
    if ((ps.first > 0 || ps.last > 0) && per_stage > 0)
      throw ConfigError(concat(
          "--num-layers-per-virtual-pipeline-stage cannot be given with uneven stages (",
          ps.first > 0 ? "--decoder-first-pipeline-num-layers"
                       : "--decoder-last-pipeline-num-layers",
          "): give the virtual stages per rank with --num-virtual-stages-per-pipeline-rank, as "
          "Megatron-LM asks"));
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    if (s != DryRunSection::Layout) return;
    const RunOptions& o = d.o;
    const GridLayout& layout = d.layout;
    char buf[400];
    std::snprintf(
        buf, sizeof buf,
        "layout: world %d = TP %d x%s PP %d x DP %d%s%s; global batch %d = micro-batch %d x "
        "%d micro-batches x DP %d\n",
        d.world, layout.tp, layout.cp > 1 ? detail::concat(" CP ", layout.cp, " x").c_str() : "",
        layout.pp, layout.dp,
        o.ep > 1 ? detail::concat(" (EP ", o.ep, " x expert-data-parallel ", layout.dp / o.ep, ")")
                       .c_str()
                 : "",
        d.world_assumed ? " (assumed: give --world-size, or run under mpirun, for another DP)" : "",
        o.train.global_batch(layout.dp), o.train.micro_batch_size,
        o.train.num_micro_batches(layout.dp), layout.dp);
    out << buf;
    if (o.train.pipeline_split.uneven()) split_line(d, out);
    if (layout.cp > 1) context_parallel_line(d, out);
    if (o.train.zero_bubble)
      out << "pipeline schedule: zero-bubble (ZB-H1): each backward split into B (input "
             "gradients) and W (weight gradients), W passes held back to fill the bubble (how many "
             "per stage below); the same losses as 1F1B\n";
  }

  // The stages of an uneven split, as Megatron's pretty_repr groups them: each pipeline rank's
  // virtual stages (";" between them), equal neighbouring ranks together.
  static void split_line(const DryRunContext& d, std::ostream& out) {
    const RunOptions& o = d.o;
    const PipelineSplitOptions& ps = o.train.pipeline_split;
    const int pp = d.layout.pp;
    const std::vector<StageSpan> spans =
        split_stages(ps, o.model.num_layers, o.model.mtp() ? o.model.mtp_num_layers : 0, pp,
                     ps.layout.empty() ? o.train.virtual_pipeline_size : 0);
    const int V = static_cast<int>(spans.size()) / pp;
    std::vector<std::string> rows;
    for (int r = 0; r < pp; ++r) {
      std::string row;
      for (int c = 0; c < V; ++c)
        row += (c ? "; " : "") + describe_stage(spans[static_cast<size_t>(c * pp + r)]);
      rows.push_back(row);
    }
    std::string line;
    for (int r = 0; r < pp;) {
      int e = r;
      while (e + 1 < pp && rows[static_cast<size_t>(e + 1)] == rows[static_cast<size_t>(r)]) ++e;
      line += detail::concat(line.empty() ? "" : " | ", e > r ? "PP ranks " : "PP rank ", r,
                             e > r ? detail::concat("-", e) : std::string(), ": ",
                             rows[static_cast<size_t>(r)]);
      r = e + 1;
    }
    const std::string source =
        !ps.layout.empty()            ? "--pipeline-model-parallel-layout \"" + ps.layout + "\""
        : ps.first > 0 || ps.last > 0 ? std::string("--decoder-first/last-pipeline-num-layers")
                                      : std::string("the embedding and loss counted as layers");
    out << "pipeline split (" << source << "; " << V << " virtual stage" << (V > 1 ? "s" : "")
        << " per rank): " << line << "\n";
  }

 private:
  void resolve_sharding(const OptionParser& p, RunOptions& o, StartupNotes& notes) const {
    using S = TrainConfig::DpSharding;
    TrainConfig& t = o.train;
    if (sharding_ == "no_shard")
      t.dp_sharding = S::NoShard;
    else if (sharding_ == "optim")
      t.dp_sharding = S::Optim;
    else if (sharding_ == "optim_grads")
      t.dp_sharding = S::OptimGrads;
    else if (sharding_ == "optim_grads_params")
      t.dp_sharding = S::OptimGradsParams;
    else
      throw ConfigError("--data-parallel-sharding-strategy=" + sharding_ +
                        " is not a strategy (allowed: no_shard, optim, optim_grads, "
                        "optim_grads_params)");
    if (!t.megatron_fsdp) {
      if (p.given("data-parallel-sharding-strategy"))
        throw ConfigError(
            "--data-parallel-sharding-strategy needs --use-megatron-fsdp (without it, "
            "--use-distributed-optimizer shards the optimizer state)");
      return;
    }
    // Megatron-FSDP's sharding strategies above no_shard run on the distributed optimizer
    // (Megatron asks for --use-distributed-optimizer with them; here the strategy implies it).
    if (t.dp_sharding != S::NoShard) t.use_distributed_optimizer = true;
    if (t.dp_sharding == S::NoShard && t.use_distributed_optimizer) {
      t.use_distributed_optimizer = false;
      notes.run.push_back(
          "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard keeps the optimizer "
          "state whole, as DDP does: --use-distributed-optimizer has no effect under it (optim "
          "or higher shards it)");
    }
  }

  // --num-distributed-optimizer-instances and --outer-dp-sharding-strategy (HSDP), after
  // resolve_sharding settled whether the distributed optimizer runs.
  void resolve_instances(const OptionParser& p, RunOptions& o) const {
    using detail::concat;
    TrainConfig& t = o.train;
    if (outer_sharding_ != "no_shard" && outer_sharding_ != "optim")
      throw ConfigError("--outer-dp-sharding-strategy=" + outer_sharding_ +
                        " is not a strategy (allowed: no_shard, optim)");
    t.outer_dp_shards_optim = outer_sharding_ == "optim";
    if (t.dist_opt_instances < 1)
      throw ConfigError(concat("--num-distributed-optimizer-instances=", t.dist_opt_instances,
                               " is out of range (allowed: >= 1)"));
    if (p.given("outer-dp-sharding-strategy") && !t.megatron_fsdp)
      throw ConfigError(
          "--outer-dp-sharding-strategy needs --use-megatron-fsdp (HSDP; without FSDP, "
          "--num-distributed-optimizer-instances alone replicates the distributed optimizer)");
    if (t.dist_opt_instances > 1 && !t.use_distributed_optimizer)
      throw ConfigError(concat(
          "--num-distributed-optimizer-instances=", t.dist_opt_instances,
          " needs a sharded optimizer: --use-distributed-optimizer, or --use-megatron-fsdp with "
          "a --data-parallel-sharding-strategy above no_shard"));
    if (t.outer_dp_shards_optim) {
      if (t.dp_sharding != TrainConfig::DpSharding::OptimGradsParams)
        throw ConfigError(
            "--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy "
            "optim_grads_params (outer sharding cuts the inner shards again, as Megatron-FSDP "
            "does)");
      if (t.dist_opt_instances == 1)
        throw ConfigError(
            "--outer-dp-sharding-strategy optim needs --num-distributed-optimizer-instances > 1 "
            "(the instances it shards the optimizer state over)");
      if (t.optimizer == "muon")
        throw ConfigError(
            "--outer-dp-sharding-strategy optim does not run with --optimizer muon (Muon makes "
            "each matrix whole from one instance's shards); use no_shard");
    }
  }

  static void context_parallel_line(const DryRunContext& d, std::ostream& out) {
    const GridLayout& layout = d.layout;
    const RingTraffic ring = cp_ring_traffic(d.o.model, d.o.train, layout.tp, layout.cp);
    const int S = d.o.model.seq_length, c = S / (2 * layout.cp);
    char recomputed[64] = "";
    if (ring.recompute > 0)
      std::snprintf(recomputed, sizeof recomputed, " + %.2f MiB recomputed",
                    ring.recompute / (1024.0 * 1024.0));
    char buf[400];
    std::snprintf(buf, sizeof buf,
                  "context parallelism: CP %d; each rank holds %d of the %d tokens of a sample "
                  "(chunks r and %d-r of %d tokens); per-token activations / %d; ring per layer "
                  "per micro-batch: K/V block %.2f MiB, sent %.2f MiB forward + %.2f MiB "
                  "backward%s = %.2f MiB per rank\n",
                  layout.cp, S / layout.cp, S, 2 * layout.cp - 1, c, layout.cp,
                  ring.block / (1024.0 * 1024.0), ring.forward / (1024.0 * 1024.0),
                  ring.backward / (1024.0 * 1024.0), recomputed,
                  ring.per_layer() / (1024.0 * 1024.0));
    out << buf;
  }

  std::string cp_comm_type_, sharding_, outer_sharding_;
  int virtual_size_ = 0, layers_per_virtual_stage_ = 0, virtual_stages_ = 0;
  int first_ = 0, last_ = 0;         // --decoder-first/last-pipeline-num-layers (0: not given)
  std::string schedule_;             // --pipeline-schedule
  bool enable_zero_bubble_ = false;  // --enable-zero-bubble
};

}  // namespace

std::unique_ptr<OptionGroup> make_parallelism_options() {
  return std::make_unique<ParallelismOptions>();
}

}  // namespace tessera
