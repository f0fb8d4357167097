// checkpointer.hpp: the training run's checkpoints: the --save pre-flight, synchronous and
// background (--async-save) saves with the expert gather of expert parallelism, the agreed commit
// (DESIGN.md invariant 6), saves when due, and loading whatever layout a checkpoint was saved
// with (the model, the optimizer state and where training stood).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "checkpoint/checkpoint.hpp"
#include "comm/communicator.hpp"
#include "model/gpt.hpp"
#include "run/train_config.hpp"
#include "step/optimizer_set.hpp"
#include "step/step_stats.hpp"
#include "step/timers.hpp"
#include "train/rerun_tracker.hpp"

namespace tessera {

class TrainingCheckpointer {
 public:
  // Collective: with --save, rank 0 checks the directory now (an unwritable --save is a
  // ConfigError on every rank before training, not after hours of it).
  TrainingCheckpointer(GPTModel& model, Backend& be, const TrainConfig& cfg,
                       const ParallelContext& ctx, OptimizerSet& optimizers,
                       IterationTimers& timers, const std::function<void(int64_t)>& on_progress);
  ~TrainingCheckpointer();  // joins a writer still running (an error path: nothing commits)

  // Collective, after every iteration: a background save done on every rank commits, and a save
  // is due every --save-interval iterations.
  void after_iteration(const TrainState& state);
  // Collective: a checkpoint of `state` under `dir` (DESIGN.md invariant 6); throws Error (on
  // every rank) when any rank failed, with the previous checkpoint intact. With --async-save it
  // returns once the state is staged; the write commits later (after_iteration, the next save,
  // a load, wait()).
  void save(const std::string& dir, const TrainState& state);
  // Collective: the save at a stop (the end, a signal, --exit-interval) unless this iteration is
  // saved already; then waits for a background write and commits it.
  void save_at_stop(const TrainState& state);
  // Collective: a synchronous save of `state` with result validation's pending rerun (before
  // exit 16) under --save; returns the iteration directory.
  std::string save_for_rerun(TrainState state, const std::string& rerun_state);
  // Collective: waits for a background save to finish and commits it (throws Error like a
  // synchronous save that failed). Nothing to do without one.
  void wait();
  // Collective. Loads the checkpoint `dir` points to into the model and the optimizer set and
  // returns where training stood. model_only (--finetune): iteration, data position and optimizer
  // start fresh; without load_optimizer (--no-load-optim) only the optimizer (moments and step
  // count) does.
  TrainState load(const std::string& dir, bool model_only, bool load_optimizer);
  // Collective: load(), and when a file of that checkpoint is damaged (CheckpointDamaged on any
  // rank), the newest older checkpoint of the directory that verifies whole: loaded with
  // `fallback` (--load-fallback; said in the log and a LOAD_FALLBACK line of `tracker`), named in
  // an AgreedConfigError otherwise.
  TrainState load_checked(const std::string& dir, bool model_only, bool load_optimizer,
                          bool fallback, const RerunTracker& tracker);

 private:
  struct AsyncSave;
  struct SkipWrite {};  // an EP rank whose experts DP rank 0 writes
  CheckpointMeta make_meta(const TrainState& state) const;
  // This rank's part of a save: the distributed optimizer's gathered state, then (on the ranks
  // that write) the staged shard, written now or by the background thread. Returns the error.
  std::string write_shard(const std::string& path, const CheckpointMeta& meta, bool async);
  // The three flat states (parameters, exp_avg, exp_avg_sq) this rank writes, on the host.
  // The device state a save writes (master parameters, the replicated optimizer's moments; null
  // where the distributed optimizer gathers it or --no-save-optim drops it).
  void saved_states(Tensor* state[3]);
  void stage_states(bool async, std::vector<float> gathered[3], std::vector<float> staged[3],
                    const float* host[3]);
  // Expert parallelism, saving: `local` (this rank's flat states, null where absent) with every
  // expert of the EP group, in the layout of `specs` (expert-parallel size 1). Collective over
  // the EP group.
  void gather_experts(const float* const local[3], std::vector<ParamSpec>& specs,
                      std::vector<float> full[3]);
  // Collective: every rank's failure agreed; rank 0 commits the iteration directory (or abandons
  // it); throws Error naming the iteration when any rank failed.
  void commit(const std::string& dir, int64_t iteration, double failed, const std::string& error);
  // Collective: commits a background save once every rank's write is done (blocking: waits).
  void finish_async(bool blocking);
  void load_optimizer_state(CheckpointReader& r, bool optimizer);
  void log_loaded(const CheckpointReader& r, bool model_only, bool load_optimizer, double seconds,
                  int64_t iteration) const;

  GPTModel& model_;
  Backend& be_;
  const TrainConfig& cfg_;
  const ParallelContext& ctx_;
  OptimizerSet& optimizers_;
  IterationTimers& timers_;
  const std::function<void(int64_t)>& on_progress_;  // the trainer's, set after construction
  std::vector<ParamSpec> ep_specs_;   // expert parallelism: the specs with every expert
  std::unique_ptr<AsyncSave> async_;  // --async-save: staging buffers and the writer
  bool async_pending_ = false;        // a background save not yet committed (every rank alike)
  int64_t last_saved_ = -1;           // the iteration of the last save or load
};

}  // namespace tessera
