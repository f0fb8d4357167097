// memory_estimate.hpp: what one rank of a pipeline stage holds in memory (parameters, gradients,
// optimizer state, activations): the figures --dry-run prints, the memory report compares with
// and the GPU benchmark checks its measured peak against. Parameter and activation footprints
// come from model/ (params.hpp, gpt.hpp); the optimizer state and the pipeline's in-flight
// micro-batches are the training side's, added here.
#pragma once

#include <cstdint>
#include <string>

#include "model/gpt_config.hpp"
#include "model/params.hpp"
#include "run/train_config.hpp"

namespace tessera {

struct GridLayout;

// What one rank of pipeline stage `stage` holds.
struct MemoryEstimate {
  int64_t parameters = 0;         // on this rank
  int64_t expert_parameters = 0;  // of them, routed experts' (MoE; E/EP experts per MoE layer)
  double dispatch_bytes = 0;      // MoE: one layer's token-dispatch buffers (in activation_bytes)
  double expert_bytes = 0;        // MoE: the routed experts' weights, gradients and optimizer state
  int slots = 1;  // micro-batches whose activations are alive at once (summed over model chunks)
  double param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  int stage_layers = 0;
  double activation_layer_bytes = 0;   // kept per layer per micro-batch (mean over the stage)
  double activation_shared_bytes = 0;  // scratch and recompute working set, counted once
  // The LayerNorm/dropout/residual regions' share of activation_layer_bytes, and what it would be
  // without sequence parallelism (TP times as much); both 0 at TP 1.
  double sp_region_layer_bytes = 0, sp_region_layer_bytes_without = 0;
  // FP8 (model/fp8.hpp): the scaling state of the stage's layers (amax, scale, format maximum and
  // H rows of history per tensor, 12 tensors per layer).
  double fp8_state_bytes = 0;
  // Megatron-FSDP's sharded gradients / parameters (step/fsdp.hpp): this rank's elements of the
  // flat buffers (its blocks, bucket padding included), and the pool of gathered weights and
  // unreduced gradients the stage's schedule holds at most (in total_bytes; param_bytes and
  // grad_bytes count the shards).
  int64_t fsdp_shard_elements = 0;
  double fsdp_pool_bytes = 0;
  // Zero-bubble (run/pipeline.hpp): the B passes whose W operands the stage holds at most at
  // once (h_s, the recording one's included; 0: whole backwards) and the bytes of one (the GEMM
  // operands a B pass copies for its W, its largest model chunk's); their product is in
  // activation_bytes.
  int zb_held_passes = 0;
  double zb_pass_bytes = 0;
  double total_bytes() const {
    return param_bytes + grad_bytes + optimizer_bytes + activation_bytes + fp8_state_bytes +
           fsdp_pool_bytes;
  }
};

// Zero-bubble: the B passes whose W operands pipeline rank `stage` of `pp` holds at most at once
// (run/pipeline.hpp's zero_bubble_held, from the shard's activation slot and W pass sizes at
// `micro` micro-batches of T tokens per rank) and the bytes of one (its largest model chunk's).
struct ZeroBubbleHold {
  int passes = 0;
  double pass_bytes = 0;
  double mean_pass_bytes = 0;  // over the rank's model chunks (what a B pass copies on average)
};
ZeroBubbleHold zero_bubble_hold(const GPTConfig& cfg, const ModelShard& shard, const TrainConfig& t,
                                int pp, int stage, int micro, int T);

// `ep`: the expert-parallel size (MoE), carved out of layout.dp.
MemoryEstimate estimate_rank_memory(const GPTConfig& cfg, const TrainConfig& t,
                                    const GridLayout& layout, int stage, int ep = 1);

// "" when one rank of pipeline stage `stage` fits in `capacity_bytes` by the estimate `e`; else
// the line that refuses the run (what it needs, what the rank has, what to change). With
// `sharing_ranks` > 1 the capacity is shared (the host's memory on the CPU): `shared_need_bytes`,
// the estimates of those ranks together, must fit instead.
std::string memory_fit_problem(const MemoryEstimate& e, int stage, double capacity_bytes,
                               const std::string& capacity_what, int sharing_ranks = 1,
                               double shared_need_bytes = 0);

}  // namespace tessera
