// predict.hpp: the predicted time of one training step of a layout on a cluster (issue 57,
// docs/planning.md): per-op times from Tessera's achieved rates (plan/cluster.hpp's GpuRates),
// collectives from the cluster's fabrics, and the pipeline as a discrete-event timeline of each
// rank's steps in the order the training schedules issue them (run/pipeline.hpp's 1F1B and
// interleaved schedules), with sends and receives between the stages.
#pragma once

#include <string>
#include <vector>

#include "comm/grid_layout.hpp"
#include "model/gpt_config.hpp"
#include "plan/cluster.hpp"
#include "plan/collectives.hpp"
#include "run/train_config.hpp"

namespace tessera {

struct StepPrediction {
  double step = 0;  // seconds
  double tokens_per_s = 0, tflops_per_gpu = 0, mfu = 0;
  double bubble = 0, exposed_comm = 0;  // seconds of the step
  // Per pipeline stage, one rank's compute over the step's micro-batches (seconds).
  struct Stage {
    double forward = 0, backward = 0, recompute = 0, optimizer = 0;
    double weight = 0;  // of backward, the GEMMs' weight halves (zero-bubble's W passes)
  };
  std::vector<Stage> stages;
  int critical_stage = 0;  // the stage that finishes last
  // Exposed communication of the critical stage's rank, per kind (seconds of the step).
  double tp = 0, pp = 0, dp_grad = 0, dp_param = 0, cp = 0, ep = 0;
  double fsdp = 0;  // Megatron-FSDP's units' gathers and reduce-scatters, every micro-batch
  int micro_batches = 0;
  // The pipeline's schedule as the timeline ran it ("" at PP 1): "1F1B", "interleaved 1F1B, 2
  // model chunks per rank", "zero-bubble (ZB-H1), W operands held per stage: 0 1 2 3".
  std::string schedule;
};

// `t` resolved for `layout.dp`; `ep` the expert-parallel size. Each piece's calls come from a
// recording of the trainer's step (plan/collectives.hpp, PieceCalls), taken from `cache` when it
// holds one for this model (the planner's layouts share them) and made otherwise.
StepPrediction predict_step(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                            int ep, const ClusterSpec& cluster, const GpuRates& rates,
                            PieceCallsCache* cache = nullptr);

// The breakdown lines and, last, the one machine-readable line:
// "predicted: step S s | tokens/s T | TFLOP/s/GPU F | MFU M % | bubble B % | exposed comm C %".
std::string prediction_report(const StepPrediction& p, const ClusterSpec& cluster,
                              const GpuRates& rates);

// What decides pipeline stage s's cost and memory beyond its position: each model chunk's layers
// by kind (MoE or dense, FP8 or not), the embedding, the loss and multi-token prediction it
// holds. Stages of one shape cost the same (a deep pipeline has few shapes); of those, the
// earliest has the most micro-batches in flight.
std::string pipeline_stage_shape(const GPTConfig& cfg, const TrainConfig& t,
                                 const GridLayout& layout, int ep, int s);

}  // namespace tessera
