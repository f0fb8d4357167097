// grad_reduction.hpp: the step's data-parallel gradient reduction as OptimizerSet drives it, one
// of two strategies: the bucketed reducer (step/grad_reducer.hpp: an all-reduce, or the
// distributed optimizer's reduce-scatter, after the step's last backward) or Megatron-FSDP's
// units (step/fsdp.hpp: a reduce-scatter after every micro-batch's backward).
#pragma once

#include <functional>

#include "core/tensor.hpp"

namespace tessera {

class GradReduction {
 public:
  virtual ~GradReduction() = default;
  // Whether gradients reduce after every micro-batch's backward, not only after the step's last.
  virtual bool every_micro_batch() const = 0;
  // Before a step's first backward.
  virtual void begin_step() = 0;
  // Piece `piece` (model/params.hpp) has its gradients of the step (the last micro-batch's
  // backward), or of the micro-batch (every_micro_batch).
  virtual void piece_ready(int piece) = 0;
  // The step's last backward has run: starts what has not started, waits for every reduction.
  virtual void finish() = 0;
  // The reduced gradients the optimizer reads: the flat gradient buffer, or FSDP's shard.
  virtual Tensor reduced_grads() = 0;
  // Called with each bucket's (unit's) local gradients just before its reduction starts (result
  // validation's check); none when empty.
  std::function<void(const Tensor& local_grads)> before_reduce;
};

}  // namespace tessera
