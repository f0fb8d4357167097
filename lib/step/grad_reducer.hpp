// grad_reducer.hpp: data-parallel gradient reduction in buckets. The flat gradient buffer is cut
// into buckets of whole parameters (ParamStore::buckets, in the order the backward finishes
// them); with overlap, a bucket's reduction starts as soon as all of its parameters are final,
// overlapping the rest of the backward pass. The reduction is an all-reduce, or with the
// distributed optimizer a reduce-scatter that leaves each DP rank the sum of its block of each
// bucket. Gradients are summed, not averaged: every rank already scaled its loss by
// 1 / (loss tokens of the whole global batch).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.hpp"
#include "model/gpt.hpp"
#include "step/grad_reduction.hpp"

namespace tessera {

class GradReducer : public GradReduction {
 public:
  // reduce_scatter: the distributed optimizer's reduction. overlap: start buckets during the
  // backward (--overlap-grad-reduce); otherwise all start in finish().
  // expert_dp: the group the routed experts' buckets (FlatBucket::expert) reduce over (expert
  // parallelism); null: every bucket over dp.
  GradReducer(GPTModel& model, Communicator& dp, bool reduce_scatter = false, bool overlap = true,
              Communicator* expert_dp = nullptr);
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  bool every_micro_batch() const override { return false; }
  // Arms the reducer for the last micro-batch's backward of this step.
  void begin_step() override;
  // Marks the piece's parameters final (the last micro-batch's backward of the piece).
  void piece_ready(int piece) override;
  // Starts what has not started (nothing, if every piece reported) and waits for all buckets.
  void finish() override;
  Tensor reduced_grads() override { return model_.params().flat_grads(); }
  int64_t bytes_reduced_per_step() const { return 4 * total_elems_; }
  bool reduce_scatter() const { return reduce_scatter_; }

 private:
  struct Bucket {
    int64_t begin = 0, end = 0;  // flat element range
    int pending = 0, params = 0;
    Communicator* comm = nullptr;  // dp, or the expert-data-parallel group
    std::unique_ptr<PendingOp> op;
  };
  void start(Bucket& b);

  GPTModel& model_;
  Communicator& dp_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_param_;
  std::vector<int> sources_;    // backward pieces that write each parameter's gradient
  std::vector<int> remaining_;  // per parameter, this step
  std::vector<std::vector<int>> params_of_layer_;
  std::vector<int> head_params_, embed_params_;
  int64_t total_elems_ = 0;
  bool armed_ = false, reduce_scatter_ = false, overlap_ = true;
};

}  // namespace tessera
