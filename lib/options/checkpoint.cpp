// checkpoint.cpp: the checkpoint and evaluation options (--save, --load and how much of it,
// --use-checkpoint-args, exit conditions, evaluation) and their checks.
#include <cstdio>
#include <filesystem>

#include "checkpoint/checkpoint.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

std::string no_checkpoint_in(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return "it does not exist yet";
  if (!fs::is_directory(dir, ec)) return "";  // resolve_checkpoint_dir says what is wrong
  int others = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    long long it = 0;
    char tail = 0;
    const bool iteration_dir = std::sscanf(name.c_str(), "iter_%lld%c", &it, &tail) == 1;
    if (name == "latest_checkpointed_iteration.txt" || iteration_dir ||
        name.rfind("mp_rank_", 0) == 0)
      return "";
    ++others;
  }
  if (ec) return "";  // unreadable: loading reports it
  return others == 0 ? "it is empty" : "it holds no latest_checkpointed_iteration.txt or iter_N";
}

namespace {

class CheckpointOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    TrainConfig& t = o.train;
    p.group("Checkpoints and evaluation")
        .add_options()(
            "save", po::value(&t.save),
            "directory for checkpoints (iter_NNNNNNN/ and latest_checkpointed_iteration.txt)")(
            "save-interval", po::value(&t.save_interval)->default_value(0),
            "iterations between checkpoints (0: only at the end)")(
            "keep-checkpoints", po::value(&t.keep_checkpoints)->default_value(0),
            "keep the newest N checkpoints (0: all)")(
            "load", po::value(&o.load),
            "checkpoint directory to resume from (any TP/PP layout; resharded on load)")(
            "finetune", po::bool_switch(&o.finetune),
            "with --load: take the model only; iteration, data position and optimizer start fresh")(
            "no-load-optim", po::bool_switch(&o.no_load_optim),
            "with --load: leave out the optimizer state (Adam moments, step count and "
            "learning-rate "
            "warm-up start fresh; iteration and data position are loaded)")(
            "load-fallback", po::bool_switch(&o.load_fallback),
            "with --load: when a file of the newest checkpoint fails its checksum, load the newest "
            "older checkpoint that verifies instead (said in the log and the tracker file)")(
            "no-load-rng", po::bool_switch(),
            "accepted for Megatron-LM's scripts: there is no RNG state to load (initialization and "
            "dropout masks are functions of --seed, the iteration and global coordinates)")(
            "no-save-optim", po::bool_switch(&t.no_save_optim),
            "save checkpoints without the optimizer state (a third of the size; a resume then "
            "starts Adam from zero)")(
            "async-save", po::bool_switch(&t.async_save),
            "save checkpoints in the background: the loop blocks only while the state is copied to "
            "host memory; the write commits when every rank has finished")(
            "use-checkpoint-args", po::bool_switch(&o.use_checkpoint_args),
            "with --load: take the model's options (layers, hidden size, heads, sequence length, "
            "vocabulary, architecture) from the checkpoint instead of the command line")(
            "exit-interval", po::value(&t.exit_interval)->default_value(0),
            "stop (after saving) once the iteration is divisible by this (0: never)")(
            "exit-duration-in-mins", po::value(&t.exit_duration_mins)->default_value(0.0),
            "stop (after saving) once training has run this long (0: never)")(
            "eval-interval", po::value(&t.eval_interval)->default_value(0),
            "iterations between evaluations on the validation data (0: none)")(
            "eval-iters", po::value(&t.eval_iters)->default_value(10),
            "global batches per evaluation; each evaluation continues through the validation split "
            "where the previous one stopped")(
            "full-validation", po::bool_switch(&t.full_validation),
            "evaluate every whole global batch of the validation split each time")(
            "skip-train", po::bool_switch(&o.skip_train),
            "do not train: evaluate --eval-iters batches (after --load) and exit");
  }

  void resolve(const OptionParser&, RunOptions& o, StartupNotes& notes) override {
    const TrainConfig& t = o.train;
    if (t.async_save && t.save.empty())
      throw ConfigError("--async-save needs --save (there is nothing to save in the background)");
    if (o.finetune && o.load.empty()) throw ConfigError("--finetune needs --load");
    if (o.no_load_optim && o.load.empty()) throw ConfigError("--no-load-optim needs --load");
    if (t.full_validation && o.mock_data)  // mock_data: resolved by the data group
      throw ConfigError("--full-validation needs --data-path (mock data has no end)");
    if (!o.load.empty()) {
      const std::string why = no_checkpoint_in(o.load);
      if (!why.empty()) {
        o.load_fresh = true;
        notes.run.push_back(
            "--load '" + o.load + "' holds no checkpoint yet (" + why +
            "): training starts from iteration 0, as in Megatron-LM" +
            (o.use_checkpoint_args ? "; the model's options come from the command line" : ""));
      }
    }
    if (o.use_checkpoint_args && !o.load_fresh) {
      if (o.load.empty()) throw ConfigError("--use-checkpoint-args needs --load");
      // Megatron's load_args_from_checkpoint: the model's shape and architecture are the
      // checkpoint's; the training choices stay this run's (dropout, the MoE losses' weights and
      // balancing, the expert bias's rate, how tokens are dispatched, the MTP loss's weight).
      GPTConfig& m = o.model;
      GPTConfig from = CheckpointReader(o.load).meta().model;
      from.attention_dropout = m.attention_dropout;
      from.hidden_dropout = m.hidden_dropout;
      from.moe_aux_loss_coeff = m.moe_aux_loss_coeff;
      from.moe_z_loss_coeff = m.moe_z_loss_coeff;
      from.moe_router_load_balancing_type = m.moe_router_load_balancing_type;
      from.moe_router_bias_update_rate = m.moe_router_bias_update_rate;
      from.moe_token_dispatcher_type = m.moe_token_dispatcher_type;
      from.moe_grouped_gemm = m.moe_grouped_gemm;
      from.moe_expert_capacity_factor = m.moe_expert_capacity_factor;
      from.moe_token_drop_policy = m.moe_token_drop_policy;
      from.mtp_loss_scaling_factor = m.mtp_loss_scaling_factor;
      m = from;
    }
  }
};

}  // namespace

std::unique_ptr<OptionGroup> make_checkpoint_options() {
  return std::make_unique<CheckpointOptions>();
}

}  // namespace tessera
