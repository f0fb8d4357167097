// memory.cpp: the activation-recomputation options (Megatron's --recompute-* and the older
// --checkpoint-activations), their checks, and the memory estimate's --dry-run lines.
#include <cstdio>
#include <ostream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

RecomputeConfig recompute_options(const std::string& granularity, const std::string& method,
                                  int num_layers, bool checkpoint_activations,
                                  int checkpoint_num_layers) {
  using detail::concat;
  RecomputeConfig rc;
  if (checkpoint_activations) {  // Megatron's older spelling of full + uniform
    if (!granularity.empty() && granularity != "full")
      throw ConfigError(
          "--checkpoint-activations means --recompute-granularity full; it was "
          "given with --recompute-granularity " +
          granularity + " (give one of them)");
    if (!method.empty() && method != "uniform")
      throw ConfigError(
          "--checkpoint-activations means --recompute-method uniform; it was given "
          "with --recompute-method " +
          method + " (use --recompute-granularity full for block)");
    rc.granularity = RecomputeGranularity::Full;
  } else if (checkpoint_num_layers > 0) {
    throw ConfigError(concat("--checkpoint-num-layers=", checkpoint_num_layers,
                             " needs --checkpoint-activations"));
  }
  if (!granularity.empty()) rc.granularity = parse_recompute_granularity(granularity);
  if (!method.empty()) {
    if (!rc.full())
      throw ConfigError("--recompute-method=" + method +
                        " needs --recompute-granularity full (selective recomputes every layer)");
    rc.method = parse_recompute_method(method);
  }
  if (checkpoint_num_layers > 0 && num_layers > 0 && checkpoint_num_layers != num_layers)
    throw ConfigError(concat("--checkpoint-num-layers=", checkpoint_num_layers,
                             " and --recompute-num-layers=", num_layers, " disagree; give one"));
  if (num_layers < 0)
    throw ConfigError(
        concat("--recompute-num-layers=", num_layers, " is out of range (allowed: >= 1)"));
  if (checkpoint_num_layers < 0)
    throw ConfigError(concat("--checkpoint-num-layers=", checkpoint_num_layers,
                             " is out of range (allowed: >= 1)"));
  const int n = num_layers > 0 ? num_layers : checkpoint_num_layers;
  const char* name = num_layers > 0 ? "--recompute-num-layers" : "--checkpoint-num-layers";
  if (n > 0 && !rc.full())
    throw ConfigError(concat(name, "=", n, " needs --recompute-granularity full"));
  if (n > 0 && num_layers <= 0) rc.num_layers_option = name;
  if (n > 0) rc.num_layers = n;
  return rc;
}

