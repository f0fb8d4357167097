// trainer.hpp: the training loop on one rank of the process grid. The trainer orchestrates; its
// components own the concerns (docs/architecture.md, "The training side"):
//   StepExecutor (step_executor.hpp)     this DP rank's slice of the global batch through the
//                                        pipeline schedule, activation slots, stage links
//   OptimizerSet (optimizer_set.hpp)     gradient reduction, loss scaling, norms, clipping,
//                                        schedules, AdamW or the distributed optimizer
//   TrainingStep (training_step.hpp)     an iteration's work on the model and the two above, in
//                                        the order the collective plan records it
//   TrainingCheckpointer (checkpointer.hpp)  saves (sync/async), commits, loads
//   TrainingMetrics (metrics.hpp)        the log line, the metrics file, TensorBoard
//   RunControl (run_control.hpp)         profiler window, stop signals, exits
//   ResultValidator (result_validator.hpp)  result checks, reruns, skipped iterations, exit 16/17
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/timer.hpp"
#include "data/dataset.hpp"
#include "model/gpt.hpp"
#include "run/layout.hpp"
#include "run/pipeline.hpp"
#include "run/train_config.hpp"
#include "step/dist_optimizer.hpp"
#include "step/loss_scaler.hpp"
#include "step/optimizer.hpp"
#include "step/step_stats.hpp"
#include "step/timers.hpp"

namespace tessera {

class OptimizerSet;
class StepExecutor;
struct TrainingStep;
class TrainingCheckpointer;
class TrainingMetrics;
class ResultValidator;

class Trainer {
 public:
  // The layout is checked once, before (validate_layout: the option parser, or the caller).
  Trainer(const GPTConfig& model_cfg, const TrainConfig& train_cfg, Backend& backend,
          TokenDataset& data, const ParallelContext& ctx = ParallelContext::single());
  ~Trainer();
  // The components keep references to the trainer's configuration, timers and on_progress.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  GPTModel& model() { return *model_; }
  // The training configuration in use (sample-based options resolved to iterations).
  const TrainConfig& config() const { return cfg_; }
  // Updates taken so far (skipped fp16 steps do not count).
  int64_t optimizer_steps() const;
  // With the distributed optimizer (null otherwise).
  DistributedAdamW* distributed_optimizer();
  // Completes an overlapped parameter gather (--overlap-param-gather), so every rank's compute
  // weights are the updated ones; nothing to do otherwise. Evaluation and saving call it.
  void sync_params();
  int64_t iteration() const { return state_.iteration; }
  int64_t consumed_samples() const { return state_.consumed_samples; }
  // Micro-batches per step at the current global batch (a ramp changes it; evaluation uses the
  // full global batch).
  int num_micro_batches() const;
  int step_global_batch() const;
  const LossScaler& loss_scaler() const;
  int64_t skipped_iterations() const;

  // Runs one iteration on the next global batch; every rank returns the same loss and norm.
  // An iteration to skip (--iterations-to-skip, the tracker file) consumes its samples without an
  // update. A result rejected by result validation reruns it in place; RerunExit (every rank) when
  // the run must end with exit 16 or 17 (docs/training.md, "Result validation and reruns"). With
  // --overlap-param-gather the updated weights may still be arriving when it returns: call
  // sync_params() before reading them directly.
  StepStats train_step();
  // Runs train_iters iterations with logging, evaluation (eval_data, when eval_interval > 0) and
  // checkpoints (--save); returns the stats of every iteration.
  std::vector<StepStats> train(const TokenDataset* eval_data = nullptr);

  // Called after every iteration and every checkpoint (the watchdog's progress mark).
  std::function<void(int64_t iteration)> on_progress;
  // The signal (SIGTERM, SIGUSR1) that stopped the last train() call early, or 0.
  int stopped_by_signal() const { return stopped_by_signal_; }

  // The periodic evaluation after `done` earlier ones: eval_iters global batches from where they
  // stopped (or the whole split with full_validation). Collective.
  double evaluate_next(const TokenDataset& data, int64_t done);
  // Megatron's "validation loss at the end of training": the evaluation that would follow the
  // last periodic one. Collective.
  double evaluate_at_end(const TokenDataset& data);
  // Mean loss per loss token over `iters` global batches of `data` starting at sample `first`,
  // forward only; the same value on every rank.
  // `batch_done` (optional) hears each global batch evaluated (done, of iters).
  double evaluate(const TokenDataset& data, int64_t first, int64_t iters,
                  const std::function<void(int64_t, int64_t)>& batch_done = nullptr);

  // Collective. Writes a checkpoint of the current state under `dir` (DESIGN.md invariant 6);
  // throws Error (on every rank) when any rank failed, with the previous checkpoint intact.
  // With --async-save it returns once the state is staged; the write continues in the
  // background and commits when every rank has finished (checked after each iteration of
  // train(), and before the next save, a load, a signal stop and the end of train()).
  void save_checkpoint(const std::string& dir);
  // Collective: waits for a background save to finish and commits it (throws Error like a
  // synchronous save that failed). Nothing to do without one.
  void wait_for_saves();
  // Collective. Loads the checkpoint `dir` points to, whatever layout it was saved with.
  // model_only (--finetune): iteration, data position and optimizer start fresh; without
  // load_optimizer (--no-load-optim) only the optimizer (moments and step count) does.
  // A damaged file (a checksum) is one error on every rank naming it and the newest older
  // checkpoint that verifies; with `fallback` (--load-fallback) that one is loaded instead.
  void load_checkpoint(const std::string& dir, bool model_only = false, bool load_optimizer = true,
                       bool fallback = false);

 private:
  // One run of the iteration's forward, backward and reductions: reduced[0] the global batch's
  // loss sum, then result validation's findings (ResultValidator::kFlags), summed over the ranks.
  void run_attempt(StepStats& st, int attempt, double tokens, const Timer& step, double* reduced);
  void progress(int64_t iteration) {
    if (on_progress) on_progress(iteration);
  }

  GPTConfig model_cfg_;
  TrainConfig cfg_;
  Backend& be_;
  TokenDataset& data_;
  ParallelContext ctx_;
  IterationTimers timers_;
  TrainState state_;
  int stopped_by_signal_ = 0;
  // The components, in the order they are built (and destroyed backwards).
  std::unique_ptr<GPTModel> model_;
  std::unique_ptr<OptimizerSet> optimizers_;
  std::unique_ptr<StepExecutor> executor_;
  std::unique_ptr<TrainingStep> step_;  // the iteration's work on the three above
  std::unique_ptr<TrainingCheckpointer> checkpointer_;
  std::unique_ptr<TrainingMetrics> metrics_;
  std::unique_ptr<ResultValidator> validator_;
};

}  // namespace tessera
