// trainer.cpp: the training loop over the process grid.
#include "train/trainer.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "backend/select.hpp"
#include "checkpoint/checkpoint.hpp"
#include "comm/process_grid.hpp"
#include "core/logging.hpp"
#include "core/nvtx.hpp"
#include "core/paths.hpp"
#include "core/phase_timer.hpp"
#include "core/timer.hpp"
#include "train/context_parallel.hpp"
#include "train/options.hpp"
#include "train/watchdog.hpp"

namespace tessera {

namespace {
constexpr int kTagForward = 1, kTagBackward = 2;
}

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
      ctx_(ctx),
      schedule_(LrSchedule::of(cfg_, ctx.dp_size)),
      wd_schedule_(WeightDecaySchedule::of(cfg_)) {
  model_cfg_.validate();
  validate_layout(model_cfg_, cfg_, ctx_.tp_size, ctx_.pp_size, ctx_.dp_size, ctx_.cp_size);
  TESSERA_CHECK(data.seq_length() == model_cfg_.seq_length, "dataset sequence length ",
                data.seq_length(), " differs from --seq-length ", model_cfg_.seq_length);
  const bool dist = cfg_.use_distributed_optimizer;
  FlatLayout layout;
  layout.bucket_elems = cfg_.ddp_bucket_size;
  layout.shards = dist ? ctx_.grad_group_size() : 1;  // the optimizer shards over DP x CP
  layout.embedding_alone = dist && model_cfg.tied_head();
  layout.master = !(dist && cfg_.compute_dtype != DType::F32);  // else the optimizer's blocks
  // Expert parallelism: the routed experts' gradients reduce over the expert-data-parallel group.
  const bool ep = ctx_.ep_size > 1;
  layout.experts_apart = ep;
  Communicator* expert_dp = ep ? ctx_.edp : nullptr;
  model_ = std::make_unique<GPTModel>(
      model_cfg_,
      make_model_shard(model_cfg_, ctx_, cfg_.sequence_parallel, cfg_.virtual_pipeline_size), be_,
      *ctx_.tp, cfg_.compute_dtype, cfg_.recompute, layout);
  if (ep) model_->set_expert_comm(*ctx_.ep);
  if (ctx_.cp_size > 1) model_->set_context_comm(*ctx_.cp);
  scaler_ = cfg_.compute_dtype != DType::F16 ? LossScaler::constant(1.0)
            : cfg_.loss_scale > 0
                ? LossScaler::constant(cfg_.loss_scale)
                : LossScaler::dynamic(cfg_.initial_loss_scale, cfg_.min_loss_scale,
                                      cfg_.loss_scale_window, cfg_.hysteresis);
  if (dist) {
    dist_opt_ = std::make_unique<DistributedAdamW>(*model_, be_, *ctx_.dp, cfg_.adam_beta1,
                                                   cfg_.adam_beta2, cfg_.adam_eps, expert_dp);
    if (dist_opt_->owns_master()) {
      model_->init_parameters(cfg_.seed, [this](const ParamSpec& s, const float* v) {
        dist_opt_->set_state("master", s, v);
      });
      dist_opt_->publish();
    } else {
      model_->init_parameters(cfg_.seed);
    }
    if (cfg_.overlap_param_gather)
      model_->before_forward = [this](int piece) { dist_opt_->wait_params(piece); };
  } else {
    model_->init_parameters(cfg_.seed);
    optimizer_ = std::make_unique<AdamW>(model_->params(), be_, cfg_.adam_beta1, cfg_.adam_beta2,
                                         cfg_.adam_eps);
  }
  reducer_ =
      std::make_unique<GradReducer>(*model_, *ctx_.dp, dist, cfg_.overlap_grad_reduce, expert_dp);
  model_->on_grads_ready = [this](int piece) {
    // The last micro-batch's backward (of the piece's chunk) completes a piece's gradients:
    // sequence parallelism's LayerNorm gradients are summed over TP first, then the
    // data-parallel reduction may start.
    if (!last_backward_) return;
    model_->reduce_sequence_parallel_grads(piece);
    reducer_->piece_ready(piece);
  };
  {
    const int V = cfg_.virtual_pipeline_size;
    TESSERA_CHECK(V == 1 || ctx_.pp_size == 1 || !(ctx_.first_stage() || ctx_.last_stage()) ||
                      be_.device() == Device::CPU || (ctx_.pp_wrap && ctx_.pp_wrap_grad),
                  "virtual pipeline stages on the GPU need the ring's own communicators "
                  "(ProcessGrid::use_pipeline_ring before use_nccl)");
  }
  shape_step(cfg_.global_batch_at(ctx_.dp_size, 0));
  if (!cfg_.save.empty()) {  // an unwritable --save is an error now, not after hours of training
    double bad = 0;
    std::string why;
    if (ctx_.world_rank == 0) {
      try {
        prepare_save_dir(cfg_.save);
      } catch (const ConfigError& e) {
        bad = 1;
        why = e.what();
      }
    }
    ctx_.world->all_reduce_f64(&bad, 1, ReduceOp::Max);
    if (bad)
      throw ConfigError(ctx_.world_rank == 0 ? why : "--save is not usable (reported by rank 0)");
  }
  {  // rank 0 writes the metrics; a file it cannot open is every rank's configuration error
    double bad = 0;
    std::string why = "--metrics-file '" + cfg_.metrics_file +
                      "' cannot be opened for appending; check its permissions";
    if (!cfg_.metrics_file.empty() && ctx_.world_rank == 0) {
      try {
        create_parent_dirs(cfg_.metrics_file, "--metrics-file");
        metrics_.open(cfg_.metrics_file, std::ios::app);
        bad = metrics_ ? 0 : 1;
      } catch (const ConfigError& e) {
        why = e.what();
        bad = 1;
      }
    }
    ctx_.world->all_reduce_f64(&bad, 1, ReduceOp::Max);
    if (bad)
      throw ConfigError(ctx_.world_rank == 0 ? why
                                             : "--metrics-file is not usable (reported by rank 0)");
  }
  timers_.configure(cfg_.timing_log_level, cfg_.timing_log_option, make_phase_clock(be_),
                    dist_opt_ != nullptr);
  if (!cfg_.tensorboard_dir.empty()) {  // the last rank writes (Megatron's); its failure is all's
    std::string why;
    if (ctx_.world_rank == ctx_.world->size() - 1) {
      try {
        tb_ = std::make_unique<TensorBoardWriter>(cfg_.tensorboard_dir);
      } catch (const std::exception& e) {
        why = e.what();
      }
    }
    double bad = why.empty() ? 0 : 1;
    ctx_.world->all_reduce_f64(&bad, 1, ReduceOp::Max);
    if (bad)
      throw ConfigError(!why.empty() ? why
                                     : "--tensorboard-dir '" + cfg_.tensorboard_dir +
                                           "' cannot be written (reported by the last rank)");
  }
}

void Trainer::shape_step(int global_batch) {
  if (global_batch == step_batch_) return;
  step_batch_ = global_batch;
  const int micro = num_micro_batches();
  const int V = cfg_.virtual_pipeline_size;
  schedule_steps_ = schedule_interleaved(ctx_.pp_size, ctx_.pp_rank, micro, V);
  chunk_slots_ = V > 1 ? pipeline_chunk_slots(schedule_steps_, V)
                       : std::vector<int>{pipeline_slots(ctx_.pp_size, ctx_.pp_rank, micro)};
  slots_.clear();  // the previous shape's buffers go back first (the sends on them completed)
  slots_ = model_->make_activation_slots(cfg_.micro_batch_size, local_seq(), chunk_slots_);
  slot_offset_.clear();
  for (int c = 0, offset = 0; c < V; offset += chunk_slots_[c++]) slot_offset_.push_back(offset);
  sends_.clear();
  sends_.resize(slots_.size());
  if (ctx_.last_stage()) {
    micro_losses_ = Tensor();
    AllocationLabel label("the token losses of one step");
    micro_losses_ =
        Tensor({int64_t(micro) * cfg_.micro_batch_size * local_seq()}, DType::F32, be_.allocator());
  }
  const int64_t local = global_batch / ctx_.dp_size;
  batch_.resize(static_cast<size_t>(local) * (model_cfg_.seq_length + 1));
  prefetch_.reset();  // its read in flight (of the previous shape) finishes first
  prefetch_ = std::make_unique<Prefetcher>(data_, local);
}

Activations& Trainer::slot(int chunk, int micro) {
  return slots_[static_cast<size_t>(slot_offset_[chunk] + micro % chunk_slots_[chunk])];
}

// The pipeline's links. With virtual stages the pipeline is a ring: the last stage's next is the
// first; the wrap-around takes its own communicators where the grid made them
// (ProcessGrid::use_pipeline_ring; the first stage is rank 0 there, the last rank 1).
Trainer::Link Trainer::forward_in() const {
  if (ctx_.pp_rank > 0) return {ctx_.pp, ctx_.pp_rank - 1};
  return ctx_.pp_wrap ? Link{ctx_.pp_wrap, 1} : Link{ctx_.pp, ctx_.pp_size - 1};
}
Trainer::Link Trainer::forward_out() const {
  if (ctx_.pp_rank < ctx_.pp_size - 1) return {ctx_.pp, ctx_.pp_rank + 1};
  return ctx_.pp_wrap ? Link{ctx_.pp_wrap, 0} : Link{ctx_.pp, 0};
}
Trainer::Link Trainer::backward_in() const {
  if (ctx_.pp_rank < ctx_.pp_size - 1) return {ctx_.pp_backward(), ctx_.pp_rank + 1};
  return ctx_.pp_wrap_grad ? Link{ctx_.pp_wrap_grad, 0} : Link{ctx_.pp_backward(), 0};
}
Trainer::Link Trainer::backward_out() const {
  if (ctx_.pp_rank > 0) return {ctx_.pp_backward(), ctx_.pp_rank - 1};
  return ctx_.pp_wrap_grad ? Link{ctx_.pp_wrap_grad, 1}
                           : Link{ctx_.pp_backward(), ctx_.pp_size - 1};
}

int64_t Trainer::first_sample(int64_t consumed) const {
  return dp_slice_begin(consumed, step_batch_, ctx_.dp_size, ctx_.dp_rank);
}

void Trainer::load_batch(StepStats& st) {
  TESSERA_PHASE("data-wait");
  IterationTimers::Scope timed(timers_, IterationTimers::BatchGenerator);
  // The next step's slice (of its batch size, which a ramp may change: then the read is wasted).
  const int64_t next = consumed_samples_ + step_batch_;
  read_error_.clear();
  try {  // a bad sample stops every rank (count_loss_tokens agrees on it), not just this one
    prefetch_->fetch(
        first_sample(consumed_samples_), batch_.data(),
        dp_slice_begin(next, cfg_.global_batch_at(ctx_.dp_size, next), ctx_.dp_size, ctx_.dp_rank));
  } catch (const std::exception& e) {
    read_error_ = e.what();
    if (read_error_.empty()) read_error_ = "reading this step's samples failed";
  }
  st.data_wait_seconds = prefetch_->take_wait_seconds();
}

void Trainer::forward_micro(int micro, Activations& a, float grad_scale, StepStats& st) {
  // T: this rank's tokens of each sample (all of them without context parallelism).
  const int B = cfg_.micro_batch_size, T = local_seq();
  const int64_t S = model_cfg_.seq_length + 1;
  NVTX_RANGE("forward");
  const int slot = static_cast<int>(&a - slots_.data());
  PhaseSequence phase;
  if (sends_[slot]) {
    phase("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardSend);
    // The slot's buffers may still be on their way out. On the device the compute stream waits,
    // not the host: a host blocked here could not post the receive another rank's send (ahead
    // of ours on that rank's stream) is waiting for.
    sends_[slot]->wait_device();
  }
  // Inputs and targets of the micro-batch, staged on the host and copied to the backend.
  phase("batch-to-device");
  host_ids_.resize(static_cast<size_t>(B) * T);
  host_targets_.resize(static_cast<size_t>(B) * T);
  for (int b = 0; b < B; ++b) {
    const int32_t* sample = batch_.data() + (int64_t(micro) * B + b) * S;
    if (ctx_.cp_size > 1) {  // this rank's chunks (train/context_parallel.hpp)
      cp_sample_tokens(sample, T, ctx_.cp_rank, ctx_.cp_size, host_ids_.data() + b * T,
                       host_targets_.data() + b * T);
      continue;
    }
    std::memcpy(host_ids_.data() + b * T, sample, sizeof(int32_t) * T);
    std::memcpy(host_targets_.data() + b * T, sample + 1, sizeof(int32_t) * T);
  }
  const bool first = model_->embeds(a), last = model_->ends_in_head(a);
  if (first) be_.copy_from_host(a.ids, host_ids_.data());
  if (last) be_.copy_from_host(a.targets, host_targets_.data());
  phase.close();
  // Dropout masks keyed by the micro-batch's global samples (the slot keeps them for the backward).
  a.dropout = dropout_;
  a.dropout.sample_begin = first_sample(consumed_samples_) + int64_t(micro) * B;
  a.moe_loss_scale = moe_loss_scale_;
  if (!first) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardRecv);
    Timer w;
    const Link in = forward_in();
    in.comm->recv(a.input, in.peer, kTagForward);
    st.pipeline_wait_seconds += w.seconds();
  }
  {
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardCompute);
    if (first) model_->embed_forward(a);
    for (int l = model_->chunk_layers(a).begin; l < model_->chunk_layers(a).end; ++l)
      model_->block_forward(l, a);
    if (last) {
      Tensor out = micro_losses_.view(int64_t(micro) * B * T, {int64_t(B) * T});
      model_->head_forward(a, grad_scale, out);  // summed once per step, in sum_micro_losses
    }
  }
  if (!last) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardSend);
    const Tensor& out = model_->stage_output(a);
    const Link to = forward_out();
    sends_[slot] = to.comm->send_async(out, to.peer, kTagForward);
    st.p2p_bytes += out.nbytes();
  }
}

