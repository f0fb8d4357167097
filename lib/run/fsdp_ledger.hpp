// fsdp_ledger.hpp: Megatron-FSDP's buffer bookkeeping without tensors' contents (step/fsdp.hpp
// says what the units are): which units a pass holds gathered or unreduced, the pool's bytes, and
// the same count for the memory estimate over a stage's schedule.
#pragma once

#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "core/tensor.hpp"
#include "model/params.hpp"
#include "model/recompute.hpp"
#include "run/pipeline.hpp"

namespace tessera {

// Which buffers FSDP's units hold through the model's hooks, and the pool's bytes. With an
// Actions object the tensors follow (FsdpUnits); without, it only counts (the memory estimate).
class FsdpLedger {
 public:
  // Reductions of units' gradients in flight behind the backward.
  static constexpr int kInFlight = 1;

  struct Actions {
    virtual ~Actions() = default;
    // Bind the unit's weights to `mem` and start gathering them (the device does not wait yet);
    // wait_gather orders what follows after that gather.
    virtual void gather(int unit, const Tensor& mem) = 0;
    virtual void wait_gather(int unit) = 0;
    virtual void release_params(int unit) = 0;                 // unbind its weights
    virtual void bind_grads(int unit, const Tensor& mem) = 0;  // bind and zero its gradients
    virtual void start_reduce(int unit) = 0;                   // its reduce-scatter
    virtual void finish_reduce(int unit) = 0;                  // wait, add the block, unbind
  };
  struct Unit {
    int64_t numel = 0;        // the bucket's elements, padding included
    std::vector<int> pieces;  // the backward pieces that write its gradients
  };
  // units: per bucket. `shard` maps pieces to their units; grads / params: what is sharded;
  // compute: the weights' dtype; alloc null: count only.
  FsdpLedger(std::vector<Unit> units, const ModelShard& shard, bool grads, bool params,
             DType compute, Allocator* alloc);

  bool shards_grads() const { return grads_; }
  bool shards_params() const { return params_; }
  void set_actions(Actions* a) { actions_ = a; }

  // The model's hooks (GPTModel::before_forward and friends), and the step's end. Acquiring a
  // piece's weights also starts gathering the next piece's of the same pass (the next layer
  // forward, the previous one backward; not inside a backward's recomputation), so that gather
  // runs behind this piece's compute.
  void before_forward(int piece);
  void after_forward(int piece) { release_params(piece); }
  void before_backward(int piece);
  void grads_ready(int piece);  // after a piece's backward (every micro-batch)
  void after_backward(int piece);
  void finish();  // completes every reduction; drops a prefetch left over
  bool idle() const { return in_flight_.empty(); }

  // Bytes the pool holds (it never frees them).
  int64_t pool_bytes() const { return pool_bytes_; }

 private:
  struct State {
    int pending = 0;          // pieces still to write its gradients this micro-batch
    int param_users = 0;      // passes holding its gathered weights
    bool prefetched = false;  // its gather started ahead of the piece that needs it
    bool grads_bound = false, reducing = false;
    Tensor grad_mem, param_mem;
  };
  const std::vector<int>& units_of(int piece) const;
  // The piece the same pass runs after `piece` on this shard (forward: the next layer of its
  // chunk, then the head; backward: the previous layer, then the embedding), or kNone.
  int next_piece(int piece, bool forward) const;
  void prefetch(int piece);
  void acquire_params(int piece);
  void release_params(int piece);
  void complete_oldest();
  Tensor take(int64_t numel, DType dtype);
  void give(Tensor& mem, int64_t numel, DType dtype);

  std::vector<Unit> units_;
  std::vector<State> state_;
  const ModelShard shard_;
  bool grads_ = false, params_ = false;
  DType compute_ = DType::F32;
  Allocator* alloc_ = nullptr;
  Actions* actions_ = nullptr;
  std::vector<std::vector<int>> of_piece_;  // units per piece (embed, head, then local layers)
  std::deque<int> in_flight_;
  bool in_backward_ = false;  // between a piece's before_backward and after_backward
  std::map<std::pair<int64_t, int>, std::vector<Tensor>> free_;  // by (elements, dtype)
  std::map<std::pair<int64_t, int>, int> free_count_;            // the same, counting only
  int64_t pool_bytes_ = 0;
};

// The ledger's units for flat-laid `specs` (their buckets `buckets`) on `shard`.
std::vector<FsdpLedger::Unit> fsdp_units(const std::vector<ParamSpec>& specs,
                                         const std::vector<FlatBucket>& buckets,
                                         const ModelShard& shard);

// The bytes FSDP's pool holds on a rank of `shard` after a step of `steps` (the stage's pipeline
// schedule), with the recomputation `plan` (plan_recompute): the gathered weights and unreduced
// gradients the hooks of that step hold at most at once.
int64_t fsdp_pool_bytes(const std::vector<ParamSpec>& specs, const std::vector<FlatBucket>& buckets,
                        const ModelShard& shard, bool grads, bool params, DType compute,
                        const std::vector<PipeStep>& steps,
                        const std::vector<LayerRecompute>& plan);

}  // namespace tessera
