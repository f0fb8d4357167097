// tessera-train: trains a GPT model with tensor, pipeline and data parallelism (see --help).
// Runs as a single process, under mpirun, or under srun; thin: parses options and calls lib/.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "backend/backend.hpp"
#include "comm/mpi/mpi.hpp"
#include "core/error.hpp"
#include "core/logging.hpp"
#include "data/dataset.hpp"
#include "options/options.hpp"
#include "run/memory_estimate.hpp"
#include "runtime/process_grid.hpp"
#include "runtime/select.hpp"
#include "train/metrics.hpp"
#include "train/rank_setup.hpp"
#include "train/result_validator.hpp"
#include "train/trainer.hpp"
#include "train/watchdog.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const bool root = mpi.world_rank() == 0;
  RunOptions opts;
  try {
    // Every rank parses and validates the same input; only rank 0 reports, all exit 2.
    RunOptionsProgram program;
    program.resolve_device = [](const RunOptions& o, const std::string& host) -> std::string {
      // A plan made on a login node (--dry-run --device cuda) needs no GPU there.
      if (o.train.dry_run && o.device == "cuda" && visible_gpus() == 0) return "cuda";
      return resolve_device(o.device, host);
    };
    if (!parse_run_options(argc, argv, opts, program)) return 0;
    opts.launch_rank = mpi.world_rank();
    opts.launch_world = mpi.world_size();
    std::unique_ptr<TokenDataset> data = open_train_data(opts);
    const bool evaluating = opts.skip_train || opts.train.eval_interval > 0;
    std::unique_ptr<TokenDataset> valid = evaluating ? open_valid_data(opts) : nullptr;
    if (opts.train.dry_run && root)
      for (const std::string& n : opts.notes)
        std::fprintf(stderr, "tessera-train: %s\n", n.c_str());
    if (opts.train.dry_run) {
      if (opts.device == "cuda" && !opts.cluster_spec) {  // the verdict against this host's GPU
        const MemoryCapacity gpu = visible_gpu_capacity();
        opts.local_gpu_bytes = gpu.bytes;
        opts.local_gpu = gpu.what;
      }
      if (root) std::cout << dry_run_report(opts, mpi.world_size());
      return 0;
    }
    ProcessGrid grid(opts.tp, opts.pp, opts.cp);
    validate_layout(opts.model, opts.train, opts.tp, opts.pp, grid.layout().dp, opts.cp);
    grid.use_expert_parallel(opts.ep);  // ConfigError when EP does not divide DP
    grid.use_optimizer_instances(opts.train.dist_opt_instances);  // HSDP's groups
    opts.log.rank = grid.world_rank();
    opts.log.host = grid.host();
    init_logging(opts.log);
    const int threads = opts.threads > 0 ? opts.threads : default_threads(grid.node_comm());
    set_num_threads(threads);
    const std::string table = grid.layout_table();
    auto backend = make_rank_backend(grid, opts.device, opts.train.virtual_pipeline_size > 1,
                                     opts.ranks_per_gpu);
    check_rank_memory(
        grid, *backend,
        estimate_rank_memory(opts.model, opts.train, grid.layout(), grid.coords().pp, opts.ep));
    std::string attention;
    try {  // a shape `--attention-backend fused` cannot run ends the job here, with cuDNN's reason
      backend->set_attention_backend(opts.attention_backend, opts.deterministic_mode);
      attention = backend->attention_plan(attention_call(opts));
    } catch (const ConfigError& e) {
      abort_job(e.what(), 2);
    }
    if (opts.train.peak_tflops <= 0)  // MFU against the device's peak where it is known
      opts.train.peak_tflops = backend_peak_tflops(*backend, opts.train.compute_dtype);
    ParallelContext ctx = grid.context();
    TLOG(info) << table << "tessera-train: " << opts.model.num_layers << " layers, hidden "
               << opts.model.hidden_size << ", " << opts.model.num_attention_heads << " heads, seq "
               << opts.model.seq_length << ", vocab " << opts.model.vocab_size << " (padded "
               << opts.model.padded_vocab_size(opts.tp) << "), " << opts.model.num_parameters()
               << " parameters (" << opts.model.describe() << "); backend "
               << backend_description(*backend) << ", " << threads << " threads per rank";
    TLOG(info) << "attention: "
               << (opts.cp > 1 ? "context parallelism's ring blocks on Tessera's flash kernels in "
                                 "ring mode where they apply (cuDNN's graph has no ring block)"
                               : attention);
    for (const std::string& line : data_report(*data, opts.train, ctx.dp_size)) TLOG(info) << line;
    if (valid && !opts.mock_data)  // the evaluation's data, as the training's
      TLOG(info) << "validation data: " << valid->describe() << " (" << valid->num_samples()
                 << " samples)";
    for (const std::string& n : opts.notes) TLOG(info) << n;
    if (const std::string w = warmup_past_the_run(opts.train.resolved(ctx.dp_size));
        !w.empty() && grid.world_rank() == 0)
      TLOG(warning) << w;
    install_stop_signals();
    Watchdog watchdog(opts.train.distributed_timeout_minutes, MPI_COMM_WORLD);
    Trainer trainer(opts.model, opts.train, *backend, *data, ctx);
    trainer.on_progress = [&](int64_t it) { watchdog.progress(it); };
    const std::vector<int64_t>& ramp = opts.train.rampup_batch_size;
    TLOG(info) << "global batch " << trainer.step_global_batch() << " = "
               << trainer.num_micro_batches() << " micro-batches of " << opts.train.micro_batch_size
               << " x DP " << ctx.dp_size
               << (ramp.size() == 3
                       ? " at first (--rampup-batch-size: +" + std::to_string(ramp[1]) +
                             " in equal parts of the first " + std::to_string(ramp[2]) +
                             " samples, up to " +
                             std::to_string(opts.train.global_batch(ctx.dp_size)) + "; " +
                             std::to_string(trainer.config().train_iters) + " iterations)"
                       : std::string())
               << "; " << (opts.train.virtual_pipeline_size > 1 ? "interleaved 1F1B" : "1F1B")
               << " pipeline"
               << (opts.train.virtual_pipeline_size > 1
                       ? " (" + std::to_string(opts.train.virtual_pipeline_size) +
                             " model chunks per rank)"
                       : std::string())
               << " bubble (theoretical) "
               << theoretical_bubble(ctx.pp_size, trainer.num_micro_batches(),
                                     std::max(1, opts.train.virtual_pipeline_size))
               << "; sequence parallelism " << (opts.train.sequence_parallel ? "on" : "off")
               << "; activation recomputation: " << opts.train.recompute.describe()
               << "; optimizer: "
               << (opts.train.optimizer == "muon" ? "Muon (AdamW for the rest), " : "")
               << describe_dp_sharding(opts.train, ctx.dp_size, ctx.cp_size);
    if (!opts.load.empty() && !opts.load_fresh) {
      try {
        trainer.load_checkpoint(opts.load, opts.finetune, !opts.no_load_optim, opts.load_fallback);
        watchdog.progress(trainer.iteration());
      } catch (const AgreedConfigError&) {
        throw;  // every rank has it (a damaged checkpoint): rank 0's line, exit 2
      } catch (const ConfigError& e) {
        abort_job(e.what(), 2);  // may fail on some ranks only: say which, and end the job
      }
    }
    if (opts.skip_train) {
      const double l = trainer.evaluate(*valid, 0, opts.train.eval_iters);
      TLOG(info) << validation_loss_text("iteration " + std::to_string(trainer.iteration()), l);
      return 0;
    }
    try {
      trainer.train(valid.get());
    } catch (const RerunExit& e) {
      // Result validation ends the run on every rank together (exit 16: its checkpoint is saved).
      trainer.wait_for_saves();
      if (root) TLOG(error) << "result validation: exit " << e.code() << ": " << e.what();
      return e.code();
    } catch (const AgreedConfigError&) {
      // Every rank stops here together (a bad sample): a background save that was writing is
      // finished and committed first, then a clean exit 2 with rank 0's line.
      trainer.wait_for_saves();
      throw;
    } catch (const std::exception& e) {
      // End the job before the trainer's destructors wait on transfers peers will never match.
      abort_job(e.what());
    }
    if (trainer.stopped_by_signal())
      TLOG(info) << "stopped by signal " << trainer.stopped_by_signal() << " after "
                 << trainer.iteration() << " iterations, " << trainer.consumed_samples()
                 << " samples; exiting cleanly";
    else
      TLOG(info) << "training finished after " << trainer.iteration() << " iterations, "
                 << trainer.consumed_samples() << " samples";
    // Megatron's evaluation at the end of training: the validation split where the periodic
    // evaluations stopped, and the test split from its start (when it has samples).
    if (valid && !trainer.stopped_by_signal() &&
        trainer.iteration() >= trainer.config().train_iters) {
      std::unique_ptr<TokenDataset> test = open_test_data(opts);
      if (test && !opts.mock_data)
        TLOG(info) << "test data: " << test->describe() << " (" << test->num_samples()
                   << " samples)";
      const std::pair<const char*, const TokenDataset*> splits[] = {{"val", valid.get()},
                                                                    {"test", test.get()}};
      for (const auto& [name, ds] : splits) {
        if (!ds) continue;
        const double l = std::string(name) == "val"
                             ? trainer.evaluate_at_end(*ds)
                             : trainer.evaluate(*ds, 0, opts.train.eval_iters);
        const std::string line =
            validation_loss_text(std::string("the end of training for ") + name + " data", l) +
            " | ";
        const std::string rule(line.size(), '-');
        TLOG(info) << rule << "\n" << line << "\n" << rule;
      }
    }
  } catch (const ConfigError& e) {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    // Options the message names that came from --config are said to come from there.
    const std::string what = opts.with_origins ? opts.with_origins(e.what()) : e.what();
    if (root) std::fprintf(stderr, "rank 0 (%s): error: %s\n", host, what.c_str());
    return 2;
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
  return 0;
}