void Trainer::backward_micro(int micro, Activations& a, StepStats& st) {
  NVTX_RANGE("backward");
  const int slot = static_cast<int>(&a - slots_.data());
  // The last micro-batch of its chunk: the chunk's gradients are complete after it.
  last_backward_ = micro == num_micro_batches() - 1;
  if (!model_->ends_in_head(a)) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::BackwardRecv);
    Timer w;
    const Link in = backward_in();
    in.comm->recv(a.dres, in.peer, kTagBackward);
    st.pipeline_wait_seconds += w.seconds();
  }
  if (sends_[slot]) {  // the forward's send of the stage output: full recomputation rewrites it
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardSend);
    sends_[slot]->wait_device();
  }
  {
    IterationTimers::Scope timed(timers_, IterationTimers::BackwardCompute);
    model_->backward(a);
  }
  if (!model_->embeds(a)) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::BackwardSend);
    if (sends_[slot]) sends_[slot]->wait_device();
    const Link to = backward_out();
    sends_[slot] = to.comm->send_async(a.dres, to.peer, kTagBackward);
    st.p2p_bytes += a.dres.nbytes();
  }
}

double Trainer::grad_norm_squared() {
  // Each parameter counted once across the grid: TP-replicated ones on tp rank 0 only, the tied
  // embedding copy of the last stage not at all (the first stage counts it); then summed over the
  // model-parallel group. After the DP reduction all DP replicas hold the same gradients.
  TESSERA_PHASE("grad-norm");
  // With expert parallelism a rank holds its experts only: their part is also summed over the
  // EP group (the distributed optimizer's world sum covers every expert's blocks once already).
  if (norm_grads_.empty()) {
    const std::vector<bool>& counted = counted_params();
    if (dist_opt_) {  // each DP rank holds the summed gradient of its blocks only
      norm_grads_ = dist_opt_->grad_blocks(counted);
    } else {
      const auto& specs = model_->params().specs();
      for (size_t i = 0; i < counted.size(); ++i)
        if (counted[i])
          (specs[i].expert && ctx_.ep_size > 1 ? norm_expert_grads_ : norm_grads_)
              .push_back(model_->params().grad(specs[i]));
    }
  }
  if (dist_opt_) {
    double local = be_.sum_squares_all(norm_grads_);
    ctx_.world->all_reduce_f64(&local, 1, ReduceOp::Sum);
    return local;
  }
  double v[2] = {be_.sum_squares_all(norm_grads_),
                 norm_expert_grads_.empty() ? 0.0 : be_.sum_squares_all(norm_expert_grads_)};
  ctx_.model_parallel->all_reduce_f64(v, 2, ReduceOp::Sum);
  if (ctx_.ep_size > 1) ctx_.ep->all_reduce_f64(&v[1], 1, ReduceOp::Sum);
  return v[0] + v[1];
}

