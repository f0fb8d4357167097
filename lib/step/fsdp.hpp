// fsdp.hpp: Megatron-FSDP's gradient and parameter sharding (--use-megatron-fsdp with
// --data-parallel-sharding-strategy optim_grads or optim_grads_params), on the distributed
// optimizer's blocks.
//
// The flat buffers are laid out one bucket per FSDP unit (a transformer layer, the embedding, the
// head; the tied embedding and, with expert parallelism, a layer's routed experts units of their
// own), each bucket cut into one block per data-parallel rank as the distributed optimizer cuts
// them (step/dist_optimizer.hpp). What a strategy shards has no flat buffer: each unit's
// gradients (optim_grads) or also its compute weights (optim_grads_params) are an unbound tensor
// (ParamStore::bucket_grads, bucket_compute) that FSDP binds to a buffer of its pool while a pass
// needs them:
//
//   - compute weights (optim_grads_params): before a piece's forward each of its units is
//     all-gathered from the ranks' blocks of the compute copy (the distributed optimizer keeps
//     them, updated with the master weights), and released after it; gathered again before the
//     piece's backward (ahead of its recomputation) and released after it. A piece's gather is
//     started as the piece before it in the pass starts (the next layer's forward, the previous
//     layer's backward; the communicator's stream on the GPU) and waited for, by the compute
//     stream only, when its piece begins: it runs behind the previous piece's compute.
//   - gradients (optim_grads and up): bound and zeroed before the first backward piece that
//     writes them in a micro-batch; once every piece that writes a unit has run, the unit is
//     reduce-scattered (every micro-batch, not only the last: the full gradient never outlives
//     its micro-batch) and this rank's block added into the gradient shard the optimizer reads.
//     At most kInFlight reductions are in flight behind the backward; the oldest completes (its
//     block added, its buffer returned) when another starts, or when its unit is needed again.
//
// The pool keeps every buffer it hands out for reuse, by size and type, so after the first step
// nothing is allocated; FsdpLedger is that bookkeeping without tensors, and the memory estimate
// runs it over a stage's schedule (fsdp_pool_bytes) to count the same bytes.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "model/gpt.hpp"
#include "run/fsdp_ledger.hpp"
#include "step/dist_optimizer.hpp"
#include "step/grad_reduction.hpp"

namespace tessera {

// Observes the model's passes and moves the tensors the ledger says.
class FsdpUnits : public GradReduction, private PassObserver, private FsdpLedger::Actions {
 public:
  FsdpUnits(GPTModel& model, Backend& be, DistributedAdamW& opt);
  ~FsdpUnits() override;
  FsdpUnits(const FsdpUnits&) = delete;
  FsdpUnits& operator=(const FsdpUnits&) = delete;

  bool shards_grads() const { return ledger_.shards_grads(); }
  bool every_micro_batch() const override { return ledger_.shards_grads(); }
  // The step's start: zeroes the gradient shard.
  void begin_step() override;
  // Every micro-batch, after piece `piece`'s backward (and its TP sums).
  void piece_ready(int piece) override { ledger_.grads_ready(piece); }
  // The step's last backward has run: completes every reduction.
  void finish() override { ledger_.finish(); }
  Tensor reduced_grads() override { return opt_.grad_shard(); }
  int64_t pool_bytes() const { return ledger_.pool_bytes(); }

 private:
  // The passes: the compute weights' gathers and releases (optim_grads_params), the gradients'
  // binding before a backward piece.
  void before_forward(int piece) override;
  void after_forward(int piece) override;
  void before_backward(int piece) override { ledger_.before_backward(piece); }
  void after_backward(int piece) override;
  void gather(int unit, const Tensor& mem) override;
  void wait_gather(int unit) override;
  void release_params(int unit) override;
  void bind_grads(int unit, const Tensor& mem) override;
  void start_reduce(int unit) override;
  void finish_reduce(int unit) override;

  GPTModel& model_;
  Backend& be_;
  DistributedAdamW& opt_;
  FsdpLedger ledger_;
  std::vector<std::unique_ptr<PendingOp>> ops_;      // per unit, while its reduction is in flight
  std::vector<std::unique_ptr<PendingOp>> gathers_;  // per unit, while its gather is in flight
};

}  // namespace tessera
