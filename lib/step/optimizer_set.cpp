// optimizer_set.cpp: gradient reduction, loss scaling, clipping and the update
// (step/optimizer_set.hpp).
#include "step/optimizer_set.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"
#include "run/layout.hpp"

namespace tessera {

FlatLayout OptimizerSet::flat_layout(const TrainConfig& cfg, const GPTConfig& model_cfg,
                                     const ParallelContext& ctx) {
  return training_flat_layout(cfg, model_cfg, ctx);
}

OptimizerSet::OptimizerSet(GPTModel& model, Backend& be, const TrainConfig& cfg,
                           const ParallelContext& ctx, IterationTimers& timers)
    : model_(model),
      be_(be),
      cfg_(cfg),
      ctx_(ctx),
      timers_(timers),
      lr_schedule_(LrSchedule::of(cfg, ctx.dp_size)),
      wd_schedule_(WeightDecaySchedule::of(cfg)) {
  const bool dist = cfg_.use_distributed_optimizer;
  mtp_rank_ = standalone_mtp_rank(model_.config(), cfg_, ctx_.pp_size);
  // The groups the distributed optimizer's state is cut over: DP x CP (the routed experts' over
  // expert DP x CP), or with HSDP one instance of it (ParallelContext::dp_shard).
  Communicator* expert_dp = ctx_.ep_size > 1 ? ctx_.expert_shard_group() : nullptr;
  scaler_ = cfg_.compute_dtype != DType::F16 ? LossScaler::constant(1.0)
            : cfg_.loss_scale > 0
                ? LossScaler::constant(cfg_.loss_scale)
                : LossScaler::dynamic(cfg_.initial_loss_scale, cfg_.min_loss_scale,
                                      cfg_.loss_scale_window, cfg_.hysteresis);
  std::vector<bool> muon_params;  // --optimizer muon: its matrices; AdamW the rest
  for (const ParamSpec& s : model_.params().specs())
    muon_params.push_back(cfg_.optimizer == "muon" && is_muon_param(s));
  if (dist) {
    dist_opt_ = std::make_unique<DistributedAdamW>(
        model_, be_, *ctx_.shard_group(), cfg_.adam_beta1, cfg_.adam_beta2, cfg_.adam_eps,
        expert_dp, &muon_params, ctx_.replica_group(), ctx_.expert_replica_group());
    if (cfg_.optimizer == "muon")  // layer-wise over the blocks (step/muon.hpp)
      muon_ = std::make_unique<Muon>(model_.params(), be_, cfg_.muon, *ctx_.tp, *dist_opt_);
    if (dist_opt_->owns_master()) {
      model_.init_parameters(cfg_.seed, [this](const ParamSpec& s, const float* v) {
        dist_opt_->set_state("master", s, v);
      });
      dist_opt_->publish();
    } else {
      model_.init_parameters(cfg_.seed);
    }
    if (cfg_.fsdp_shards_grads()) {  // after the master weights are set (step/fsdp.hpp)
      auto fsdp = std::make_unique<FsdpUnits>(model_, be_, *dist_opt_);
      fsdp_ = fsdp.get();
      reduction_ = std::move(fsdp);
    }
    wait_params_ = cfg_.overlap_param_gather && !cfg_.fsdp_shards_params();
  } else {
    model_.init_parameters(cfg_.seed);
    optimizer_ = std::make_unique<AdamW>(model_.params(), be_, cfg_.adam_beta1, cfg_.adam_beta2,
                                         cfg_.adam_eps);
    if (cfg_.optimizer == "muon") {  // Muon's matrices; AdamW the rest (step/muon.hpp)
      muon_ =
          std::make_unique<Muon>(model_.params(), be_, cfg_.muon, *ctx_.tp, optimizer_->exp_avg());
      optimizer_->skip_params(muon_params);
    }
  }
  if (!reduction_)
    reduction_ = std::make_unique<GradReducer>(model_, dist ? *ctx_.shard_group() : *ctx_.dp, dist,
                                               cfg_.overlap_grad_reduce, expert_dp);
  norms_ = std::make_unique<GridNorms>(model_, be_, ctx_, dist_opt_.get());
  model_.add_observer(this);
}

OptimizerSet::~OptimizerSet() {
  model_.remove_observer(this);
}

void OptimizerSet::grads_ready(int piece) {
  // The last micro-batch's backward (of the piece's chunk; every one's under FSDP's sharded
  // gradients) completes a piece's gradients: the TP sums first, then the DP reduction.
  if (!reduction_->every_micro_batch() && !(last_backward_ && last_backward_())) return;
  model_.reduce_sequence_parallel_grads(piece);
  reduction_->piece_ready(piece);
}

void OptimizerSet::before_forward(int piece) {
  if (wait_params_) dist_opt_->wait_params(piece);
}

void OptimizerSet::begin_step() {
  reduction_->begin_step();
}

void OptimizerSet::finish_reduction() {
  {
    TESSERA_PHASE("dp-grad-reduce-wait");
    IterationTimers::Scope timed(timers_, IterationTimers::GradsAllReduce);
    reduction_->finish();
    if (dist_opt_) dist_opt_->reduce_replicas();  // HSDP: across the instances, once a step
  }
  if (ctx_.pp_size == 1) return;
  auto block = [&](const char* name) {  // with the distributed optimizer, this DP rank's block
    return dist_opt_ ? dist_opt_->grad_block(name) : model_.params().grad(name);
  };
  // Multi-token prediction on a stage of its own (rank m): its copies' gradients join the last
  // stage's, which sends the sums back: the word embedding's before and after the embedding
  // group's sum (m = 0 is in that group already), the output layer's (untied).
  const int m = mtp_rank_, last = ctx_.pp_size - 1;
  const bool untied = !model_.config().tied_head();
  const bool wte_pair = m > 0, pair = m >= 0 && (ctx_.pp_rank == m || ctx_.pp_rank == last);
  if (pair && wte_pair) exchange_half(block("wte"), m, last, true);
  if ((ctx_.first_stage() || ctx_.last_stage()) && model_.config().embedding_on_last_stage()) {
    TESSERA_PHASE("embedding-grad-allreduce");
    IterationTimers::Scope timed(timers_, IterationTimers::EmbeddingGradsAllReduce);
    // The embedding's copies (tied, or read by multi-token prediction); with the distributed
    // optimizer, the block this DP rank owns (the same elements on every stage: wte has a
    // bucket of its own).
    Tensor dwte = block("wte");
    ctx_.embedding->all_reduce(dwte, ReduceOp::Sum);
  }
  if (pair && wte_pair) exchange_half(block("wte"), m, last, false);
  if (pair && untied) {
    exchange_half(block("lm_head"), m, last, true);
    exchange_half(block("lm_head"), m, last, false);
  }
}

void OptimizerSet::exchange_half(Tensor grad, int m, int last, bool to_last) {
  TESSERA_PHASE("mtp-copy-grad-p2p");
  IterationTimers::Scope timed(timers_, IterationTimers::EmbeddingGradsAllReduce);
  Communicator& pp = *ctx_.pp;
  constexpr int kTag = 7301;
  if (to_last && ctx_.pp_rank == m) {
    pp.send_async(grad, last, kTag)->wait();
  } else if (to_last) {  // the last stage adds the copy's gradient to its own
    if (!copy_grad_.defined() || copy_grad_.numel() < grad.numel())
      copy_grad_ = Tensor({grad.numel()}, grad.dtype(), be_.allocator());
    Tensor in = copy_grad_.view(0, grad.shape());
    pp.recv(in, m, kTag);
    be_.add(grad, grad, in);
  } else if (ctx_.pp_rank == last) {
    pp.send_async(grad, m, kTag + 1)->wait();
  } else {
    pp.recv(grad, last, kTag + 1);
  }
}

int64_t OptimizerSet::lr_schedule_step(int global_batch) const {
  // Iteration-based: the schedule counts updates (Megatron: skipped fp16 steps do not advance
  // it). Sample-based (a batch-size ramp): it counts the samples of the updates, this one's too.
  return cfg_.lr_schedule_in_samples ? lr_samples_ + global_batch : steps_taken() + 1;
}

OptimizerSet::Update OptimizerSet::step(int64_t iteration, double loss, int global_batch) {
  Update u;
  const double loss_scale = scaler_.scale();
  const double norm2 = norms_->grad_norm_squared();  // of the scaled gradients; same on every rank
  if (cfg_.compute_dtype == DType::F16) {  // fp16, dynamic or constant scale (Megatron's check)
    const bool overflow = !std::isfinite(norm2);
    scaler_.update(overflow);  // a constant scaler ignores it
    if (overflow) {            // skip the update; a dynamic scale has been lowered
      ++skipped_iterations_;
      u.lr = lr_schedule_.lr(lr_schedule_step(global_batch));
      u.weight_decay = wd_schedule_.wd(lr_schedule_step(global_batch));
      if (cfg_.log_num_zeros_in_grad) u.num_zeros = norms_->grad_zeros();
      return u;
    }
  }
  u.grad_norm = std::sqrt(norm2) / loss_scale;
  if (loss_scale != 1.0) {
    TESSERA_PHASE("grad-clip");  // unscaling (fp16) is the same kind of pass
    Tensor grads = reduction_->reduced_grads();
    be_.scale(grads, static_cast<float>(1.0 / loss_scale));
  }
  if (!std::isfinite(loss) || !std::isfinite(u.grad_norm))
    throw Error(detail::concat(
        "iteration ", iteration, ": loss is ", loss, " and grad norm is ", u.grad_norm,
        "; training stopped (lower --lr, raise --lr-warmup-iters or set --clip-grad)"));
  {
    NVTX_RANGE("optimizer");
    IterationTimers::Scope timed(timers_, IterationTimers::Optimizer);
    // The clip factor goes into the optimizer, which multiplies each gradient as it reads it:
    // the same bits as a scaling pass first, without the pass (Megatron folds it the same way).
    const double clip = clip_coefficient(u.grad_norm, cfg_.clip_grad);
    // The schedule counts updates (Megatron: skipped fp16 steps do not advance it).
    u.lr = lr_schedule_.lr(lr_schedule_step(global_batch));
    u.weight_decay = wd_schedule_.wd(lr_schedule_step(global_batch));
    update(u, clip);
  }
  u.update_successful = true;
  lr_samples_ += global_batch;
  if (cfg_.log_num_zeros_in_grad) u.num_zeros = norms_->grad_zeros();
  return u;
}

void OptimizerSet::update(Update& u, double grad_scale) {
  if (!dist_opt_) {
    {
      TESSERA_PHASE("optimizer-step");
      if (muon_) muon_->step(u.lr, u.weight_decay, grad_scale);
      optimizer_->step(u.lr, u.weight_decay, grad_scale);  // and the compute copy's refresh
    }
    return;
  }
  {
    TESSERA_PHASE("optimizer-step");  // its blocks, then the parameter gather starts
    if (muon_) {
      dist_opt_->wait_all();  // a gather still in flight writes the compute copy
      muon_->step(u.lr, u.weight_decay, grad_scale);
    }
    dist_opt_->step(u.lr, u.weight_decay, /*overlap_gather=*/true, grad_scale);
  }
  if (!cfg_.overlap_param_gather) {  // else each layer waits for its buckets in the forward
    TESSERA_PHASE("optimizer-step");
    IterationTimers::Scope gather(timers_, IterationTimers::ParamsAllGather);
    dist_opt_->wait_all();
  }
}

void OptimizerSet::sync_params() {
  if (dist_opt_) dist_opt_->wait_all();
}

int64_t OptimizerSet::steps_taken() const {
  return dist_opt_ ? dist_opt_->steps_taken() : optimizer_->steps_taken();
}

void OptimizerSet::set_steps_taken(int64_t steps) {
  if (dist_opt_)
    dist_opt_->set_steps_taken(steps);
  else
    optimizer_->set_steps_taken(steps);
}

}  // namespace tessera