const std::vector<bool>& Trainer::counted_params() {
  if (counted_.empty()) {
    const bool tied_copy = ctx_.pp_size > 1 && !ctx_.first_stage();
    for (const ParamSpec& s : model_->params().specs())
      counted_.push_back(!(s.split_axis < 0 && ctx_.tp_rank != 0) &&
                         !(tied_copy && s.name == "wte"));
  }
  return counted_;
}

double Trainer::params_norm() {
  std::vector<Tensor> ps;
  const std::vector<bool>& counted = counted_params();
  if (dist_opt_) {  // the f32 master weights of this rank's blocks (the parameters themselves in
                    // f32)
    ps = dist_opt_->param_blocks(counted);
  } else {
    std::vector<Tensor> experts;  // expert parallelism: summed over the EP group too
    const auto& specs = model_->params().specs();
    for (size_t i = 0; i < counted.size(); ++i)
      if (counted[i])
        (specs[i].expert && ctx_.ep_size > 1 ? experts : ps)
            .push_back(model_->params().param(specs[i]));
    double v[2] = {be_.sum_squares_all(ps), experts.empty() ? 0.0 : be_.sum_squares_all(experts)};
    ctx_.model_parallel->all_reduce_f64(v, 2, ReduceOp::Sum);
    if (ctx_.ep_size > 1) ctx_.ep->all_reduce_f64(&v[1], 1, ReduceOp::Sum);
    return std::sqrt(v[0] + v[1]);
  }
  double local = be_.sum_squares_all(ps);
  (dist_opt_ ? ctx_.world : ctx_.model_parallel)->all_reduce_f64(&local, 1, ReduceOp::Sum);
  return std::sqrt(local);
}

double Trainer::grad_zeros() {
  grad_norm_squared();       // builds norm_grads_: the gradient this rank counts once
  double zeros[2] = {0, 0};  // the others, this rank's experts (expert parallelism)
  for (const Tensor& g : norm_grads_) zeros[0] += be_.count_zeros(g);
  for (const Tensor& g : norm_expert_grads_) zeros[1] += be_.count_zeros(g);
  (dist_opt_ ? ctx_.world : ctx_.model_parallel)->all_reduce_f64(zeros, 2, ReduceOp::Sum);
  if (!dist_opt_ && ctx_.ep_size > 1) ctx_.ep->all_reduce_f64(&zeros[1], 1, ReduceOp::Sum);
  return zeros[0] + zeros[1];
}

double Trainer::count_loss_tokens() {
  const int T = model_cfg_.seq_length;
  const int64_t S = T + 1;
  double v[2] = {0, read_error_.empty() ? 0.0 : 1.0};  // loss tokens, ranks that failed to read
  if (read_error_.empty())
    for (size_t s = 0; s < batch_.size() / S; ++s)
      for (int t = 1; t <= T; ++t) v[0] += batch_[s * S + t] >= 0;
  // Over the world, so that a rank that could not read its samples stops every rank before the
  // step uses them; the TP x CP x PP ranks of a DP rank hold the same samples (their counts
  // agree).
  ctx_.world->all_reduce_f64(v, 2, ReduceOp::Sum);
  if (v[1] > 0) {
    const std::string why = first_message(*ctx_.world, read_error_);
    read_error_.clear();
    throw AgreedConfigError(why);
  }
  return v[0] / (ctx_.tp_size * ctx_.pp_size * ctx_.cp_size);
}

void Trainer::run_micro_batches(bool with_backward, float grad_scale, StepStats& st) {
  loss_sum_ = 0;
  dropout_ = DropoutContext{};  // evaluation: none
  if (with_backward) {
    dropout_.training = true;
    dropout_.seed = cfg_.seed;
    dropout_.iteration = iteration_ + 1;
  }
  if (with_backward) {
    for (const PipeStep& p : schedule_steps_) {
      Activations& a = slot(p.chunk, p.micro);
      if (p.forward)
        forward_micro(p.micro, a, grad_scale, st);
      else
        backward_micro(p.micro, a, st);
    }
  } else {  // forward only: every stage runs the micro-batches in order (each chunk in turn)
    for (int m = 0; m < num_micro_batches(); ++m)
      for (int c = 0; c < cfg_.virtual_pipeline_size; ++c)
        forward_micro(m, slot(c, m), grad_scale, st);
  }
  {
    PhaseSequence phase;
    if (ctx_.pp_size > 1) phase("pipeline-p2p");  // the last sends of the step
    for (auto& s : sends_)
      if (s) s->wait();
  }
  if (ctx_.last_stage()) sum_micro_losses();
}

void Trainer::sum_micro_losses() {
  // One device round trip per step; summed in double, micro-batch by micro-batch, token by token
  // (the order a host-side sum per micro-batch would take).
  TESSERA_PHASE("loss-readback");
  host_losses_.resize(static_cast<size_t>(micro_losses_.numel()));
  be_.copy_to_host(host_losses_.data(), micro_losses_);
  const size_t per = host_losses_.size() / static_cast<size_t>(num_micro_batches());
  loss_sum_ = 0;
  for (int m = 0; m < num_micro_batches(); ++m) {
    double s = 0;
    for (size_t i = 0; i < per; ++i) s += host_losses_[m * per + i];
    loss_sum_ += s;
  }
}

int64_t Trainer::schedule_step() const {
  // Iteration-based: the schedule counts updates (Megatron: skipped fp16 steps do not advance
  // it). Sample-based (a batch-size ramp): it counts the samples of the updates, this one's too.
  return cfg_.lr_schedule_in_samples ? lr_samples_ + step_batch_ : optimizer_steps() + 1;
}

int64_t Trainer::optimizer_steps() const {
  return dist_opt_ ? dist_opt_->steps_taken() : optimizer_->steps_taken();
}

void Trainer::sync_params() {
  if (dist_opt_) dist_opt_->wait_all();
}

double Trainer::validate(const TokenDataset& data, int64_t done) {
  const int64_t G = cfg_.global_batch(ctx_.dp_size);
  if (cfg_.full_validation) return evaluate(data, 0, std::max<int64_t>(1, data.num_samples() / G));
  return evaluate(data, done * cfg_.eval_iters * G, cfg_.eval_iters);
}

double Trainer::evaluate_at_end(const TokenDataset& data) {
  return validate(data, cfg_.eval_interval > 0 ? iteration_ / cfg_.eval_interval : 0);
}

double Trainer::evaluate(const TokenDataset& data, int64_t first, int64_t iters) {
  sync_params();
  TESSERA_CHECK(data.seq_length() == model_cfg_.seq_length, "evaluation data has sequence length ",
                data.seq_length(), ", the model ", model_cfg_.seq_length);
  // Megatron evaluates with the full global batch, also during a batch-size ramp.
  shape_step(cfg_.global_batch(ctx_.dp_size));
  const int64_t G = step_batch_, local = G / ctx_.dp_size;
  const int64_t S = model_cfg_.seq_length + 1;
  double loss = 0, tokens = 0;
  StepStats st;
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t begin = dp_slice_begin(first + it * G, G, ctx_.dp_size, ctx_.dp_rank);
    read_error_.clear();
    try {
      for (int64_t i = 0; i < local; ++i) data.get(begin + i, batch_.data() + i * S);
    } catch (const std::exception& e) {
      read_error_ = e.what();
      if (read_error_.empty()) read_error_ = "reading the evaluation samples failed";
    }
    tokens += count_loss_tokens();
    run_micro_batches(false, 0.0f, st);
    loss += (ctx_.last_stage() && ctx_.tp_rank == 0) ? loss_sum_ : 0.0;
    if (on_progress) on_progress(iteration_);
  }
  ctx_.world->all_reduce_f64(&loss, 1, ReduceOp::Sum);
  TESSERA_CHECK(tokens > 0, "evaluation over no loss tokens");
  return loss / tokens;
}

