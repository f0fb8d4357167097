// optimizer_set.hpp: everything between the backward and the updated weights: the gradient
// reduction (bucketed over DP, the tied embedding over its group), the fp16 loss scaler and its
// overflow check, the grid-wide gradient norm and clipping, the learning-rate and weight-decay
// schedules, and AdamW or the distributed optimizer (with expert parallelism's split). Its step()
// returns what Megatron-LM's optimizer step returns: whether the update happened, the gradient
// norm and the zeros in the gradient.
#pragma once

#include <memory>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/gpt.hpp"
#include "run/train_config.hpp"
#include "step/dist_optimizer.hpp"
#include "step/fsdp.hpp"
#include "step/grad_reducer.hpp"
#include "step/grid_norms.hpp"
#include "step/loss_scaler.hpp"
#include "step/lr_schedule.hpp"
#include "step/muon.hpp"
#include "step/optimizer.hpp"
#include "step/step_stats.hpp"
#include "step/timers.hpp"

namespace tessera {

// It observes the model's passes (model/pass_observer.hpp): a piece's completed gradients go to
// the reduction, and the overlapped parameter gather waits before a piece's forward.
class OptimizerSet : private PassObserver {
 public:
  // The flat parameter/gradient layout the optimizer needs (bucket size, DP x CP shards and the
  // embedding's own bucket with the distributed optimizer, experts apart with EP).
  static FlatLayout flat_layout(const TrainConfig& cfg, const GPTConfig& model_cfg,
                                const ParallelContext& ctx);

  // Builds the optimizer over `model` and initializes the model's parameters from cfg.seed (the
  // distributed optimizer's master blocks take their share first). `cfg` is resolved.
  OptimizerSet(GPTModel& model, Backend& be, const TrainConfig& cfg, const ParallelContext& ctx,
               IterationTimers& timers);
  ~OptimizerSet() override;
  OptimizerSet(const OptimizerSet&) = delete;
  OptimizerSet& operator=(const OptimizerSet&) = delete;
  // `last_backward`: whether the backward running is a piece's last of the step (the step
  // executor knows); the reduction takes a piece's gradients then (every micro-batch under
  // Megatron-FSDP's sharded gradients), after their sums over TP.
  void observe_backward(std::function<bool()> last_backward) {
    last_backward_ = std::move(last_backward);
  }

  // fp16: the loss scale of the next backward (1 in f32 and bf16).
  double loss_scale() const { return scaler_.scale(); }
  // Before a step's backward: the reduction's buckets start as the backward completes them.
  void begin_step();
  // Each gradient bucket's local values before its data-parallel reduction (result validation).
  void before_reduce(std::function<void(const Tensor&)> f) {
    reduction_->before_reduce = std::move(f);
  }
  // Megatron-FSDP's units (sharded gradients or parameters); null otherwise.
  FsdpUnits* fsdp() { return fsdp_; }
  // Waits for the data-parallel reduction and all-reduces the tied embedding's two halves.
  void finish_reduction();

  struct Update {
    bool update_successful = false;  // false: fp16 overflow, the step is skipped
    double grad_norm = 0;            // before clipping, unscaled (0 when skipped)
    double num_zeros = 0;            // with --log-num-zeros-in-grad (else 0)
    double lr = 0, weight_decay = 0;
  };
  // Collective: unscale, overflow check, clip, schedule, update, for the step of `global_batch`
  // samples. Throws Error naming `iteration` when the loss or the gradient norm is not finite.
  Update step(int64_t iteration, double loss, int global_batch);

  // Collective: the L2 norm of the parameters (f32 master weights).
  double params_norm() { return norms_->params_norm(); }
  // Completes an overlapped parameter gather (--overlap-param-gather); nothing otherwise.
  void sync_params();

  // Updates taken so far (skipped fp16 steps do not count).
  int64_t steps_taken() const;
  void set_steps_taken(int64_t steps);
  int64_t skipped_iterations() const { return skipped_iterations_; }
  // The sample-based schedule's position: samples of the updates taken.
  int64_t lr_samples() const { return lr_samples_; }
  // Restores the position of a checkpoint (`skipped` only with a dynamic loss scale).
  void restore_position(int64_t lr_samples, int64_t skipped) {
    lr_samples_ = lr_samples;
    skipped_iterations_ = skipped;
  }
  LossScaler& scaler() { return scaler_; }
  const LossScaler& scaler() const { return scaler_; }
  bool weight_decay_scheduled() const { return wd_schedule_.scheduled(); }
  // One of the two is set: the distributed optimizer, or AdamW on every DP rank.
  DistributedAdamW* distributed() { return dist_opt_.get(); }
  AdamW* replicated() { return optimizer_.get(); }

 private:
  // The schedules' step count of the step about to update (iterations, or samples under a ramp).
  int64_t lr_schedule_step(int global_batch) const;
  // The optimizer step; grad_scale (the clip factor) multiplies each gradient as it is read.
  void update(Update& u, double grad_scale);
  // Multi-token prediction on a stage of its own (rank m): one half of the exchange of a
  // copy's gradient with the last stage: to the last stage (which adds it to its own), or the
  // sum back.
  void exchange_half(Tensor grad, int m, int last, bool to_last);
  // The passes (PassObserver): a piece's gradients complete; a piece about to read its weights.
  void grads_ready(int piece) override;
  void before_forward(int piece) override;

  GPTModel& model_;
  Backend& be_;
  const TrainConfig& cfg_;
  const ParallelContext& ctx_;
  IterationTimers& timers_;
  std::unique_ptr<AdamW> optimizer_;            // without the distributed optimizer
  std::unique_ptr<Muon> muon_;                  // --optimizer muon: the matrices (AdamW the rest)
  std::unique_ptr<DistributedAdamW> dist_opt_;  // --use-distributed-optimizer
  // The bucketed reducer, or Megatron-FSDP's units (--use-megatron-fsdp with
  // optim_grads(_params)); fsdp_ views the latter.
  std::unique_ptr<GradReduction> reduction_;
  FsdpUnits* fsdp_ = nullptr;
  std::function<bool()> last_backward_;  // observe_backward
  bool wait_params_ = false;             // the overlapped parameter gather (before_forward)
  std::unique_ptr<GridNorms> norms_;
  LrSchedule lr_schedule_;
  WeightDecaySchedule wd_schedule_;
  LossScaler scaler_ = LossScaler::constant(1.0);
  int64_t skipped_iterations_ = 0;
  int64_t lr_samples_ = 0;
  int mtp_rank_ = -1;  // the pipeline rank of multi-token prediction without the loss, or -1
  Tensor copy_grad_;   // the last stage's receive buffer of that stage's copies' gradients
};

}  // namespace tessera
