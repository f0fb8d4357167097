// dist_optimizer.hpp: the distributed optimizer (Megatron's --use-distributed-optimizer, ZeRO
// stage 1). The flat buffers are cut into buckets, each padded to a multiple of the DP size
// (ParamStore::buckets); DP rank r owns block r of every bucket. After the backward the gradients
// are reduce-scattered (GradReducer), so each rank holds the summed gradient of its blocks; it
// keeps the Adam moments (and, in mixed precision, the f32 master weights) of its blocks only,
// updates them, and the updated weights are all-gathered back into every rank's compute copy:
// at once after the step, or bucket by bucket while the next forward runs
// (--overlap-param-gather). Per parameter a rank keeps 2 (bf16 weights) + 4 (gradient) +
// 12 / DP bytes in mixed precision (Megatron's 6 + 12/DP), 4 + 4 + 8 / DP in f32.
//
// The state is saved and loaded in the global tensor layout (checkpoint/), the same files as
// without it, so a checkpoint moves between layouts and optimizers freely.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/gpt.hpp"

namespace tessera {

class DistributedAdamW {
 public:
  // `model`'s ParamStore must be laid out for dp.size() blocks (FlatLayout::shards).
  // expert_dp (expert parallelism): the group that shares the routed experts' buckets
  // (FlatBucket::expert), whose blocks are cut over it instead of dp.
  // `skip` (per spec): parameters another optimizer updates (Muon's matrices, step/muon.hpp):
  // AdamW leaves them out of its blocks' segments.
  // HSDP (--num-distributed-optimizer-instances): `dp` and `expert_dp` are one instance's ranks
  // (the shard groups) and `replicas` / `expert_replicas` the same blocks' ranks in the other
  // instances, whose gradients reduce_replicas sums; null without. With the layout's
  // shard_split (--outer-dp-sharding-strategy optim) each block is cut again over the replicas.
  DistributedAdamW(GPTModel& model, Backend& backend, Communicator& dp, double beta1, double beta2,
                   double eps, Communicator* expert_dp = nullptr,
                   const std::vector<bool>* skip = nullptr, Communicator* replicas = nullptr,
                   Communicator* expert_replicas = nullptr);

  // This rank's block of one bucket: flat elements [flat_begin, flat_end), stored from
  // shard_begin in the optimizer's shard buffers (moments, master weights).
  struct Block {
    int bucket = 0;
    int64_t flat_begin = 0, flat_end = 0, shard_begin = 0;
    Communicator* comm = nullptr;  // the group the bucket is cut over
    // HSDP: the ranks of the other instances holding the same cut (null without). The cut,
    // flat [cut_begin, cut_begin + cut_numel), is what `comm` gives this rank and what FSDP's
    // gradient and compute shards hold (from cut_shard_begin); it is the block itself, or with
    // `split` (outer optimizer sharding) cut again over the replicas, the block being this
    // rank's part.
    Communicator* replicas = nullptr;
    bool split = false;
    int64_t cut_begin = 0, cut_numel = 0, cut_shard_begin = 0;
    int64_t numel() const { return flat_end - flat_begin; }
    // Whether this rank counts the block in the grid's norms (one replica of each does).
    bool counted() const { return split || !replicas || replicas->rank() == 0; }
  };
  const std::vector<Block>& blocks() const { return blocks_; }
  // The first moments of this rank's blocks (Muon keeps its momentum there), and a block's f32
  // weights (the master weights, or in f32 the parameters) and compute copy, as views.
  Tensor& first_moment() { return m_; }
  Tensor block_weights(const Block& k) const;
  Tensor block_compute(const Block& k) const;
  // The summed gradient of a block: in the flat gradient buffer, or (Megatron-FSDP's sharded
  // gradients, step/fsdp.hpp) in the gradient shard, which FSDP fills.
  Tensor block_grads(const Block& k) const;
  // FSDP: the block's cut in the gradient shard and in the compute copy's shard.
  Tensor cut_grads(const Block& k) const { return g_.view(k.cut_shard_begin, {k.cut_numel}); }
  Tensor cut_compute(const Block& k) const { return c_.view(k.cut_shard_begin, {k.cut_numel}); }
  Tensor& grad_shard() { return g_; }
  // Collective over the replicas (HSDP), once the step's gradients are reduced over the shard
  // groups: sums each block's gradient across the instances (an all-reduce; with `split` a
  // reduce-scatter that leaves each rank its part). Nothing without replicas.
  void reduce_replicas();
  int64_t shard_numel() const { return shard_numel_; }
  // Mixed precision: the f32 master weights live here (the ParamStore has none).
  bool owns_master() const { return master_.defined(); }

