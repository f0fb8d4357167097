// option_group.hpp: one group of tessera-train's options (model, MoE, parallelism, ...): its
// options and alternatives, its checks, and its --dry-run lines, each group in its own file of
// options/. parse_run_options (options/options.cpp) runs the groups that
// make_option_groups() lists, in that order; a new group is a new file and a line in that list.
#pragma once

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "comm/grid_layout.hpp"
#include "core/config.hpp"
#include "model/gpt.hpp"
#include "run/memory_estimate.hpp"
#include "run/run_options.hpp"

namespace tessera {

class OptionParser;

// The start-up notes (RunOptions::notes) the groups add while they resolve: how the input was
// read (an option accepted without effect) comes first, after the config-file values the command
// line replaced, then what the run does (a blend of one dataset, a --load that starts fresh).
struct StartupNotes {
  std::vector<std::string> input, run;
};

// The parts of the --dry-run report, in the order they are printed; within a part, the groups
// print in list order.
enum class DryRunSection {
  Totals,       // what the model is: parameter counts
  Setup,        // how it runs: architecture, recomputation, optimizer
  Layout,       // how the ranks are laid out
  Stage,        // per pipeline stage: one rank's memory
  StageDetail,  // per pipeline stage: what a feature adds to the stage's figures (MoE's experts)
  Verdict,      // after the stages: whether the fullest rank fits (options/planning.cpp)
};

// What a group's --dry-run lines read. `stage`, `shard` and `estimate` are set for the stage parts.
struct DryRunContext {
  const RunOptions& o;
  int world = 1;  // ranks of the run (--world-size; assumed TP x CP x PP x EP when run alone)
  bool world_assumed = false;  // a single process: the world above is assumed
  GridLayout layout;
  int stage = -1;
  const ModelShard* shard = nullptr;
  const MemoryEstimate* estimate = nullptr;
};

class OptionGroup {
 public:
  virtual ~OptionGroup() = default;
  // Declares the group's options (in --help's order) with `o`'s fields or the group's own shadow
  // values as their targets, and the alternatives among them (OptionParser::alternatives).
  virtual void add(OptionParser& p, RunOptions& o) = 0;
  // Before parsing: what the parser would misreport (a negative blend weight reads as an option).
  virtual void check_argv(int /*argc*/, const char* const* /*argv*/) const {}
  // After parsing, in list order: the group's shadow values into `o`, and its own checks. A group
  // may read what the groups before it in the list resolved (e.g. evaluation reads the data
  // group's mock_data).
  virtual void resolve(const OptionParser& p, RunOptions& o, StartupNotes& notes) = 0;
  // After every group resolved, in list order: what needs a later group's result. It is a second
  // phase because the list order is --help's: --use-checkpoint-args (checkpoint group) replaces
  // the model after the parallelism group resolved, and the virtual pipeline size needs that
  // model's layers.
  virtual void resolve_late(const OptionParser& /*p*/, RunOptions& /*o*/, StartupNotes& /*notes*/) {
  }
  // The group's lines of one part of the --dry-run report.
  virtual void dry_run(DryRunSection /*s*/, const DryRunContext& /*d*/,
                       std::ostream& /*out*/) const {}
};

// Declares the model options of --help group `title` from the model's option table
// (model/config_schema.hpp) into parser group `g`, with `m`'s fields as their targets
// (options/model.cpp).
void declare_model_options(po::options_description& g, const std::string& title, GPTConfig& m);
// ConfigError for an option of group `title` given (command line or config file) although the
// model lacks the feature the group is about (`feature`, e.g. "--num-experts (a MoE model)"):
// it would be ignored. `except`: the options that choose the feature.
void refuse_unused_model_options(const OptionParser& p, const std::string& title, bool has,
                                 const std::string& feature,
                                 const std::vector<std::string>& except);

// The groups, in --help's order (options/groups.cpp).
std::vector<std::unique_ptr<OptionGroup>> make_option_groups();

}  // namespace tessera
