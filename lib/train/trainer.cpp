// trainer.cpp: the training loop over the process grid, orchestrating the components
// (train/trainer.hpp).
#include "train/trainer.hpp"

#include <algorithm>
#include <utility>

#include "comm/mpi/collective_trace.hpp"
#include "core/logging.hpp"
#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"
#include "core/timer.hpp"
#include "runtime/select.hpp"
#include "step/optimizer_set.hpp"
#include "step/step_executor.hpp"
#include "step/training_step.hpp"
#include "train/checkpointer.hpp"
#include "train/metrics.hpp"
#include "train/result_validator.hpp"
#include "train/run_control.hpp"

namespace tessera {

namespace {
// The schedules are built from the configuration before the constructor's body: check it first.
TrainConfig resolved_and_validated(const TrainConfig& t, int dp_size) {
  TrainConfig r = t.resolved(dp_size);
  r.validate(dp_size);
  return r;
}
}  // namespace

Trainer::Trainer(const GPTConfig& model_cfg, const TrainConfig& train_cfg, Backend& backend,
                 TokenDataset& data, const ParallelContext& ctx)
    : model_cfg_(model_cfg),
      cfg_(resolved_and_validated(train_cfg, ctx.dp_size)),
      be_(backend),
      data_(data),
      ctx_(ctx) {
  model_cfg_.validate();
  TESSERA_CHECK(data.seq_length() == model_cfg_.seq_length, "dataset sequence length ",
                data.seq_length(), " differs from --seq-length ", model_cfg_.seq_length);
  model_ = make_training_model(model_cfg_, cfg_, be_, ctx_);
  optimizers_ = std::make_unique<OptimizerSet>(*model_, be_, cfg_, ctx_, timers_);
  executor_ = std::make_unique<StepExecutor>(*model_, be_, cfg_, ctx_, data_, timers_);
  optimizers_->observe_backward([this] { return executor_->in_last_backward(); });
  step_ = std::make_unique<TrainingStep>(
      TrainingStep{*model_, *executor_, *optimizers_, ctx_, timers_});
  executor_->shape(cfg_.global_batch_at(ctx_.dp_size, 0));
  // Collective pre-flights: an unusable --save, --metrics-file or --tensorboard-dir is every
  // rank's ConfigError now, not after hours of training.
  checkpointer_ = std::make_unique<TrainingCheckpointer>(*model_, be_, cfg_, ctx_, *optimizers_,
                                                         timers_, on_progress);
  metrics_ =
      std::make_unique<TrainingMetrics>(MetricContext{*model_, cfg_, ctx_, *optimizers_}, timers_);
  timers_.configure(cfg_.timing_log_level, cfg_.timing_log_option, make_phase_clock(be_),
                    cfg_.use_distributed_optimizer);
  validator_ = std::make_unique<ResultValidator>(cfg_, ctx_, be_);
  if (validator_->checks_gradients())  // each bucket, locally, before its reduction
    optimizers_->before_reduce([this](const Tensor& g) { validator_->check_bucket(g); });
}

Trainer::~Trainer() = default;

int64_t Trainer::optimizer_steps() const {
  return optimizers_->steps_taken();
}
DistributedAdamW* Trainer::distributed_optimizer() {
  return optimizers_->distributed();
}
void Trainer::sync_params() {
  optimizers_->sync_params();
}
int Trainer::num_micro_batches() const {
  return executor_->num_micro_batches();
}
int Trainer::step_global_batch() const {
  return executor_->global_batch();
}
const LossScaler& Trainer::loss_scaler() const {
  return optimizers_->scaler();
}
int64_t Trainer::skipped_iterations() const {
  return optimizers_->skipped_iterations();
}

std::vector<StepStats> Trainer::train(const TokenDataset* eval_data) {
  RunControl control(cfg_, ctx_, be_);
  metrics_->begin_run();
  validator_->start(std::exchange(state_.rerun_state, {}), state_.iteration + 1);  // the skips
  std::vector<StepStats> all;
  while (state_.iteration < cfg_.train_iters) {
    control.before_step(state_.iteration);  // the profiler window opens
    const StepStats s = train_step();
    metrics_->memory_report_after(be_, s);  // the first step that ran, then every interval
    control.after_step(state_.iteration);   // and closes
    all.push_back(s);
    metrics_->record(s, state_.consumed_samples);  // the log line, metrics file, TensorBoard
    if (eval_data && cfg_.eval_interval > 0 && s.iteration % cfg_.eval_interval == 0) {
      const double loss = evaluate_next(*eval_data, s.iteration / cfg_.eval_interval - 1);
      metrics_->record_validation(s.iteration, loss, state_.consumed_samples);
      progress(s.iteration);
    }
    checkpointer_->after_iteration(state_);  // a background save commits; a save when due
    progress(s.iteration);
    if ((stopped_by_signal_ = control.agreed_signal(s.iteration)) || control.exit_due(s.iteration))
      break;
  }
  control.stop_profiler();
  checkpointer_->save_at_stop(state_);  // unless saved at this iteration; waits for the write
  sync_params();
  metrics_->flush();
  return all;
}

StepStats Trainer::train_step() {
  if (validator_->skip(state_.iteration + 1)) return validator_->skip_step(state_);
  NVTX_RANGE("train-step");
  Timer timer;
  StepStats st;
  st.iteration = state_.iteration + 1;
  trace_log_iteration(
      st.iteration);  // the collective log's test hook (comm/mpi/collective_trace.hpp)
  executor_->shape(cfg_.global_batch_at(ctx_.dp_size, state_.consumed_samples));
  st.global_batch = executor_->global_batch();
  executor_->load_training_batch(state_.consumed_samples, st);
  // Loss tokens of the global batch and of each micro-batch, known before any backward: they
  // weigh each micro-batch's gradient (StepExecutor::micro_grad_scale). The loss logged is the
  // mean over the global batch's loss tokens, as Megatron reports it.
  const double tokens = executor_->count_loss_tokens();
  st.loss_tokens = static_cast<int64_t>(tokens);
  if (st.loss_tokens == 0) return validator_->skip_without_loss(state_, st);  // docs/data.md
  // fp16: the loss gradient carries the loss scale; the gradients are unscaled after the
  // reduction. Scale 1 in f32 and bf16.
  st.loss_scale = optimizers_->loss_scale();
  const StepStats loaded = st;                  // a rejected result reruns the iteration in place
  double reduced[1 + ResultValidator::kFlags];  // the loss sum, result validation's findings
  for (int attempt = 0;; ++attempt) {
    st = loaded;
    run_attempt(st, attempt, tokens, timer, reduced);
    if (!validator_->rerun(reduced + 1)) break;
  }
  if (validator_->exit16_due())  // the state before this iteration, to rerun it elsewhere
    validator_->exit16(checkpointer_->save_for_rerun(state_, validator_->pending_state()));
  step_->end_hooks();  // FP8, expert bias, ...
  st.loss = reduced[0] / tokens;
  metrics_->collect(st);  // the step's statistics the grid sums (MoE)
  const OptimizerSet::Update u = optimizers_->step(st.iteration, st.loss, st.global_batch);
  st.skipped = !u.update_successful;
  st.grad_norm = u.grad_norm;
  st.num_zeros = u.num_zeros;
  st.lr = u.lr;
  st.weight_decay = u.weight_decay;
  state_.iteration = st.iteration;
  state_.consumed_samples += st.global_batch;
  validator_->end_step(st.iteration);
  be_.synchronize();  // the step's time includes the device work it queued
  st.seconds = timer.seconds();
  // The step's timestamps have happened: read them, reuse the slots (a skipped step's stay for
  // the next one's, as before the components).
  if (u.update_successful) timers_.settle();
  return st;
}

void Trainer::run_attempt(StepStats& st, int attempt, double tokens, const Timer& step,
                          double reduced[1 + ResultValidator::kFlags]) {
  // MoE's load-balancing and z losses: their mean over the global batch's micro-batches.
  const float moe_loss_scale = float(st.loss_scale * cfg_.micro_batch_size / st.global_batch);
  validator_->begin_attempt(st.iteration, attempt);
  metrics_->begin_step();
  const double loss_sum = step_->attempt(
      st, attempt > 0, executor_->first_sample(state_.consumed_samples), moe_loss_scale, step);
  // Every rank learns the loss (only the last stage's tp-rank-0 ranks contribute their slice)
  // and result validation's findings, checked locally before this reduction, in one all-reduce.
  const bool has_loss = ctx_.last_stage() && ctx_.tp_rank == 0;
  reduced[0] = has_loss ? loss_sum : 0.0;
  validator_->check(loss_sum * ctx_.grad_group_size() / tokens, has_loss, reduced + 1);
  ctx_.world->all_reduce_f64(reduced, 1 + ResultValidator::kFlags, ReduceOp::Sum);
}

double Trainer::evaluate_next(const TokenDataset& data, int64_t done) {
  const int64_t G = cfg_.global_batch(ctx_.dp_size);
  if (cfg_.full_validation) return evaluate(data, 0, std::max<int64_t>(1, data.num_samples() / G));
  return evaluate(data, done * cfg_.eval_iters * G, cfg_.eval_iters);
}

double Trainer::evaluate_at_end(const TokenDataset& data) {
  return evaluate_next(data, cfg_.eval_interval > 0 ? state_.iteration / cfg_.eval_interval : 0);
}

double Trainer::evaluate(const TokenDataset& data, int64_t first, int64_t iters,
                         const std::function<void(int64_t, int64_t)>& batch_done) {
  sync_params();
  TESSERA_CHECK(data.seq_length() == model_cfg_.seq_length, "evaluation data has sequence length ",
                data.seq_length(), ", the model ", model_cfg_.seq_length);
  // Megatron evaluates with the full global batch, also during a batch-size ramp.
  executor_->shape(cfg_.global_batch(ctx_.dp_size));
  const int64_t G = executor_->global_batch();
  double loss = 0, tokens = 0;
  StepStats st;
  for (int64_t it = 0; it < iters; ++it) {
    executor_->load_batch(data, dp_slice_begin(first + it * G, G, ctx_.dp_size, ctx_.dp_rank));
    tokens += executor_->count_loss_tokens();
    const double sum =
        executor_->run(false, 0, executor_->first_sample(state_.consumed_samples), 0.0f, 1.0f, st);
    loss += (ctx_.last_stage() && ctx_.tp_rank == 0) ? sum : 0.0;
    progress(state_.iteration);
    if (batch_done) batch_done(it + 1, iters);
  }
  ctx_.world->all_reduce_f64(&loss, 1, ReduceOp::Sum);
  return evaluation_loss(loss, tokens, data, first, first + iters * G);
}

void Trainer::save_checkpoint(const std::string& dir) {
  checkpointer_->save(dir, state_);
}

void Trainer::wait_for_saves() {
  checkpointer_->wait();
}

void Trainer::load_checkpoint(const std::string& dir, bool model_only, bool optim, bool fallback) {
  state_ = checkpointer_->load_checked(dir, model_only, optim, fallback, validator_->tracker());
}

}  // namespace tessera