StepStats Trainer::train_step() {
  NVTX_RANGE("train-step");
  Timer timer;
  StepStats st;
  st.iteration = iteration_ + 1;
  shape_step(cfg_.global_batch_at(ctx_.dp_size, consumed_samples_));
  st.global_batch = step_batch_;
  load_batch(st);
  // Loss tokens of the whole global batch, known before any backward so every micro-batch's
  // gradient is scaled by the same 1/N (the loss is the mean over the global batch).
  const double tokens = count_loss_tokens();
  st.loss_tokens = static_cast<int64_t>(tokens);
  TESSERA_CHECK(st.loss_tokens > 0, "iteration ", st.iteration,
                ": the global batch has no loss tokens");
  // fp16: the loss gradient carries the loss scale; the gradients are unscaled after the
  // reduction. Scale 1 in f32 and bf16.
  const double loss_scale = scaler_.scale();
  st.loss_scale = loss_scale;
  const float grad_scale = static_cast<float>(loss_scale / tokens);
  // MoE: the load-balancing and z losses count as their mean over the global batch's
  // micro-batches (with fp16's loss scale, like the LM loss).
  moe_loss_scale_ = static_cast<float>(loss_scale * cfg_.micro_batch_size / step_batch_);
  model_->reset_moe_stats();

  model_->zero_grads();
  reducer_->begin();  // buckets start as the last micro-batch's backward completes them
  {
    st.pipeline_start = timer.seconds();
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardBackward);
    Timer pipeline;
    run_micro_batches(true, grad_scale, st);
    st.pipeline_seconds = pipeline.seconds();
  }
  Timer dp_wait;
  {
    TESSERA_PHASE("dp-grad-reduce-wait");
    IterationTimers::Scope timed(timers_, IterationTimers::GradsAllReduce);
    reducer_->finish();
  }
  if (ctx_.pp_size > 1 && (ctx_.first_stage() || ctx_.last_stage()) && model_cfg_.tied_head()) {
    TESSERA_PHASE("embedding-grad-allreduce");
    IterationTimers::Scope timed(timers_, IterationTimers::EmbeddingGradsAllReduce);
    // The tied embedding's two halves; with the distributed optimizer, the block this DP rank
    // owns (the same elements on both stages: wte has a bucket of its own).
    Tensor dwte = dist_opt_ ? dist_opt_->embedding_grad_block() : model_->params().grad("wte");
    ctx_.embedding->all_reduce(dwte, ReduceOp::Sum);
  }
  st.dp_wait_seconds = dp_wait.seconds();

  // Every rank learns the loss: only the last stage's tp-rank-0 ranks contribute their DP slice.
  double loss = (ctx_.last_stage() && ctx_.tp_rank == 0) ? loss_sum_ : 0.0;
  ctx_.world->all_reduce_f64(&loss, 1, ReduceOp::Sum);
  st.loss = loss / tokens;
  if (model_cfg_.moe()) moe_step_stats(st);
  const double norm2 = grad_norm_squared();  // of the scaled gradients; the same on every rank
  if (cfg_.compute_dtype == DType::F16) {    // fp16, dynamic or constant scale (Megatron's check)
    const bool overflow = !std::isfinite(norm2);
    scaler_.update(overflow);  // a constant scaler ignores it
    if (overflow) {            // skip the update; a dynamic scale has been lowered
      st.skipped = true;
      ++skipped_iterations_;
      iteration_ = st.iteration;
      consumed_samples_ += step_batch_;
      be_.synchronize();
      st.seconds = timer.seconds();
      st.lr = schedule_.lr(schedule_step());
      st.weight_decay = wd_schedule_.wd(schedule_step());
      return st;
    }
  }
  st.grad_norm = std::sqrt(norm2) / loss_scale;
  if (loss_scale != 1.0) {
    TESSERA_PHASE("grad-clip");  // unscaling (fp16) is the same kind of pass
    be_.scale(model_->params().flat_grads(), static_cast<float>(1.0 / loss_scale));
  }
  if (!std::isfinite(st.loss) || !std::isfinite(st.grad_norm))
    throw Error(detail::concat(
        "iteration ", st.iteration, ": loss is ", st.loss, " and grad norm is ", st.grad_norm,
        "; training stopped (lower --lr, raise --lr-warmup-iters or set --clip-grad)"));
  {
    NVTX_RANGE("optimizer");
    IterationTimers::Scope timed(timers_, IterationTimers::Optimizer);
    {
      TESSERA_PHASE("grad-clip");
      clip_grads(model_->params(), be_, st.grad_norm, cfg_.clip_grad);
    }
    // The schedule counts updates (Megatron: skipped fp16 steps do not advance it).
    st.lr = schedule_.lr(schedule_step());
    st.weight_decay = wd_schedule_.wd(schedule_step());
    if (dist_opt_) {
      {
        TESSERA_PHASE("optimizer-step");  // its blocks, then the parameter gather starts
        dist_opt_->step(st.lr, st.weight_decay, /*overlap_gather=*/true);
      }
      if (!cfg_.overlap_param_gather) {  // else each layer waits for its buckets in the forward
        TESSERA_PHASE("optimizer-step");
        IterationTimers::Scope gather(timers_, IterationTimers::ParamsAllGather);
        dist_opt_->wait_all();
      }
    } else {
      {
        TESSERA_PHASE("optimizer-step");
        optimizer_->step(st.lr, st.weight_decay);
      }
      model_->sync_compute_weights();  // phase "weights-cast" (mixed precision)
    }
  }
  iteration_ = st.iteration;
  consumed_samples_ += step_batch_;
  lr_samples_ += step_batch_;
  be_.synchronize();  // the step's time includes the device work it queued
  st.seconds = timer.seconds();
  timers_.settle();  // the step's timestamps have happened: read them, reuse the slots
  return st;
}

void Trainer::moe_step_stats(StepStats& st) {
  // Each layer's metrics summed over this rank's micro-batches; the TP ranks hold the same ones,
  // so tp rank 0 contributes; summed over DP and the pipeline stages, then averaged over the
  // micro-batches of the global batch and the MoE layers (Megatron's tracker).
  double v[2] = {0, 0};
  // (With context parallelism every CP rank holds the whole sequences' figures: cp rank 0's.)
  if (ctx_.tp_rank == 0 && ctx_.cp_rank == 0)
    for (const GPTModel::MoEStats& m : model_->moe_stats()) {
      v[0] += m.balance;
      v[1] += m.z;
    }
  ctx_.world->all_reduce_f64(v, 2, ReduceOp::Sum);
  const double micro = double(step_batch_) / cfg_.micro_batch_size;
  const double layers = model_cfg_.num_moe_layers();
  st.moe_balance = v[0] / (micro * layers);
  st.moe_z = v[1] / (micro * layers);
  interval_moe_balance_ += st.moe_balance;
  interval_moe_z_ += st.moe_z;
  ++interval_moe_steps_;
}

