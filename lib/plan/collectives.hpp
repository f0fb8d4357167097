// collectives.hpp: the collectives one rank issues in one training step, in the order it issues
// them (issue 57, docs/planning.md "The collective plan"): each micro-batch's forward and backward
// walked in the pipeline schedule's order (run/pipeline.hpp), the layers' tensor-, sequence- and
// context-parallel collectives as the model's parts issue them, the pipeline's sends and receives
// with their peers, the data-parallel buckets where the last micro-batch's backward completes
// them (train/grad_reducer.hpp, from the same flat-buffer layout and the same parameter pieces),
// the embedding group's sum, Muon's (--optimizer muon) and the distributed optimizer's gathers. The
// step-time predictor (plan/predict.hpp) times these calls; tests/plan/test_collective_sequence.sh
// checks the plan against the collectives a real MPI run records (TESSERA_TEST_COLLECTIVE_LOG),
// rank by rank.
//
// Not in the plan: host reductions of a few doubles (the loss, the gradient norm, token counts,
// MoE's routing counts: microseconds of latency each, no bandwidth), and the start-up and
// checkpoint collectives outside the step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/grid_layout.hpp"
#include "model/gpt_config.hpp"
#include "model/layer_spec.hpp"
#include "model/params.hpp"
#include "model/recompute.hpp"
#include "run/fsdp_ledger.hpp"
#include "run/train_config.hpp"

namespace tessera {

struct PlannedCall {
  std::string group;     // the communicator: "tp", "cp", "pp", ... (trace_group_key's names)
  std::string op;        // "all_reduce", "send", ... (trace_op_name's names)
  int64_t elements = 0;  // the whole buffer (an all-gather's output, a reduce-scatter's input)
  int bytes = 4;         // per element
  int peer = -1;         // point-to-point: the partner's world rank
  // The collective log's line: "<group> <op> <elements> <bytes>[ <peer>]".
  std::string line() const;
};
using CallList = std::vector<PlannedCall>;

class CollectivePlan {
 public:
  // The plan of `world_rank` of `layout` (expert-parallel size `ep`). `device`: NCCL's
  // communicators (gradients flow back on the pipeline gradient group, "pp_grad"); the MPI
  // communicators carry both directions on "pp".
  CollectivePlan(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout, int ep,
                 int world_rank, bool device = false);

  const ModelShard& shard() const { return shard_; }
  // The group's size for a group key of this plan ("tp" -> TP, "dp" -> DP x CP, ...).
  int group_size(const std::string& group) const;
  // The group the distributed optimizer cuts a bucket over: "dp" ("edp" for the routed experts'
  // with EP), or with HSDP's instances one instance of it ("dp_shard", "edp_shard").
  std::string shard_group(bool expert) const;
  // This rank's place in that group.
  int shard_rank(bool expert) const;

  // One micro-batch's calls of each piece.
  CallList embed_forward() const;
  CallList embed_backward() const;
  CallList layer_forward(int layer) const;
  // The layer's recomputation (full or selective) first; with `last_micro` the once-a-step sums
  // of its TP-partial gradients after it.
  CallList layer_backward(int layer, bool last_micro) const;
  CallList head_forward() const;
  CallList head_backward(bool last_micro) const;
  // The stage's input received / output sent for model chunk `chunk`, forward and backward.
  CallList receive_forward(int chunk) const;
  CallList send_forward(int chunk) const;
  CallList receive_backward(int chunk) const;
  CallList send_backward(int chunk) const;

  // The whole step in issue order (ConfigError with multi-token prediction: its head's calls are
  // not listed).
  CallList step() const;

 private:
  struct Bucket {
    int64_t elements = 0;
    bool expert = false;
    int pending = 0;  // parameters not final yet (during step())
    bool started = false;
  };
  void hidden_reduce(CallList& out) const;  // a row-parallel output: all-reduce or reduce-scatter
  void hidden_gather(CallList& out) const;  // sequence parallelism's gather
  PlannedCall ring_step() const;
  void ring_forward(CallList& out) const;
  void ring_backward(CallList& out) const;
  void moe_forward(CallList& out) const;
  void moe_backward(CallList& out) const;
  void tp_grad_sums(int layer, CallList& out) const;
  void muon_calls(const std::vector<ParamSpec>& specs, const std::vector<FlatBucket>& buckets,
                  CallList& out) const;
  PlannedCall call(const std::string& group, const char* op, int64_t elements, int bytes,
                   int peer = -1) const;
  // Megatron-FSDP's sharded units (run/fsdp_ledger.hpp): during step(), the ledger that issues
  // the units' gathers and reduce-scatters at the model's hooks; fsdp_hook runs one hook, its
  // calls appended to `out` (nothing without FSDP's sharded units).
  struct FsdpRecorder;
  void fsdp_hook(void (FsdpLedger::*hook)(int), int piece, CallList& out) const;
  mutable FsdpRecorder* fsdp_ = nullptr;
  int world_of_stage(int pp_rank) const;

  const GPTConfig& cfg_;
  const TrainConfig& t_;
  GridLayout layout_;
  int ep_ = 1;
  GridCoords me_;
  bool device_ = false;
  ModelShard shard_;
  std::vector<LayerSpec> specs_;
  std::vector<LayerRecompute> recompute_;
  int64_t rows_ = 0;  // tokens of a micro-batch on this rank (CP: its chunks)
  int wb_ = 4;        // bytes of an activation element
  bool sp_ = false;
};

}  // namespace tessera
