// grid_norms.cpp: grid-wide gradient and parameter norms (step/grid_norms.hpp).
#include "step/grid_norms.hpp"

#include <cmath>

#include "core/phase_timer.hpp"

namespace tessera {

GridNorms::GridNorms(GPTModel& model, Backend& be, const ParallelContext& ctx,
                     DistributedAdamW* dist)
    : model_(model), be_(be), ctx_(ctx), dist_(dist) {}

const std::vector<bool>& GridNorms::counted_params() {
  if (counted_.empty()) {
    // The copies count once: the word embedding on the first stage, the output layer on the last
    // (multi-token prediction on a stage of its own holds a copy of both).
    const bool tied_copy = ctx_.pp_size > 1 && !ctx_.first_stage();
    const bool head_copy = !model_.shard().has_head;
    for (const ParamSpec& s : model_.params().specs())
      counted_.push_back(!(s.split_axis < 0 && ctx_.tp_rank != 0) &&
                         !(tied_copy && s.name == "wte") && !(head_copy && s.name == "lm_head"));
  }
  return counted_;
}

void GridNorms::build_grad_views() {
  if (!norm_grads_.empty()) return;
  const std::vector<bool>& counted = counted_params();
  if (dist_) {  // each DP rank holds the summed gradient of its blocks only
    norm_grads_ = dist_->grad_blocks(counted);
    return;
  }
  const auto& specs = model_.params().specs();
  for (size_t i = 0; i < counted.size(); ++i)
    if (counted[i])
      (specs[i].expert && ctx_.ep_size > 1 ? norm_expert_grads_ : norm_grads_)
          .push_back(model_.params().grad(specs[i]));
}

double GridNorms::grad_norm_squared() {
  TESSERA_PHASE("grad-norm");
  // With expert parallelism a rank holds its experts only: their part is also summed over the
  // EP group (the distributed optimizer's world sum covers every expert's blocks once already).
  build_grad_views();
  if (dist_) {
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

double GridNorms::params_norm() {
  std::vector<Tensor> ps;
  const std::vector<bool>& counted = counted_params();
  if (dist_) {  // the f32 master weights of this rank's blocks (the parameters themselves in f32)
    ps = dist_->param_blocks(counted);
    double local = be_.sum_squares_all(ps);
    ctx_.world->all_reduce_f64(&local, 1, ReduceOp::Sum);
    return std::sqrt(local);
  }
  std::vector<Tensor> experts;  // expert parallelism: summed over the EP group too
  const auto& specs = model_.params().specs();
  for (size_t i = 0; i < counted.size(); ++i)
    if (counted[i])
      (specs[i].expert && ctx_.ep_size > 1 ? experts : ps)
          .push_back(model_.params().param(specs[i]));
  double v[2] = {be_.sum_squares_all(ps), experts.empty() ? 0.0 : be_.sum_squares_all(experts)};
  ctx_.model_parallel->all_reduce_f64(v, 2, ReduceOp::Sum);
  if (ctx_.ep_size > 1) ctx_.ep->all_reduce_f64(&v[1], 1, ReduceOp::Sum);
  return std::sqrt(v[0] + v[1]);
}

double GridNorms::grad_zeros() {
  build_grad_views();        // the gradient this rank counts once
  double zeros[2] = {0, 0};  // the others, this rank's experts (expert parallelism)
  for (const Tensor& g : norm_grads_) zeros[0] += be_.count_zeros(g);
  for (const Tensor& g : norm_expert_grads_) zeros[1] += be_.count_zeros(g);
  (dist_ ? ctx_.world : ctx_.model_parallel)->all_reduce_f64(zeros, 2, ReduceOp::Sum);
  if (!dist_ && ctx_.ep_size > 1) ctx_.ep->all_reduce_f64(&zeros[1], 1, ReduceOp::Sum);
  return zeros[0] + zeros[1];
}

}  // namespace tessera