void Trainer::log_iteration(const StepStats& s, double interval_loss, double interval_seconds,
                            int n) {
  const double sec = interval_seconds / n;
  const int gbs = s.global_batch;
  const int ranks = ctx_.tp_size * ctx_.pp_size * ctx_.dp_size * ctx_.cp_size;
  // Over the interval's samples (a batch-size ramp changes them from step to step).
  const double samples = interval_samples_ > 0 ? static_cast<double>(interval_samples_) : gbs * n;
  const double tok_s = samples * model_cfg_.seq_length / interval_seconds;
  const double gflops = model_cfg_.train_flops_per_token() * tok_s / 1e9 / ranks;  // per rank
  char line[512];
  int len = std::snprintf(
      line, sizeof line,
      " iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
      "learning rate: %.6E | global batch size: %5d | lm loss: %.6E | grad norm: %.3f | "
      "tokens/s: %.0f | throughput per GPU (TFLOP/s/GPU): %.3f",
      (long long)s.iteration, (long long)cfg_.train_iters, (long long)consumed_samples_, sec * 1e3,
      s.lr, gbs, interval_loss / n, s.grad_norm, tok_s, gflops / 1e3);
  if (cfg_.peak_tflops > 0 && len > 0 && len < (int)sizeof line)
    len += std::snprintf(line + len, sizeof line - len, " | MFU: %.1f%%",
                         100.0 * gflops / (cfg_.peak_tflops * 1e3));
  if (cfg_.compute_dtype == DType::F16 && len > 0 && len < (int)sizeof line)
    len += std::snprintf(line + len, sizeof line - len,
                         " | loss scale: %.1f | number of skipped iterations: %lld",
                         scaler_.scale(), (long long)skipped_iterations_);
  // Collective figures (every rank logs at the same iterations).
  const double pnorm = cfg_.log_params_norm ? params_norm() : 0;
  const double zeros = cfg_.log_num_zeros_in_grad ? grad_zeros() : 0;
  if (cfg_.log_params_norm && len > 0 && len < (int)sizeof line)
    len += std::snprintf(line + len, sizeof line - len, " | params norm: %.3f", pnorm);
  if (cfg_.log_num_zeros_in_grad && len > 0 && len < (int)sizeof line)
    len += std::snprintf(line + len, sizeof line - len, " | num zeros: %.0f", zeros);
  if (wd_schedule_.scheduled() && len > 0 && len < (int)sizeof line)  // --weight-decay-incr-style
    len += std::snprintf(line + len, sizeof line - len, " | weight decay: %.6E", s.weight_decay);
  // MoE: the interval's mean load-balancing and z losses (without their coefficients).
  const bool moe_balance = model_cfg_.moe() && model_cfg_.moe_router_load_balancing_type != "none";
  const bool moe_z = model_cfg_.moe() && model_cfg_.moe_z_loss_coeff > 0;
  const double balance = interval_moe_steps_ > 0 ? interval_moe_balance_ / interval_moe_steps_ : 0;
  const double zloss = interval_moe_steps_ > 0 ? interval_moe_z_ / interval_moe_steps_ : 0;
  interval_moe_balance_ = interval_moe_z_ = 0;
  interval_moe_steps_ = 0;
  if (moe_balance && len > 0 && len < (int)sizeof line)
    len += std::snprintf(line + len, sizeof line - len, " | load_balancing_loss: %.6E", balance);
  if (moe_z && len > 0 && len < (int)sizeof line)
    len += std::snprintf(line + len, sizeof line - len, " | z_loss: %.6E", zloss);
  TLOG(info) << line;
  const std::vector<IterationTimers::Row> timed =
      timers_.collect(*ctx_.world, timers_.iteration_timers(), n);
  if (!timed.empty()) TLOG(info) << timers_.format(timed);
  if (tb_) {
    if (cfg_.log_params_norm) tb_->add_scalar("params-norm", pnorm, s.iteration);
    if (cfg_.log_num_zeros_in_grad) tb_->add_scalar("num-zeros", zeros, s.iteration);
    if (cfg_.log_timers_to_tensorboard)
      for (const IterationTimers::Row& r : timed)
        tb_->add_scalar(r.name + "-time", r.max_ms, s.iteration);
    tb_->flush();
  }
  if (metrics_.is_open()) {
    char js[512];
    std::snprintf(js, sizeof js,
                  "{\"iteration\": %lld, \"consumed_samples\": %lld, \"global_batch_size\": %d, "
                  "\"lm_loss\": %.17g, "
                  "\"lr\": %.17g, \"grad_norm\": %.17g, \"ms_per_iter\": %.4f, \"tokens_per_s\": "
                  "%.3f, \"gflops_per_s_per_rank\": %.4f, \"tflops_per_gpu\": %.6f",
                  (long long)s.iteration, (long long)consumed_samples_, s.global_batch,
                  interval_loss / n, s.lr, s.grad_norm, sec * 1e3, tok_s, gflops, gflops / 1e3);
    metrics_ << js;
    if (cfg_.peak_tflops > 0) {
      std::snprintf(js, sizeof js, ", \"mfu\": %.6f", gflops / (cfg_.peak_tflops * 1e3));
      metrics_ << js;
    }
    if (cfg_.log_params_norm) {
      std::snprintf(js, sizeof js, ", \"params_norm\": %.17g", pnorm);
      metrics_ << js;
    }
    if (cfg_.log_num_zeros_in_grad) {
      std::snprintf(js, sizeof js, ", \"num_zeros_in_grad\": %.0f", zeros);
      metrics_ << js;
    }
    if (wd_schedule_.scheduled()) {
      std::snprintf(js, sizeof js, ", \"weight_decay\": %.17g", s.weight_decay);
      metrics_ << js;
    }
    if (moe_balance) {
      std::snprintf(js, sizeof js, ", \"load_balancing_loss\": %.17g", balance);
      metrics_ << js;
    }
    if (moe_z) {
      std::snprintf(js, sizeof js, ", \"z_loss\": %.17g", zloss);
      metrics_ << js;
    }
    if (!timed.empty()) metrics_ << ", \"timers_ms\": " << IterationTimers::json(timed);
    metrics_ << "}\n" << std::flush;
    metrics_.flush();
  }
}

