// training_step.hpp: one training iteration's work on this rank's components, in the order the
// trainer runs it (train/trainer.cpp) and the collective plan records it (plan/collectives.hpp,
// on the shape backend with recording communicators): the model of the rank's shard, then per
// iteration the attempt (gradients zeroed, the step hooks' start, the gradient buckets armed, the
// pipeline's forwards and backwards, the reduction finished), the step hooks' end and the update.
#pragma once

#include <memory>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/timer.hpp"
#include "model/gpt.hpp"
#include "run/train_config.hpp"
#include "step/optimizer_set.hpp"
#include "step/step_executor.hpp"
#include "step/step_stats.hpp"
#include "step/timers.hpp"

namespace tessera {

// The model of this rank's shard as training builds it: the flat buffers' buckets of the
// optimizers, the expert and context-parallel groups, FP8. `t` resolved for the run's DP size.
// `layers` (a single pipeline stage only): the stage holds these layers instead of all (the
// predictor's recording of one layer of each kind, plan/collectives.hpp).
std::unique_ptr<GPTModel> make_training_model(const GPTConfig& cfg, const TrainConfig& t,
                                              Backend& be, const ParallelContext& ctx,
                                              const LayerRange* layers = nullptr);

// The components of one rank's step.
struct TrainingStep {
  GPTModel& model;
  StepExecutor& executor;
  OptimizerSet& optimizers;
  const ParallelContext& ctx;
  IterationTimers& timers;

  // One attempt at the loaded batch (a rerun of result validation is another: `rerun`): returns
  // this rank's sum of token losses (StepExecutor::run). Sets st's pipeline and DP-wait times;
  // `step` is the iteration's clock. Reads st.iteration and st.loss_scale.
  double attempt(StepStats& st, bool rerun, int64_t first_sample, float moe_loss_scale,
                 const Timer& step);
  // After the attempt that stands: the model's step hooks end (FP8's delayed scaling, the MoE
  // router's expert bias, multi-token prediction's losses) over the global batch's group.
  void end_hooks();
};

}  // namespace tessera
