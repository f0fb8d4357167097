// step_hooks.hpp: the model's per-step state as hooks (docs/architecture.md, "The model as
// parts"). A training step runs every hook of GPTModel::step_hooks() in order: begin_attempt as
// each attempt of an iteration starts (a rerun of result validation repeats the iteration in
// place: rerun true), end_step once after the step's last backward and before the optimizer.
// Each hook belongs to what needs it: FP8's delayed scaling (its amaxes and histories), the MoE
// router's loads and aux-loss-free expert bias and its logged statistics, multi-token
// prediction's losses. The step knows no model feature; result validation wraps the step.
#pragma once

namespace tessera {

class Communicator;

class StepHook {
 public:
  virtual ~StepHook() = default;
  virtual void begin_attempt(bool rerun) = 0;
  // `grad_group`: the ranks whose micro-batches make the global batch (DP x CP); null for one.
  virtual void end_step(Communicator* grad_group) = 0;
};

}  // namespace tessera