std::vector<StepStats> Trainer::train(const TokenDataset* eval_data) {
  Timer since_start;
  std::vector<StepStats> all;
  double interval_loss = 0, interval_loss_all = 0, interval_seconds = 0;
  int in_interval = 0, in_interval_updated = 0;
  const bool profiling = cfg_.profile && profile_this_rank();
  bool profiler_on = false;
  while (iteration_ < cfg_.train_iters) {
    // Megatron's --profile-step-start/end: capture iterations start+1 .. end (as logged).
    if (profiling && !profiler_on && iteration_ >= cfg_.profile_step_start &&
        iteration_ < cfg_.profile_step_end) {
      be_.profiler_start();
      nvtx_push("profile");
      profiler_on = true;
      TLOG(info) << "profiling iterations " << iteration_ + 1 << " to " << cfg_.profile_step_end
                 << (be_.device() == Device::CPU
                         ? " (CPU backend: NVTX range 'profile', for nsys --capture-range=nvtx)"
                         : " (cudaProfilerStart; NVTX range 'profile')");
    }
    StepStats s = train_step();
    if (all.empty() ||
        (cfg_.memory_report_interval > 0 && s.iteration % cfg_.memory_report_interval == 0))
      memory_report(s.iteration);
    if (profiler_on && iteration_ >= cfg_.profile_step_end) {
      nvtx_pop();
      be_.profiler_stop();
      profiler_on = false;
      TLOG(info) << "profiler stopped after iteration " << iteration_;
    }
    all.push_back(s);
    if (tb_ && s.iteration % cfg_.tensorboard_log_interval == 0) {
      // Megatron's tags; "vs samples" puts the consumed samples on the x axis.
      tb_->add_scalar("learning-rate", s.lr, s.iteration);
      tb_->add_scalar("learning-rate vs samples", s.lr, consumed_samples_);
      if (wd_schedule_.scheduled()) tb_->add_scalar("weight-decay", s.weight_decay, s.iteration);
      tb_->add_scalar("batch-size", s.global_batch, s.iteration);
      tb_->add_scalar("lm loss", s.loss, s.iteration);
      tb_->add_scalar("lm loss vs samples", s.loss, consumed_samples_);
      tb_->add_scalar("grad-norm", s.grad_norm, s.iteration);
      tb_->add_scalar("iteration-time", s.seconds, s.iteration);
      if (model_cfg_.moe() && model_cfg_.moe_router_load_balancing_type != "none")
        tb_->add_scalar("load_balancing_loss", s.moe_balance, s.iteration);
      if (model_cfg_.moe() && model_cfg_.moe_z_loss_coeff > 0)
        tb_->add_scalar("z_loss", s.moe_z, s.iteration);
      if (cfg_.compute_dtype == DType::F16)
        tb_->add_scalar("loss-scale", s.loss_scale, s.iteration);
    }
    interval_seconds += s.seconds;
    interval_samples_ += s.global_batch;
    ++in_interval;
    interval_loss_all += s.loss;
    if (!s.skipped) {  // Megatron averages the loss over the steps that updated
      interval_loss += s.loss;
      ++in_interval_updated;
    }
    if (s.iteration % cfg_.log_interval == 0 || s.iteration == cfg_.train_iters) {
      // log_iteration divides by the interval's length; an interval of skipped steps only shows
      // their mean loss.
      const double mean = in_interval_updated > 0 ? interval_loss / in_interval_updated
                                                  : interval_loss_all / in_interval;
      log_iteration(s, mean * in_interval, interval_seconds, in_interval);
      interval_samples_ = 0;
      interval_loss = interval_loss_all = interval_seconds = 0;
      in_interval = in_interval_updated = 0;
    }
    if (eval_data && cfg_.eval_interval > 0 && s.iteration % cfg_.eval_interval == 0) {
      const double l = validate(*eval_data, s.iteration / cfg_.eval_interval - 1);
      char line[256];
      std::snprintf(line, sizeof line,
                    " validation loss at iteration %lld | lm loss value: %.6E | lm loss PPL: %.6E",
                    (long long)s.iteration, l, std::exp(std::min(l, 700.0)));
      TLOG(info) << line;
      if (metrics_.is_open())
        metrics_ << "{\"iteration\": " << s.iteration << ", \"valid_lm_loss\": " << l << "}\n"
                 << std::flush;
      if (tb_) {
        tb_->add_scalar("lm loss validation", l, s.iteration);
        tb_->add_scalar("lm loss validation vs samples", l, consumed_samples_);
        if (cfg_.log_validation_ppl_to_tensorboard) {
          tb_->add_scalar("lm loss validation ppl", std::exp(std::min(l, 20.0)), s.iteration);
          tb_->add_scalar("lm loss validation ppl vs samples", std::exp(std::min(l, 20.0)),
                          consumed_samples_);
        }
        tb_->flush();
      }
      if (on_progress) on_progress(s.iteration);
    }
    finish_async_save(/*blocking=*/false);  // a background save done on every rank commits
    if (!cfg_.save.empty() && cfg_.save_interval > 0 && s.iteration % cfg_.save_interval == 0)
      save_checkpoint(cfg_.save);
    if (on_progress) on_progress(s.iteration);
    // SIGTERM / SIGUSR1 on any rank: every rank agrees here, saves and stops cleanly.
    double sig = stop_signal();
    ctx_.world->all_reduce_f64(&sig, 1, ReduceOp::Max);
    if (sig > 0) {
      stopped_by_signal_ = static_cast<int>(sig);
      TLOG(info) << "received signal " << stopped_by_signal_ << " ("
                 << (stopped_by_signal_ == SIGUSR1 ? "SIGUSR1" : "SIGTERM")
                 << "): stopping after iteration " << s.iteration
                 << (cfg_.save.empty() ? " (no --save: nothing is saved)"
                                       : ", saving a checkpoint");
      if (profiler_on) {
        nvtx_pop();
        be_.profiler_stop();
      }
      if (!cfg_.save.empty() && last_saved_ != iteration_) save_checkpoint(cfg_.save);
      finish_async_save(/*blocking=*/true);  // a signal waits for the write to finish
      sync_params();
      return all;
    }
    bool exit_now = cfg_.exit_interval > 0 && s.iteration % cfg_.exit_interval == 0;
    if (cfg_.exit_duration_mins > 0) {  // rank 0's clock decides, so every rank stops together
      double over =
          ctx_.world_rank == 0 && since_start.seconds() >= cfg_.exit_duration_mins * 60 ? 1 : 0;
      ctx_.world->all_reduce_f64(&over, 1, ReduceOp::Max);
      exit_now = exit_now || over > 0;
    }
    if (exit_now && s.iteration < cfg_.train_iters) {
      TLOG(info) << "exiting at iteration " << s.iteration
                 << " (--exit-interval / --exit-duration-in-mins)";
      break;
    }
  }
  if (profiler_on) {
    nvtx_pop();
    be_.profiler_stop();
  }
  if (!cfg_.save.empty() && last_saved_ != iteration_) save_checkpoint(cfg_.save);
  finish_async_save(/*blocking=*/true);  // the end of training waits for the write to finish
  sync_params();
  if (tb_) tb_->flush();
  return all;
}

void Trainer::memory_report(int64_t iteration) {
  const Backend::MemoryStats m = be_.memory_stats();
  const int R = ctx_.world->size(), me = ctx_.world->rank();
  std::vector<double> all(static_cast<size_t>(4 * R), 0.0);  // every rank's, gathered by a sum
  const GridLayout layout = GridLayout::make(R, ctx_.tp_size, ctx_.pp_size, ctx_.cp_size);
  all[4 * me] = m.allocated;
  all[4 * me + 1] = m.max_allocated;
  all[4 * me + 2] = m.reserved;
  all[4 * me + 3] =
      estimate_rank_memory(model_cfg_, cfg_, layout, ctx_.pp_rank, ctx_.ep_size).total_bytes();
  ctx_.world->all_reduce_f64(all.data(), static_cast<int64_t>(all.size()), ReduceOp::Sum);
  const double MB = 1024.0 * 1024.0;
  for (int r = 0; r < R; ++r) {
    char line[320];
    std::snprintf(
        line, sizeof line,
        "[Rank %d] (after %lld iterations) memory (MB) | allocated: %.2f | max allocated: "
        "%.2f | reserved (%s): %.2f | --dry-run estimate: %.2f",
        r, (long long)iteration, all[4 * r] / MB, all[4 * r + 1] / MB, m.reserved_what,
        all[4 * r + 2] / MB, all[4 * r + 3] / MB);
    TLOG(info) << line;
  }
}

bool Trainer::profile_this_rank() const {
  const std::vector<int>& r = cfg_.profile_ranks;
  return r.empty() || std::find(r.begin(), r.end(), ctx_.world_rank) != r.end();
}

// ---- checkpoints ------------------------------------------------------------------------------

void Trainer::save_checkpoint(const std::string& dir) {
  {
    IterationTimers::Scope timed(timers_, IterationTimers::SaveCheckpoint);
    write_checkpoint(dir);
  }
  // Megatron's save-checkpoint timer (every timing level), min and max over the ranks. Collected
  // outside the log statement: a filtered-out record (ranks that do not print) evaluates nothing.
  const std::vector<IterationTimers::Row> rows =
      timers_.collect(*ctx_.world, {IterationTimers::SaveCheckpoint}, 1);
  TLOG(info) << timers_.format(rows);
}

// --async-save: the state staged in host buffers (pinned on the GPU), the HDF5 write and its
// read-back verification on a thread of their own; the commit (the atomic rename and the latest
// file, agreed by every rank) on the training thread once every rank's write has finished.
struct Trainer::AsyncSave {
  explicit AsyncSave(Backend& b) : be(b) {}
  ~AsyncSave() {
    if (thread.joinable()) thread.join();
    for (auto& s : staged) be.free_host(s.data);
  }
  // Staging buffer k (parameters, exp_avg, exp_avg_sq) of at least n floats, reused save to save.
  float* stage(int k, size_t n) {
    if (staged[k].size < n) {
      be.free_host(staged[k].data);
      staged[k].data = nullptr;
      staged[k].data = static_cast<float*>(be.alloc_host(n * sizeof(float)));
      staged[k].size = n;
    }
    return staged[k].data;
  }
  Backend& be;
  struct Buffer {
    float* data = nullptr;
    size_t size = 0;
  } staged[3];
  std::vector<float> gathered[3];  // the distributed optimizer's state, gathered on DP rank 0
  std::vector<float> experts[3];   // expert parallelism: the state with every expert
  std::thread thread;              // the writer of this rank's shard (DP rank 0 only)
  std::atomic<bool> done{true};
  std::string error;  // why the write failed (set by the thread before done)
  int64_t iteration = 0;
  std::string dir;
  Timer started;
  double blocked_seconds = 0;
};

Trainer::~Trainer() = default;  // joins a writer still running (an error path: nothing commits)