namespace {

class MemoryOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions&) override {
    p.group("Memory").add_options()(
        "recompute-granularity", po::value(&recompute_granularity_),
        "recompute activations in the backward instead of storing them: full (only "
        "each chunk's input is kept) | selective (the LayerNorm, attention core and "
        "GELU outputs are recomputed); bitwise the same results")(
        "recompute-method", po::value(&recompute_method_),
        "with full: uniform (the stage's layers in chunks of --recompute-num-layers; the "
        "default) | block (only the first --recompute-num-layers layers of each stage)")(
        "recompute-num-layers", po::value(&recompute_num_layers_)->default_value(0),
        "with full: layers per chunk (uniform) or recomputed layers per stage (block); "
        "default 1")("checkpoint-activations", po::bool_switch(&checkpoint_activations_),
                     "older name of --recompute-granularity full --recompute-method uniform")(
        "checkpoint-num-layers", po::value(&checkpoint_num_layers_)->default_value(0),
        "older name of --recompute-num-layers")(
        "recompute-activations", po::bool_switch(&recompute_activations_),
        "Megatron's shorthand for --recompute-granularity selective");
    p.alternatives({"recompute-granularity", "checkpoint-activations"});
    p.alternatives({"recompute-granularity", "recompute-activations"});
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes& notes) override {
    // A command line that switches the config file's full recomputation to selective (or none)
    // drops the file's full-only settings, as an alternative would.
    const bool switched =
        (p.given("recompute-granularity") && !p.from_config_file("recompute-granularity") &&
         recompute_granularity_ != "full") ||
        (recompute_activations_ && !p.from_config_file("recompute-activations"));
    for (const char* full_only : {"recompute-method", "recompute-num-layers"})
      if (switched && p.from_config_file(full_only)) {
        notes.input.push_back(std::string("--") + full_only +
                              " of the config file dropped: the command line's recomputation is "
                              "not full");
        if (std::string(full_only) == "recompute-method")
          recompute_method_.clear();
        else
          recompute_num_layers_ = 0;
      }
    if (recompute_activations_) {
      if (checkpoint_activations_)
        throw ConfigError(
            "--recompute-activations (selective) and --checkpoint-activations (full) both given; "
            "choose one");
      recompute_granularity_ = "selective";
    }
    o.train.recompute =
        recompute_options(recompute_granularity_, recompute_method_, recompute_num_layers_,
                          checkpoint_activations_, checkpoint_num_layers_);
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    const TrainConfig& t = d.o.train;
    if (s == DryRunSection::Setup)
      out << "activation recomputation: " << t.recompute.describe() << "; optimizer: "
          << (t.megatron_fsdp || t.dist_opt_instances > 1
                  ? describe_dp_sharding(t, d.layout.dp, d.layout.cp)
              : t.use_distributed_optimizer ? "distributed (master weights and Adam moments of "
                                              "1/DP of the parameters per rank)"
                                            : "replicated on every DP rank")
          << "; sequence parallelism: " << (t.sequence_parallel ? "on" : "off") << "\n";
    else if (s == DryRunSection::Stage)
      stage_lines(d, out);
  }

 private:
  // One rank's memory in pipeline stage d.stage (run/memory_estimate.hpp).
  static void stage_lines(const DryRunContext& d, std::ostream& out) {
    auto gib = [](double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); };
    auto mib = [](double bytes) { return bytes / (1024.0 * 1024.0); };
    const ModelShard& shard = *d.shard;
    const MemoryEstimate& e = *d.estimate;
    const int64_t local = e.parameters;
    const int slots = e.slots;
    const double act = e.activation_bytes, p = e.param_bytes, g = e.grad_bytes,
                 adam = e.optimizer_bytes;
    char buf[400];
    std::snprintf(buf, sizeof buf,
                  "stage %d (layers %s%s%s%s): parameters per rank %lld | memory per rank (GiB): "
                  "parameters %.3f, gradients %.3f, optimizer state %.3f, activations %.3f "
                  "(%d micro-batch%s in flight%s), total %.3f\n",
                  d.stage, shard.describe_layers().c_str(),
                  shard.has_embedding ? ", embedding" : "", shard.has_head ? ", head" : "",
                  !shard.has_head && shard.mtp_count > 0
                      ? ", multi-token prediction with copies of the embedding and output layer"
                      : "",
                  (long long)local, gib(p), gib(g), gib(adam), gib(act), slots,
                  slots == 1 ? "" : "es", shard.num_chunks() > 1 ? " over its model chunks" : "",
                  gib(e.total_bytes() - e.fp8_state_bytes));
    out << buf;
    if (d.o.train.fsdp_shards_grads()) {
      std::snprintf(buf, sizeof buf,
                    "  Megatron-FSDP: %lld elements of the flat buffers per rank (its blocks); "
                    "units' pool %.0f bytes (%.3f GiB: gathered weights and unreduced gradients "
                    "at most at once, in the total)\n",
                    (long long)e.fsdp_shard_elements, e.fsdp_pool_bytes, gib(e.fsdp_pool_bytes));
      out << buf;
    }
    std::snprintf(buf, sizeof buf,
                  "  bytes per parameter %.1f (weights %.1f, gradients %.1f, optimizer %.1f) | "
                  "activations kept per layer per micro-batch %.2f MiB, shared working set %.2f "
                  "MiB\n",
                  (p + g + adam) / local, p / local, g / local, adam / local,
                  mib(e.activation_layer_bytes), mib(e.activation_shared_bytes));
    out << buf;
    if (d.o.train.zero_bubble) {
      std::snprintf(buf, sizeof buf,
                    "  zero-bubble: %s%d B pass%s' W operands held at most at once, %.2f MiB each "
                    "(the deferred GEMMs' inputs and output gradients), %.3f GiB in the "
                    "activations\n",
                    e.zb_held_passes > 0 ? "" : "each backward whole (as 1F1B's): ",
                    e.zb_held_passes, e.zb_held_passes == 1 ? "" : "es", mib(e.zb_pass_bytes),
                    gib(e.zb_held_passes * e.zb_pass_bytes));
      out << buf;
    }
    const int tp = d.layout.tp;
    if (tp > 1) {
      std::snprintf(buf, sizeof buf,
                    "  LayerNorm/dropout/residual regions per layer per micro-batch %.2f MiB "
                    "(%.2f MiB without sequence parallelism, %.2f MiB with it: / TP %d)\n",
                    mib(e.sp_region_layer_bytes), mib(e.sp_region_layer_bytes_without),
                    mib(e.sp_region_layer_bytes_without / tp), tp);
      out << buf;
    }
  }

  std::string recompute_granularity_, recompute_method_;
  int recompute_num_layers_ = 0, checkpoint_num_layers_ = 0;
  bool checkpoint_activations_ = false, recompute_activations_ = false;
};

}  // namespace

std::unique_ptr<OptionGroup> make_memory_options() {
  return std::make_unique<MemoryOptions>();
}

}  // namespace tessera