  // AdamW on this rank's blocks (the summed gradients the reduce-scatter left there, each
  // multiplied by grad_scale as it is read: the clip factor) with the step's learning rate and
  // weight decay, then the compute copy of the blocks is refreshed and the parameter gather
  // started (overlap) or done.
  void step(double lr, double weight_decay, bool overlap_gather, double grad_scale = 1.0);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }

  // All-gathers every bucket's updated weights into the compute copy (blocking), after the
  // master weights were set (initialization, checkpoint load).
  void publish();
  // Overlapped gather: waits for the buckets holding the piece's parameters; wait_all for all.
  void wait_params(int piece);
  void wait_all();

  // The gradient of this rank's blocks, as views, for the parameters `counted` keeps (the global
  // norm counts each parameter once across the grid).
  std::vector<Tensor> grad_blocks(const std::vector<bool>& counted) const;
  // The same blocks of the f32 weights (master weights in bf16/fp16 training).
  std::vector<Tensor> param_blocks(const std::vector<bool>& counted) const;
  // The gradient block this rank owns of `name`, a parameter in a bucket of its own (wte, and
  // lm_head beside a stage of multi-token prediction: summed across the stages holding copies
  // block by block); undefined when this rank has no such parameter.
  Tensor grad_block(const std::string& name) const;

  // State in the global layout. set_state copies the part of `values` (spec.local_shape, f32,
  // on the host) that falls in this rank's blocks into "master", "exp_avg" or "exp_avg_sq".
  void set_state(const char* which, const ParamSpec& spec, const float* values);
  void zero_moments();
  // Collective over DP (the routed experts' buckets over their expert-data-parallel group): the
  // full flat buffer of a state (as ParamStore offsets) on the host of the ranks with `want`;
  // empty elsewhere.
  std::vector<float> gather_state(const char* which, bool want);

 private:
  std::vector<Tensor> block_views(const std::vector<bool>& counted, bool params) const;
  Tensor& state(const char* which);
  void start_gather(int bucket);
  // split: each cut's compute copy gathered from the replicas' parts (after the update).
  void gather_replicas();

  GPTModel& model_;
  ParamStore& params_;
  Backend& be_;
  Communicator& dp_;
  AdamWHyper hyper_;
  std::vector<Block> blocks_;
  std::vector<std::vector<AdamWSegment>> segments_;  // per block, relative to its start
  std::vector<std::vector<bool>> decays_;  // per block and segment: takes the weight decay
  int64_t shard_numel_ = 0;
  Tensor m_, v_, master_;  // shard buffers
  // Megatron-FSDP: the gradient shard (sharded gradients) and the compute copy's shard (sharded
  // parameters; the master shard itself in f32), else undefined.
  Tensor g_, c_;
  bool c_is_master_ = false;  // f32 without split: the master shard is the compute shard
  std::vector<std::unique_ptr<PendingOp>> gathers_;  // per bucket, while overlapped
  std::vector<std::vector<int>> buckets_of_piece_;   // by piece_slot (model/params.hpp)
  int64_t step_ = 0;
};

}  // namespace tessera