void Trainer::write_checkpoint(const std::string& dir) {
  NVTX_RANGE("checkpoint-save");
  finish_async_save(/*blocking=*/true);  // the next save waits for the previous one
  Timer t;
  CheckpointMeta meta;
  meta.iteration = iteration_;
  meta.consumed_samples = consumed_samples_;
  meta.optimizer_steps = optimizer_steps();
  meta.lr_schedule_samples = cfg_.lr_schedule_in_samples ? lr_samples_ : -1;
  meta.seed = cfg_.seed;
  meta.model = model_cfg_;
  meta.tp_size = ctx_.tp_size;
  meta.pp_size = ctx_.pp_size;
  meta.dp_size = ctx_.dp_size;
  meta.has_optimizer = !cfg_.no_save_optim;
  meta.config_text = cfg_.config_text;
  if (scaler_.is_dynamic()) {
    meta.has_loss_scale = true;
    meta.skipped_iterations = skipped_iterations_;
    meta.loss_scale = scaler_.scale();
    meta.loss_scale_growth_tracker = scaler_.growth_tracker();
    meta.loss_scale_hysteresis_tracker = scaler_.hysteresis_tracker();
  }
  // Directory set-up by rank 0; a failure there is everyone's failure.
  double failed = 0;
  std::string error;
  if (ctx_.world_rank == 0) {
    try {
      begin_checkpoint_dir(dir, iteration_);
    } catch (const std::exception& e) {
      failed = 1;
      error = e.what();
    }
  }
  ctx_.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
  if (failed)
    throw Error(ctx_.world_rank == 0 ? error : "checkpoint directory set-up failed on rank 0");
  const bool async = cfg_.async_save;
  if (async && !async_) async_ = std::make_unique<AsyncSave>(be_);
  // The distributed optimizer's state is gathered (collective over DP) into the global layout on
  // data-parallel rank 0, which writes the same file as without it.
  std::vector<float> local_gathered[3];
  std::vector<float>* gathered = async ? async_->gathered : local_gathered;
  if (dist_opt_) {
    sync_params();
    // (With expert parallelism every EP rank of the first expert-data-parallel replica: each
    // holds its experts' blocks in full.)
    const bool want = ctx_.dp_rank < ctx_.ep_size && ctx_.cp_rank == 0;
    if (dist_opt_->owns_master()) gathered[0] = dist_opt_->gather_state("master", want);
    if (!cfg_.no_save_optim) {
      gathered[1] = dist_opt_->gather_state("exp_avg", want);
      gathered[2] = dist_opt_->gather_state("exp_avg_sq", want);
    }
  }
  const std::string path = dir + "/" + iteration_dir_name(iteration_) + ".tmp/" +
                           shard_file_name(ctx_.tp_rank, ctx_.pp_rank);
  // DP replicas hold the same state: data-parallel rank 0 of each (tp, pp) writes its file. With
  // expert parallelism the file holds every expert all the same (checkpoints do not depend on
  // EP): the other EP ranks of the first replica send it theirs.
  if (ctx_.dp_rank < ctx_.ep_size && ctx_.cp_rank == 0) {  // CP ranks hold the same state
    try {
      const char* fault = std::getenv("TESSERA_FAULT_SAVE_RANK");  // testing: fail this rank's save
      int fault_rank = -1;
      long long fault_iter = 0;
      if (fault)
        std::sscanf(fault, "%d:%lld", &fault_rank, &fault_iter);  // "RANK[:FROM_ITERATION]"
      const int fail_after = fault_rank == ctx_.world_rank && iteration_ >= fault_iter ? 3 : -1;
      ParamStore& ps = model_->params();
      // The writer reads host memory: device state is staged through host buffers first; an
      // asynchronous save stages everything (the next step changes the state in place).
      const float* host[3];
      Tensor* state[3] = {nullptr, nullptr, nullptr};
      if (ps.has_master()) state[0] = &ps.flat_params();
      if (optimizer_ && !cfg_.no_save_optim) {  // --no-save-optim: no moments to stage
        state[1] = &optimizer_->exp_avg();
        state[2] = &optimizer_->exp_avg_sq();
      }
      std::vector<float> staged[3];
      for (int k = 0; k < 3; ++k) {
        if (!state[k]) {
          host[k] = gathered[k].data();
        } else if (async) {
          const size_t n = static_cast<size_t>(state[k]->numel());
          float* buf = async_->stage(k, n);
          if (be_.device() == Device::CPU)
            std::memcpy(buf, state[k]->f32(), n * sizeof(float));
          else
            be_.copy_to_host(buf, *state[k]);
          host[k] = buf;
        } else if (be_.device() == Device::CPU) {
          host[k] = state[k]->f32();
        } else {
          staged[k].resize(static_cast<size_t>(state[k]->numel()));
          be_.copy_to_host(staged[k].data(), *state[k]);
          host[k] = staged[k].data();
        }
      }
      ShardTensors tensors{&ps.specs(), host[0], host[1], host[2]};
      if (ctx_.ep_size > 1) {
        std::vector<float>* full = async ? async_->experts : ep_full_;
        gather_experts(host, ep_specs_, full);
        if (ctx_.dp_rank != 0) throw SkipWrite{};
        tensors =
            ShardTensors{&ep_specs_, host[0] ? full[0].data() : nullptr,
                         host[1] ? full[1].data() : nullptr, host[2] ? full[2].data() : nullptr};
      }
      if (async) {
        AsyncSave* a = async_.get();
        a->error.clear();
        a->done.store(false, std::memory_order_release);
        a->thread = std::thread([a, path, meta, shard = model_->shard(), tensors, fail_after] {
          try {
            write_checkpoint_shard(path, meta, shard, tensors, fail_after);
          } catch (const std::exception& e) {
            a->error = e.what();
          }
          a->done.store(true, std::memory_order_release);
        });
      } else {
        write_checkpoint_shard(path, meta, model_->shard(), tensors, fail_after);
        for (std::vector<float>& v : ep_full_) std::vector<float>().swap(v);  // EP's full copy
      }
    } catch (const SkipWrite&) {  // an EP rank that sent its experts to DP rank 0
    } catch (const std::exception& e) {
      failed = 1;
      error = e.what();
      TLOG(error) << "checkpoint save failed here: " << error;
    }
  }
  if (async) {
    // Staging failed somewhere (host memory): reported now, as a synchronous save would.
    ctx_.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
    if (failed) {
      if (async_->thread.joinable()) async_->thread.join();
      commit_save(dir, iteration_, failed, error);  // abandons the directory and throws
    }
    async_pending_ = true;
    async_->iteration = iteration_;
    async_->dir = dir;
    async_->blocked_seconds = t.seconds();
    async_->started.reset();
    last_saved_ = iteration_;
    if (on_progress) on_progress(iteration_);
    TLOG(info) << "checkpoint of iteration " << iteration_ << ": state staged in "
               << async_->blocked_seconds << " s; writing " << dir << "/"
               << iteration_dir_name(iteration_) << " in the background (--async-save)";
    return;
  }
  commit_save(dir, iteration_, failed, error);
  last_saved_ = iteration_;
  if (on_progress) on_progress(iteration_);
  TLOG(info) << "saved checkpoint " << dir << "/" << iteration_dir_name(iteration_) << " in "
             << t.seconds() << " s";
}

