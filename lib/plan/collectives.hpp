// collectives.hpp: the collectives one rank issues in one training step, in the order it issues
// them (issue 57 and 69, docs/planning.md "The collective plan"), recorded from the trainer's own
// step: the rank's model built on the shape backend (backend/shape_backend.hpp: shapes, no
// arithmetic) and the step's components (step/training_step.hpp: the pipeline schedule, the
// parts' tensor-, sequence-, context- and expert-parallel calls, the stages' sends and receives,
// the gradient buckets, FSDP's units, Muon, the distributed optimizer's gathers, multi-token
// prediction) run once over recording communicators (comm/recording.hpp) of the rank's place in
// the grid. Nothing here lists a layer's calls: the plan is what the code issues.
// tests/plan/test_collective_sequence.sh checks it against the collectives a real MPI run records
// (TESSERA_TEST_COLLECTIVE_LOG), rank by rank; the step-time predictor (plan/predict.hpp) times
// each piece's calls, read from the same recording by the marks the model's pass observers set.
//
// Not in the plan: host reductions of a few doubles (the loss, the gradient norm, token counts,
// MoE's routing counts: microseconds of latency each, no bandwidth), and the start-up and
// checkpoint collectives outside the step. MoE's routing is balanced (each expert receives
// N K / E token copies); a real run's all-to-all sizes follow its routing.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/grid_layout.hpp"
#include "comm/recording.hpp"
#include "model/gpt_config.hpp"
#include "model/params.hpp"
#include "run/train_config.hpp"

namespace tessera {

using PlannedCall = CollectiveCall;
using CallList = std::vector<CollectiveCall>;

class CollectivePlan {
 public:
  // Records the step of `world_rank` of `layout` (expert-parallel size `ep`). `device`: NCCL's
  // communicators (gradients flow back on the pipeline gradient group, "pp_grad") and the CUDA
  // backend's choices; the MPI communicators carry both directions on "pp". `micro_batches` > 0
  // records a step of that many micro-batches instead of the run's (the predictor's pieces need
  // two: a backward that is not the step's last and one that is; the schedule's pipeline size
  // with virtual stages).
  // `layers` (a single-stage layout only): the stage holds these layers instead of all.
  CollectivePlan(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout, int ep,
                 int world_rank, bool device = false, int micro_batches = 0,
                 const LayerRange* layers = nullptr);

  const ModelShard& shard() const { return shard_; }
  // The whole step in issue order.
  const CallList& step() const { return calls_; }

  // One micro-batch's calls of each piece (model/params.hpp's pieces; multi-token prediction's
  // layers are the head's): the forward, and the backward with its recomputation; with
  // `last_micro` the step's last backward of the piece, whose once-a-step calls (the TP sums of
  // partial gradients, the buckets it completes) follow it.
  CallList piece_forward(int piece) const;
  CallList piece_backward(int piece, bool last_micro) const;
  CallList layer_forward(int layer) const { return piece_forward(layer); }
  CallList layer_backward(int layer, bool last_micro) const {
    return piece_backward(layer, last_micro);
  }
  CallList embed_forward() const { return piece_forward(kEmbedPiece); }
  CallList embed_backward() const { return piece_backward(kEmbedPiece, false); }
  CallList head_forward() const { return piece_forward(kHeadPiece); }
  CallList head_backward(bool last_micro) const { return piece_backward(kHeadPiece, last_micro); }

  // The fewest micro-batches a recording of pieces takes for this layout (see micro_batches).
  static int piece_micro_batches(const TrainConfig& t, const GridLayout& layout);

 private:
  ModelShard shard_;
  CallList calls_;
};

// Each piece's calls per micro-batch as the step-time predictor reads them (plan/predict.hpp):
// the calls of a rank at the first position of its tensor-, context- and expert-parallel groups,
// recorded once from the trainer's step on one stage holding the fewest consecutive layers that
// include one of each kind (model/layer_spec.hpp's specs), the embedding and the head, with the
// data-parallel size the expert-parallel one. A layer's calls depend on its kind and on TP,
// sequence parallelism, CP, EP, the micro-batch, the precision, recomputation and FSDP's
// every-micro-batch TP sums, never on its pipeline stage or the data-parallel layout: the
// planner's layouts share these recordings (PieceCallsCache). Full recomputation is recorded
// layer by layer (each layer's backward re-runs its own forward), as the predictor counts it.
class PieceCalls {
 public:
  PieceCalls(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout, int ep);
  // What the pieces' calls in the model's own groups (TP, CP, EP) depend on beyond the model:
  // equal keys, equal calls there. Their data-parallel calls are the recording's layout's (DP =
  // EP), not the run's: readers take the TP, CP and EP calls.
  static std::string key(const TrainConfig& t, const GridLayout& layout, int ep);

  CallList layer_forward(int layer) const { return plan_.layer_forward(of(layer)); }
  CallList layer_backward(int layer, bool last_micro) const {
    return plan_.layer_backward(of(layer), last_micro);
  }
  CallList embed_forward() const { return plan_.embed_forward(); }
  CallList embed_backward() const { return plan_.embed_backward(); }
  CallList head_forward() const { return plan_.head_forward(); }
  CallList head_backward(bool last_micro) const { return plan_.head_backward(last_micro); }

 private:
  int of(int layer) const;     // the recorded layer of `layer`'s kind (MTP's: its own index)
  std::vector<int> recorded_;  // per model layer
  LayerRange layers_;          // the recorded stage's
  CollectivePlan plan_;
};

// The predictor's recordings by PieceCalls::key, for one model (the planner's enumeration).
class PieceCallsCache {
 public:
  const PieceCalls& get(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                        int ep);
  size_t size() const { return calls_.size(); }

 private:
  std::map<std::string, std::unique_ptr<PieceCalls>> calls_;
};

}  // namespace tessera
