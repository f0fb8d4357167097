// training_step.cpp: one iteration's work on the components (step/training_step.hpp).
#include "step/training_step.hpp"

#include "run/layout.hpp"

namespace tessera {

std::unique_ptr<GPTModel> make_training_model(const GPTConfig& cfg, const TrainConfig& t,
                                              Backend& be, const ParallelContext& ctx,
                                              const LayerRange* layers) {
  ModelShard shard = make_model_shard(cfg, ctx, t);
  if (layers) {
    TESSERA_CHECK(ctx.pp_size == 1 && shard.num_chunks() == 1,
                  "make_training_model: a layer range needs a single stage");
    shard.chunks[0] = *layers;
  }
  auto model = std::make_unique<GPTModel>(cfg, shard, be, *ctx.tp, t.compute_dtype, t.recompute,
                                          OptimizerSet::flat_layout(t, cfg, ctx));
  if (ctx.ep_size > 1) model->set_expert_comm(*ctx.ep);
  if (ctx.cp_size > 1) model->set_context_comm(*ctx.cp);
  model->set_fp8(t.fp8);
  return model;
}

double TrainingStep::attempt(StepStats& st, bool rerun, int64_t first_sample, float moe_loss_scale,
                             const Timer& step) {
  model.zero_grads();
  for (StepHook* h : model.step_hooks()) h->begin_attempt(rerun);
  optimizers.begin_step();  // buckets start as the last micro-batch's backward completes them
  double loss_sum = 0;
  {
    st.pipeline_start = step.seconds();
    IterationTimers::Scope timed(timers, IterationTimers::ForwardBackward);
    Timer pipeline;
    loss_sum = executor.run(true, st.iteration, first_sample, st.loss_scale, moe_loss_scale, st);
    st.pipeline_seconds = pipeline.seconds();
  }
  Timer dp_wait;
  optimizers.finish_reduction();
  st.dp_wait_seconds = dp_wait.seconds();
  return loss_sum;
}

void TrainingStep::end_hooks() {
  Communicator* group = ctx.grad_group_size() > 1 ? ctx.dp : nullptr;  // the global batch's
  for (StepHook* h : model.step_hooks()) h->end_step(group);
}

}  // namespace tessera