void Trainer::gather_experts(const float* const local[3], std::vector<ParamSpec>& specs,
                             std::vector<float> full[3]) {
  // The specs of this (tp, pp) shard with every expert (expert-parallel size 1), in a plain flat
  // layout; the non-expert values are this rank's, each expert's comes from its EP rank (a sum
  // with zeros: exact).
  ModelShard one = model_->shard();
  one.ep_size = 1;
  one.ep_rank = 0;
  specs = build_param_specs(model_cfg_, one);
  layout_flat_buffer(specs, FlatLayout{});
  int64_t total = 0;
  for (const ParamSpec& s : specs) total = std::max(total, s.flat_offset + s.numel());
  for (int k = 0; k < 3; ++k)
    if (local[k]) full[k].assign(static_cast<size_t>(total), 0.f);
  const ParamStore& ps = model_->params();
  const int El = model_cfg_.num_experts / ctx_.ep_size;
  std::vector<double> buf;
  for (const ParamSpec& s : specs) {
    const bool mine = ps.has(s.name);
    if (!s.expert) {
      TESSERA_CHECK(mine, "parameter ", s.name, " missing on an expert-parallel rank");
      for (int k = 0; k < 3; ++k)
        if (local[k])
          std::copy(local[k] + ps.spec(s.name).flat_offset,
                    local[k] + ps.spec(s.name).flat_offset + s.numel(),
                    full[k].begin() + s.flat_offset);
      continue;
    }
    const size_t at = s.name.find(".experts.") + 9;
    const int owner = std::stoi(s.name.substr(at)) / El;
    buf.assign(static_cast<size_t>(3 * s.numel()), 0.0);
    if (owner == ctx_.ep_rank) {
      TESSERA_CHECK(mine, "expert parameter ", s.name, " missing on its expert-parallel rank");
      for (int k = 0; k < 3; ++k)
        if (local[k]) {
          const float* src = local[k] + ps.spec(s.name).flat_offset;
          for (int64_t i = 0; i < s.numel(); ++i)
            buf[static_cast<size_t>(k * s.numel() + i)] = src[i];
        }
    }
    ctx_.ep->all_reduce_f64(buf.data(), static_cast<int64_t>(buf.size()), ReduceOp::Sum);
    for (int k = 0; k < 3; ++k)
      if (local[k])
        for (int64_t i = 0; i < s.numel(); ++i)
          full[k][static_cast<size_t>(s.flat_offset + i)] =
              static_cast<float>(buf[static_cast<size_t>(k * s.numel() + i)]);
  }
}

void Trainer::commit_save(const std::string& dir, int64_t iteration, double failed,
                          const std::string& error) {
  ctx_.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
  std::string why = error;
  if (ctx_.world_rank == 0) {
    try {
      if (failed)
        abandon_checkpoint_dir(dir, iteration);
      else
        commit_checkpoint_dir(dir, iteration, cfg_.keep_checkpoints);
    } catch (const std::exception& e) {
      failed = 2;
      why = e.what();
    }
  }
  ctx_.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
  if (failed)
    throw Error(detail::concat("saving the checkpoint of iteration ", iteration, " to '", dir,
                               "' failed", why.empty() ? " on another rank" : ": " + why,
                               "; the previous checkpoint is intact"));
}

void Trainer::finish_async_save(bool blocking) {
  if (!async_pending_) return;
  AsyncSave& a = *async_;
  if (!blocking) {  // every rank asks at the same point; all go on until every write is done
    double busy = a.thread.joinable() && !a.done.load(std::memory_order_acquire) ? 1 : 0;
    ctx_.world->all_reduce_f64(&busy, 1, ReduceOp::Sum);
    if (busy > 0) return;
  }
  Timer waited;
  if (a.thread.joinable()) a.thread.join();
  async_pending_ = false;
  for (auto& g : a.gathered) std::vector<float>().swap(g);  // the next save gathers afresh
  const double failed = a.error.empty() ? 0 : 1;
  if (failed) TLOG(error) << "checkpoint save failed here: " << a.error;
  commit_save(a.dir, a.iteration, failed, a.error);
  TLOG(info) << "saved checkpoint " << a.dir << "/" << iteration_dir_name(a.iteration) << " in "
             << a.started.seconds() << " s in the background (--async-save; the loop was blocked "
             << a.blocked_seconds << " s staging the state"
             << (blocking ? detail::concat(" and ", waited.seconds(), " s waiting for the write")
                          : std::string())
             << ")";
}

void Trainer::wait_for_saves() {
  finish_async_save(/*blocking=*/true);
}

void Trainer::load_checkpoint(const std::string& dir, bool model_only, bool load_optimizer) {
  finish_async_save(/*blocking=*/true);
  Timer t;
  CheckpointReader r(dir);
  r.check_model(model_cfg_);
  const CheckpointMeta& m = r.meta();
  ParamStore& ps = model_->params();
  const bool optimizer = m.has_optimizer && !model_only && load_optimizer;
  std::vector<float> host;  // each slice is read on the host, then copied to the backend
  auto load = [&](const char* group, const ParamSpec& s, Tensor dst) {
    host.resize(static_cast<size_t>(s.numel()));
    r.read_slice(group, s, host.data());
    be_.copy_from_host(dst, host.data());
  };
  if (dist_opt_) {  // each rank keeps the parts of the global tensors in its blocks
    sync_params();
    if (!optimizer) dist_opt_->zero_moments();
    for (const ParamSpec& s : ps.specs()) {
      host.resize(static_cast<size_t>(s.numel()));
      r.read_slice("model", s, host.data());
      if (dist_opt_->owns_master()) {
        dist_opt_->set_state("master", s, host.data());
      } else {
        Tensor p = ps.param(s);
        be_.copy_from_host(p, host.data());
      }
      if (optimizer)
        for (const char* which : {"exp_avg", "exp_avg_sq"}) {
          r.read_slice((std::string("optimizer/") + which).c_str(), s, host.data());
          dist_opt_->set_state(which, s, host.data());
        }
    }
    dist_opt_->publish();
  } else {
    for (const ParamSpec& s : ps.specs()) {
      load("model", s, ps.param(s));
      if (optimizer) {
        load("optimizer/exp_avg", s, optimizer_->exp_avg().view(s.flat_offset, s.local_shape));
        load("optimizer/exp_avg_sq", s,
             optimizer_->exp_avg_sq().view(s.flat_offset, s.local_shape));
      }
    }
    model_->sync_compute_weights();
    if (!optimizer) {
      be_.zero(optimizer_->exp_avg());
      be_.zero(optimizer_->exp_avg_sq());
    }
  }
  if (optimizer && m.has_loss_scale && scaler_.is_dynamic()) {
    scaler_.restore(m.loss_scale, m.loss_scale_growth_tracker, m.loss_scale_hysteresis_tracker);
    skipped_iterations_ = m.skipped_iterations;
  }
  const int64_t steps = optimizer ? m.optimizer_steps : 0;
  // The sample-based schedule's position: stored by a ramped run; otherwise every consumed
  // sample was an update's (a constant batch without skipped steps).
  lr_samples_ = !optimizer                   ? 0
                : m.lr_schedule_samples >= 0 ? m.lr_schedule_samples
                                             : m.consumed_samples;
  if (dist_opt_)
    dist_opt_->set_steps_taken(steps);
  else
    optimizer_->set_steps_taken(steps);
  if (model_only) {
    iteration_ = consumed_samples_ = 0;
  } else {
    iteration_ = m.iteration;
    consumed_samples_ = m.consumed_samples;
  }
  last_saved_ = iteration_;
  const bool same = m.tp_size == ctx_.tp_size && m.pp_size == ctx_.pp_size;
  TLOG(info) << "loaded checkpoint " << r.path() << " (iteration " << m.iteration
             << ", consumed samples " << m.consumed_samples << ", saved at TP " << m.tp_size
             << " x PP " << m.pp_size << " x DP " << m.dp_size
             << (same ? ""
                      : "; resharded on load to TP " + std::to_string(ctx_.tp_size) + " x PP " +
                            std::to_string(ctx_.pp_size))
             << (m.has_optimizer ? "" : "; no optimizer state in it: Adam starts from zero")
             << (model_only ? "; model only: iteration, data and optimizer start fresh" : "")
             << (!model_only && !load_optimizer
                     ? "; --no-load-optim: the optimizer and its step count start fresh"
                     : "")
             << ") in " << t.seconds() << " s";
  if (!model_only && load_optimizer) {  // the schedule continues: say where it changes course
    const bool length_matters =
        (cfg_.lr_decay_iters == 0 && cfg_.lr_decay_style != "constant") || wd_schedule_.scheduled();
    const std::string changed = schedule_changes(m.config_text, cfg_.config_text, length_matters);
    if (!changed.empty())
      TLOG(warning) << "the learning-rate / weight-decay schedule differs from checkpoint "
                    << r.path() << "'s (" << changed << "); this run's options are used from "
                    << "iteration " << iteration_ + 1
                    << " (as Megatron-LM's --override-opt_param-scheduler)";
  }
  if (!m.has_optimizer && !model_only && load_optimizer)
    TLOG(warning) << "checkpoint " << r.path()
                  << " holds no optimizer state; Adam moments start at zero";
}

}  // namespace tessera
