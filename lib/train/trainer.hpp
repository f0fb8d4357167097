// trainer.hpp: the training loop on one rank of the process grid: this DP rank's slice of the
// global batch -> micro-batches through the 1F1B pipeline schedule (gradients accumulate) ->
// tied-embedding and bucketed DP gradient reduction -> global grad norm, clipping -> AdamW ->
// log line and JSONL metrics.
#pragma once

#include <fstream>
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/tensorboard.hpp"
#include "data/dataset.hpp"
#include "data/prefetcher.hpp"
#include "model/gpt.hpp"
#include "train/dist_optimizer.hpp"
#include "train/grad_reducer.hpp"
#include "train/layout.hpp"
#include "train/loss_scaler.hpp"
#include "train/lr_schedule.hpp"
#include "train/optimizer.hpp"
#include "train/pipeline.hpp"
#include "train/timers.hpp"
#include "train/train_config.hpp"

namespace tessera {

struct StepStats {
  int64_t iteration = 0;
  double loss = 0;       // sum of token losses / loss tokens of the global batch
  double grad_norm = 0;  // before clipping
  double lr = 0;
  double weight_decay = 0;  // the decay of the weight matrices and embeddings this step
  double seconds = 0;
  int64_t loss_tokens = 0;
  double pipeline_wait_seconds = 0;  // blocked receiving from neighbouring stages (the bubble)
  double pipeline_seconds = 0;       // the whole schedule: forwards, backwards and waits
  double pipeline_start = 0;         // when the schedule started, seconds into the step
  double dp_wait_seconds = 0;        // waiting for data-parallel reductions after the backward
  double p2p_bytes = 0;              // sent to neighbouring stages by this rank
  double data_wait_seconds = 0;      // blocked waiting for this step's samples
  double loss_scale = 1;             // fp16: the scale this step's backward used
  bool skipped = false;              // fp16: gradients overflowed, no update (grad_norm is 0)
  int global_batch = 0;              // samples of this step (changes during a batch-size ramp)
  // MoE (Megatron's logged figures): the load-balancing loss and the z-loss without their
  // coefficients, averaged over the micro-batches of the global batch and over the MoE layers.
  double moe_balance = 0, moe_z = 0;
};

class Trainer {
 public:
  Trainer(const GPTConfig& model_cfg, const TrainConfig& train_cfg, Backend& backend,
          TokenDataset& data, const ParallelContext& ctx = ParallelContext::single());
  ~Trainer();

  GPTModel& model() { return *model_; }
  // The training configuration in use (sample-based options resolved to iterations).
  const TrainConfig& config() const { return cfg_; }
  // Updates taken so far (skipped fp16 steps do not count).
  int64_t optimizer_steps() const;
  // With the distributed optimizer (null otherwise).
  DistributedAdamW* distributed_optimizer() { return dist_opt_.get(); }
  // Completes an overlapped parameter gather (--overlap-param-gather), so every rank's compute
  // weights are the updated ones; nothing to do otherwise. Evaluation and saving call it.
  void sync_params();
  int64_t iteration() const { return iteration_; }
  int64_t consumed_samples() const { return consumed_samples_; }
  // Micro-batches per step at the current global batch (a ramp changes it; evaluation uses the
  // full global batch).
  int num_micro_batches() const { return step_batch_ / (cfg_.micro_batch_size * ctx_.dp_size); }
  int step_global_batch() const { return step_batch_; }
  const LossScaler& loss_scaler() const { return scaler_; }
  int64_t skipped_iterations() const { return skipped_iterations_; }

  // Runs one iteration on the next global batch; every rank returns the same loss and norm.
  // Throws Error naming the iteration when the loss or the gradient norm is not finite. With
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

  // The validation after `done` earlier evaluations: eval_iters global batches from where they
  // stopped (or the whole split with full_validation). Collective.
  double validate(const TokenDataset& data, int64_t done);
  // Megatron's "validation loss at the end of training": the evaluation that would follow the
  // last periodic one. Collective.
  double evaluate_at_end(const TokenDataset& data);
  // Mean loss per loss token over `iters` global batches of `data` starting at sample `first`,
  // forward only; the same value on every rank.
  double evaluate(const TokenDataset& data, int64_t first, int64_t iters);

  // Collective. Writes a checkpoint of the current state under `dir` (DESIGN.md invariant 6);
  // throws Error (on every rank) when any rank failed, with the previous checkpoint intact.
  // With --async-save it returns once the state is staged; the write continues in the
  // background and commits when every rank has finished (checked after each iteration of
  // train(), and before the next save, a load, a signal stop and the end of train()).
  void save_checkpoint(const std::string& dir);
  // Collective: waits for a background save to finish and commits it (throws Error like a
  // synchronous save that failed). Nothing to do without one.
  void wait_for_saves();
  // Collective. Loads the checkpoint `dir` points to, whatever layout it was saved with. With
  // `model_only`, the optimizer state, iteration and data position start fresh.
  // model_only (--finetune): iteration, data position and optimizer start fresh; without
  // load_optimizer (--no-load-optim) only the optimizer (moments and step count) does.
  void load_checkpoint(const std::string& dir, bool model_only = false, bool load_optimizer = true);

