// options.cpp: parse_run_options, a loop over the option groups of options/, and the
// --dry-run report, which each group writes its part of.
#include "options/options.hpp"

#include <sstream>

#include "comm/grid_layout.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "run/layout.hpp"

namespace tessera {

namespace {

// The checks of the whole configuration, once every group has resolved its part; and the
// options' text that every checkpoint stores.
void check_run(const OptionParser& p, RunOptions& o, const RunOptionsProgram& program) {
  TrainConfig& t = o.train;
  t.config_text = p.to_ini();
  GPTConfig check = o.model;
  if (check.vocab_size == 0) check.vocab_size = 2;  // known once the shards are open
  check.validate();
  if (program.data_only) {
    TrainConfig c = t;  // the micro-batch is the trainer's business: any global batch works
    c.micro_batch_size = 1;
    c.drop_lr_schedule();  // nor is the learning rate
    c.validate(1);
  } else {
    t.validate(1);
  }
  if (!t.dry_run && !o.skip_train && t.train_iters <= 0 && t.train_samples <= 0)
    throw ConfigError(
        "give the length of the run: --train-iters N or --train-samples N (as in Megatron-LM; "
        "--dry-run and --skip-train need neither)");
}

}  // namespace

bool parse_run_options(int argc, const char* const* argv, RunOptions& o,
                       const RunOptionsProgram& program) {
  auto parser = std::make_shared<OptionParser>(program.name, program.usage);
  OptionParser& p = *parser;
  o.resolve_device = program.resolve_device;
  o.with_origins = [parser](const std::string& message) { return parser->with_origins(message); };
  const std::vector<std::unique_ptr<OptionGroup>> groups = make_option_groups();
  for (const auto& g : groups) g->add(p, o);
  if (program.add_options) program.add_options(p);
  for (const auto& g : groups) g->check_argv(argc, argv);
  if (!p.parse(argc, argv)) return false;
  StartupNotes notes;
  for (const auto& g : groups) g->resolve(p, o, notes);
  for (const auto& g : groups) g->resolve_late(p, o, notes);
  o.notes = p.replaced();
  o.notes.insert(o.notes.end(), notes.input.begin(), notes.input.end());
  o.notes.insert(o.notes.end(), notes.run.begin(), notes.run.end());
  check_run(p, o, program);
  return true;
}

std::string dry_run_report(const RunOptions& o, int world_size) {
  const int world = o.world_size > 0 ? o.world_size
                    : world_size > 1 ? world_size
                                     : o.tp * o.cp * o.pp * o.ep;
  const GridLayout layout = GridLayout::make(world, o.tp, o.pp, o.cp);
  // The dry run's layout checks (a real start makes them on its ProcessGrid).
  check_expert_parallel(layout, o.ep);
  check_optimizer_instances(layout, o.ep, o.train.dist_opt_instances);
  validate_layout(o.model, o.train, layout.tp, layout.pp, layout.dp, layout.cp);
  const std::vector<std::unique_ptr<OptionGroup>> groups = make_option_groups();
  DryRunContext d{o, world, o.world_size <= 0 && world_size <= 1, layout};
  std::ostringstream os;
  for (DryRunSection s : {DryRunSection::Totals, DryRunSection::Setup, DryRunSection::Layout})
    for (const auto& g : groups) g->dry_run(s, d, os);
  for (int stage = 0; stage < layout.pp; ++stage) {
    ParallelContext ctx;
    ctx.tp_size = layout.tp;
    ctx.pp_size = layout.pp;
    ctx.pp_rank = stage;
    ctx.cp_size = layout.cp;
    const ModelShard shard = make_model_shard(o.model, ctx, o.train);
    const MemoryEstimate e = estimate_rank_memory(o.model, o.train, layout, stage, o.ep);
    d.stage = stage;
    d.shard = &shard;
    d.estimate = &e;
    for (DryRunSection s : {DryRunSection::Stage, DryRunSection::StageDetail})
      for (const auto& g : groups) g->dry_run(s, d, os);
  }
  d.stage = -1;
  d.shard = nullptr;
  d.estimate = nullptr;
  for (const auto& g : groups) g->dry_run(DryRunSection::Verdict, d, os);
  return os.str();
}

}  // namespace tessera
