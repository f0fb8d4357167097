// grid_norms.hpp: norms and counts over the whole process grid, each parameter counted once:
// TP-replicated parameters on TP rank 0 only, the tied embedding's copy on the last stage not at
// all (the first stage counts it), routed experts once per expert-parallel group; summed over the
// model-parallel group (or the world, with the distributed optimizer's blocks).
#pragma once

#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/gpt.hpp"
#include "step/dist_optimizer.hpp"

namespace tessera {

class GridNorms {
 public:
  // `dist`: the distributed optimizer whose blocks this rank counts (null: the whole gradient).
  GridNorms(GPTModel& model, Backend& be, const ParallelContext& ctx, DistributedAdamW* dist);

  // Collective: the squared L2 norm of the gradient, the same on every rank. After the DP
  // reduction every DP replica holds the same gradients.
  double grad_norm_squared();
  // Collective: the L2 norm of every parameter (the f32 master weights).
  double params_norm();
  // Collective: zeros in the gradient, each element counted once.
  double grad_zeros();

 private:
  // The parameters this rank counts once in grid-wide norms.
  const std::vector<bool>& counted_params();
  // The gradient views this rank counts (built once): norm_grads_, and with expert parallelism
  // this rank's experts' apart (summed over the EP group too).
  void build_grad_views();

  GPTModel& model_;
  Backend& be_;
  const ParallelContext& ctx_;
  DistributedAdamW* dist_;
  std::vector<bool> counted_;  // per parameter: counted once in grid-wide norms on this rank
  std::vector<Tensor> norm_grads_;
  std::vector<Tensor> norm_expert_grads_;  // expert parallelism: this rank's experts' gradients
};

}  // namespace tessera