 private:
  // Shapes the step for `global_batch` samples: the schedule, activation slots, token losses,
  // batch buffer and prefetcher (again only when the size changes: a batch-size ramp).
  void shape_step(int global_batch);
  // The schedules' step count of the step about to update (iterations, or samples under a ramp).
  int64_t schedule_step() const;
  // Samples of this DP rank for the step that starts at `consumed` samples.
  int64_t first_sample(int64_t consumed) const;
  // Context parallelism: this rank's tokens of each sample (all of them without).
  int local_seq() const { return model_cfg_.seq_length / ctx_.cp_size; }
  void load_batch(StepStats& st);
  // The activation slot of micro-batch `micro` of model chunk `chunk`.
  Activations& slot(int chunk, int micro);
  // Pipeline links: where a forward's input comes from and its output goes, and a backward's
  // gradient (a ring with virtual stages: the last stage feeds the first).
  struct Link {
    Communicator* comm;
    int peer;
  };
  Link forward_in() const;
  Link forward_out() const;
  Link backward_in() const;
  Link backward_out() const;
  void run_micro_batches(bool with_backward, float grad_scale, StepStats& st);
  // Collective: the loss tokens of the global batch; throws ConfigError on every rank when any
  // rank could not read its samples (read_error_), with that rank's words.
  double count_loss_tokens();
  void forward_micro(int micro, Activations& a, float grad_scale, StepStats& st);
  void backward_micro(int micro, Activations& a, StepStats& st);
  // The parameters each rank counts once in grid-wide norms (TP-replicated ones on TP rank 0,
  // the tied embedding on the first stage).
  const std::vector<bool>& counted_params();
  double params_norm();  // collective: the L2 norm of every parameter (f32 master weights)
  double grad_zeros();   // collective: zeros in the gradient, each element counted once
  void write_checkpoint(const std::string& dir);
  // Collective: every rank's failure agreed; rank 0 commits the iteration directory (or abandons
  // it); throws Error naming the iteration when any rank failed.
  void commit_save(const std::string& dir, int64_t iteration, double failed,
                   const std::string& error);
  // Collective: commits a background save once every rank's write is done (blocking: waits).
  void finish_async_save(bool blocking);
  struct AsyncSave;
  // Collective: every rank's memory against the --dry-run estimate, printed by rank 0.
  void memory_report(int64_t iteration);
  double grad_norm_squared();
  void sum_micro_losses();
  bool profile_this_rank() const;
  void log_iteration(const StepStats& s, double interval_loss, double interval_seconds, int n);
  void moe_step_stats(StepStats& st);
  // Expert parallelism, saving: `local` (this rank's flat states, null where absent) with every
  // expert of the EP group, in the layout of `specs` (expert-parallel size 1). Collective over
  // the EP group.
  void gather_experts(const float* const local[3], std::vector<ParamSpec>& specs,
                      std::vector<float> full[3]);
  struct SkipWrite {};  // an EP rank whose experts DP rank 0 writes
  std::vector<ParamSpec> ep_specs_;
  std::vector<float> ep_full_[3];

  GPTConfig model_cfg_;
  TrainConfig cfg_;
  Backend& be_;
  TokenDataset& data_;
  ParallelContext ctx_;
  std::unique_ptr<GPTModel> model_;
  std::unique_ptr<AdamW> optimizer_;            // without the distributed optimizer
  std::unique_ptr<DistributedAdamW> dist_opt_;  // --use-distributed-optimizer
  std::unique_ptr<GradReducer> reducer_;
  LrSchedule schedule_;
  WeightDecaySchedule wd_schedule_;
  LossScaler scaler_ = LossScaler::constant(1.0);
  int64_t skipped_iterations_ = 0;
  std::vector<Activations> slots_;  // one per micro-batch in flight on this stage, chunk by chunk
  std::vector<int> chunk_slots_, slot_offset_;  // per model chunk: its slots, the first one's index
  std::vector<std::unique_ptr<PendingOp>> sends_;  // per slot: the last send from its buffers
  std::vector<PipeStep> schedule_steps_;
  bool last_backward_ = false;  // the backward running is the step's last micro-batch's
  DropoutContext dropout_;      // of the pass run_micro_batches runs (training: the step's)
  std::vector<int32_t> batch_;  // (local samples, T+1) tokens of this DP rank's slice of the step
  std::string read_error_;      // why this rank's samples of the step could not be read, or empty
  std::vector<int32_t> host_ids_, host_targets_;  // one micro-batch, staged for the backend
  std::vector<Tensor> norm_grads_;
  std::vector<Tensor> norm_expert_grads_;  // expert parallelism: this rank's experts' gradients
  std::vector<bool> counted_;  // per parameter: counted once in grid-wide norms on this rank
  IterationTimers timers_;
  std::unique_ptr<TensorBoardWriter> tb_;  // on the last rank with --tensorboard-dir
  Tensor micro_losses_;  // last stage: (micro-batches x B*T) token losses of a step
  std::vector<float> host_losses_;
  uint64_t profile_range_ = 0;  // the NVTX range over the profiled iterations  // the gradients the
                                // global norm counts on this rank
  std::unique_ptr<Prefetcher> prefetch_;
  double loss_sum_ = 0;
  int64_t last_saved_ = -1;
  int stopped_by_signal_ = 0;
  int64_t iteration_ = 0, consumed_samples_ = 0;
  int step_batch_ = 0;            // the global batch the step's buffers are shaped for
  int64_t interval_samples_ = 0;  // samples of the steps since the last log line
  double interval_moe_balance_ = 0, interval_moe_z_ = 0;  // summed over the interval's steps
  int interval_moe_steps_ = 0;
  float moe_loss_scale_ = 1;  // this step's weight of each micro-batch's MoE losses
  int64_t lr_samples_ = 0;    // samples of the updates taken (the sample-based schedule)
  std::ofstream metrics_;
  std::unique_ptr<AsyncSave> async_;  // --async-save: staging buffers and the writer
  bool async_pending_ = false;        // a background save not yet committed (every rank alike)
};

}  // namespace tessera
