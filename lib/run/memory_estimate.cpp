// memory_estimate.cpp: one rank's memory per pipeline stage (run/memory_estimate.hpp).
#include "run/memory_estimate.hpp"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "comm/grid_layout.hpp"
#include "model/gpt.hpp"
#include "model/params.hpp"
#include "run/fsdp_ledger.hpp"
#include "run/layout.hpp"
#include "run/muon_plan.hpp"
#include "run/pipeline.hpp"

namespace tessera {

namespace {
// Megatron-FSDP (step/fsdp.hpp), every strategy: the buffers from the FSDP unit layout of every
// parameter (each expert's too, the padding included), the pool from the ledger run over the
// stage's schedule: the same bookkeeping the run does. `adam_bytes`: the moments counted so far.
void fsdp_memory(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                 const ParallelContext& ctx, const ModelShard& shard,
                 const std::vector<PipeStep>& steps, double adam_bytes, MemoryEstimate& e) {
  ParallelContext grid = ctx;
  grid.dp_size = layout.dp;
  std::vector<ParamSpec> specs = build_param_specs(cfg, shard);
  const std::vector<FlatBucket> buckets =
      layout_flat_buffer(specs, training_flat_layout(t, cfg, grid));
  // no_shard keeps whole buffers (one block per bucket); the others cut each bucket over DP x CP,
  // or over one HSDP instance of it (and the optimizer's part again over the instances).
  const int N = t.dist_opt_instances;
  const int64_t group = t.use_distributed_optimizer ? grid.grad_group_size() / N : 1;
  const int64_t split = t.outer_dp_shards_optim ? N : 1;
  int64_t total = 0, optimizer = 0;
  e.fsdp_shard_elements = 0;
  for (const FlatBucket& b : buckets) {  // routed experts' buckets over expert data parallelism
    const int64_t blocks = b.expert && ctx.ep_size > 1 && group > 1 ? group / ctx.ep_size : group;
    e.fsdp_shard_elements += b.numel() / blocks;
    optimizer += b.numel() / blocks / split;
    total = std::max(total, b.end);
  }
  const double mine = static_cast<double>(e.fsdp_shard_elements);  // gradient / compute shards
  const double part = static_cast<double>(optimizer);              // master and moments
  const double width = dtype_size(t.compute_dtype);
  const bool mixed = t.compute_dtype != DType::F32;
  e.grad_bytes = 4.0 * (t.fsdp_shards_grads() ? mine : static_cast<double>(total));
  e.optimizer_bytes += 8.0 * part - adam_bytes;  // Muon's scratch stays
  if (t.fsdp_shards_params())  // the master part and the compute shard (f32: the master's own)
    e.param_bytes = 4.0 * part + (mixed || split > 1 ? width * mine : 0.0);
  else  // the whole compute copy (the f32 parameters in f32) and the master shard (or all)
    e.param_bytes =
        mixed ? width * static_cast<double>(total) + 4.0 * part : 4.0 * static_cast<double>(total);
  if (!t.fsdp_shards_grads()) return;  // no pool: the flat buffers are whole
  e.fsdp_pool_bytes = static_cast<double>(
      fsdp_pool_bytes(specs, buckets, shard, t.fsdp_shards_grads(), t.fsdp_shards_params(),
                      t.compute_dtype, steps, plan_recompute(t.recompute, shard)));
}
}  // namespace

ZeroBubbleHold zero_bubble_hold(const GPTConfig& cfg, const ModelShard& shard, const TrainConfig& t,
                                int pp, int stage, int micro, int T) {
  ZeroBubbleHold h;
  const int V = shard.num_chunks();
  const int B = t.micro_batch_size;
  const double slot =
      activation_footprint(cfg, shard, t.recompute, B, T, t.compute_dtype).per_micro_batch / V;
  for (int c = 0; c < V; ++c) {  // the largest chunk's (the last holds the output layer's)
    const double b = weight_pass_bytes(cfg, shard, B, T, t.compute_dtype, c);
    h.pass_bytes = std::max(h.pass_bytes, b);
    h.mean_pass_bytes += b / V;
  }
  h.passes = zero_bubble_held(pp, stage, micro, V, slot, h.pass_bytes);
  return h;
}

MemoryEstimate estimate_rank_memory(const GPTConfig& cfg, const TrainConfig& t,
                                    const GridLayout& layout, int stage, int ep) {
  ParallelContext ctx;
  ctx.tp_size = layout.tp;
  ctx.pp_size = layout.pp;
  ctx.pp_rank = stage;
  ctx.ep_size = ep;
  ctx.cp_size = layout.cp;
  // Context parallelism: each rank's activations hold S / CP tokens of a sample.
  const int T = cfg.seq_length / layout.cp;
  const ModelShard shard = make_model_shard(cfg, ctx, t);
  MemoryEstimate e;
  const ParamCount count = count_param_specs(cfg, shard);
  e.parameters = count.parameters;
  e.expert_parameters = count.expert_parameters;
  const int V = t.virtual_pipeline_size;
  const int micro = t.num_micro_batches(layout.dp);
  const std::vector<PipeStep> steps = V > 1 ? schedule_interleaved(layout.pp, stage, micro, V)
                                            : schedule_1f1b(layout.pp, stage, micro);
  std::vector<int> chunk_slots{pipeline_slots(layout.pp, stage, micro)};
  if (V > 1) chunk_slots = pipeline_chunk_slots(steps, V);
  e.slots = 0;
  for (int n : chunk_slots) e.slots += n;
  // f32 master weights, plus their bf16/f16 copy in mixed precision; with the distributed
  // optimizer the master weights (mixed precision) and the Adam moments of 1/DP of them.
  const bool mixed = t.compute_dtype != DType::F32;
  // Routed experts' blocks are cut over the expert-data-parallel group (DP / EP).
  // HSDP's instances each hold the whole state, unless the outer strategy cuts it again.
  const double instances = t.outer_dp_shards_optim ? 1.0 : double(t.dist_opt_instances);
  const double dp = t.use_distributed_optimizer ? double(layout.dp) * layout.cp / instances : 1.0;
  const double edp =
      t.use_distributed_optimizer ? double(layout.dp) / ep * layout.cp / instances : 1.0;
  const double dense = static_cast<double>(e.parameters - e.expert_parameters);
  const double experts = static_cast<double>(e.expert_parameters);
  e.param_bytes =
      mixed ? 2.0 * e.parameters + 4.0 * (dense / dp + experts / edp) : 4.0 * e.parameters;
  e.grad_bytes = 4.0 * e.parameters;
  e.optimizer_bytes = 8.0 * (dense / dp + experts / edp);
  // Muon: its momentum is Adam's first moment (counted above); its Newton-Schulz scratch for the
  // largest matrix during the step (with the bf16 copies CUDA makes: a few MiB over on the CPU).
  // Muon batches a MoE layer's local experts together: their specs one per expert, as the model
  // holds them (the counted specs hold one per layer).
  const std::vector<ParamSpec> muon_specs =
      t.optimizer == "muon" ? build_param_specs(cfg, shard) : std::vector<ParamSpec>{};
  if (t.optimizer == "muon")
    e.optimizer_bytes +=
        muon_scratch_bytes(plan_muon_matrices(muon_specs, layout.tp, t.muon.split_qkv), layout.tp,
                           t.muon, /*device=*/true);
  if (t.optimizer == "muon" && t.use_distributed_optimizer) {  // layer-wise: u and the update
    ParallelContext grid = ctx;  // of the largest bucket, f32 (step/muon.hpp)
    grid.dp_size = layout.dp;
    std::vector<ParamSpec> specs = muon_specs;
    int64_t largest = 0;
    for (const FlatBucket& b : layout_flat_buffer(specs, training_flat_layout(t, cfg, grid)))
      largest = std::max(largest, b.numel());
    e.optimizer_bytes += 8.0 * double(largest);
  }
  if (t.megatron_fsdp)  // every strategy from its unit layout, padding included
    fsdp_memory(cfg, t, layout, ctx, shard, steps, 8.0 * (dense / dp + experts / edp), e);
  e.expert_bytes = experts * ((mixed ? 2.0 + 4.0 / edp : 4.0) + 4.0 + 8.0 / edp);
  if (cfg.moe()) {  // one MoE layer's token copies for one micro-batch (in activation_bytes)
    const double N = double(t.micro_batch_size) * T, K = cfg.moe_router_topk;
    const double R = double(cfg.moe_received_rows(int64_t(t.micro_batch_size) * T, ep));
    const double width = dtype_size(t.compute_dtype);
    // sent and returned copies (N*K rows each), and with EP the rows received (R)
    e.dispatch_bytes = width * cfg.hidden_size * (2 * N * K + (ep > 1 ? R : 0));
  }
  const ActivationFootprint fp =
      activation_footprint(cfg, shard, t.recompute, t.micro_batch_size, T, t.compute_dtype);
  e.activation_bytes = activation_bytes(cfg, shard, t.recompute, t.micro_batch_size, T,
                                        t.compute_dtype, chunk_slots);
  e.activation_shared_bytes = fp.shared;
  if (t.zero_bubble && layout.pp > 1) {
    const ZeroBubbleHold h = zero_bubble_hold(cfg, shard, t, layout.pp, stage, micro, T);
    e.zb_held_passes = h.passes;
    e.zb_pass_bytes = h.pass_bytes;
    e.activation_bytes += h.passes * h.pass_bytes;
  }
  e.stage_layers = shard.num_layers();
  if (t.fp8.enabled) {
    const double H = t.fp8.recipe == Fp8Recipe::Delayed ? t.fp8.amax_history_len : 1;
    e.fp8_state_bytes = 4.0 * double(fp8_state_columns(cfg.num_experts)) * e.stage_layers * (H + 3);
  }
  if (e.stage_layers > 0) {  // what the layers add to a micro-batch, over the stage's layers
    ModelShard none = shard;
    for (LayerRange& c : none.chunks) c.end = c.begin;
    const ActivationFootprint base =
        activation_footprint(cfg, none, RecomputeConfig{}, t.micro_batch_size, T, t.compute_dtype);
    e.activation_layer_bytes = (fp.per_micro_batch - base.per_micro_batch) / e.stage_layers;
    if (layout.tp > 1) {
      // The regions sequence parallelism splits: what a layer keeps with it off minus with it on
      // is (1 - 1/TP) of them.
      auto layer_bytes = [&](bool sp) {
        ModelShard s = shard, n = none;
        s.sequence_parallel = n.sequence_parallel = sp;
        return (activation_footprint(cfg, s, t.recompute, t.micro_batch_size, T, t.compute_dtype)
                    .per_micro_batch -
                activation_footprint(cfg, n, t.recompute, t.micro_batch_size, T, t.compute_dtype)
                    .per_micro_batch) /
               e.stage_layers;
      };
      const double off = layer_bytes(false), on = layer_bytes(true);
      e.sp_region_layer_bytes_without = (off - on) * layout.tp / (layout.tp - 1);
      e.sp_region_layer_bytes = t.sequence_parallel ? e.sp_region_layer_bytes_without / layout.tp
                                                    : e.sp_region_layer_bytes_without;
    }
  }
  return e;
}

std::string memory_fit_problem(const MemoryEstimate& e, int stage, double capacity_bytes,
                               const std::string& capacity_what, int sharing_ranks,
                               double shared_need_bytes) {
  const double need = e.total_bytes();
  const double total = sharing_ranks > 1 ? shared_need_bytes : need;
  if (!(total > capacity_bytes) || capacity_bytes <= 0) return std::string();
  auto size = [](double b) {
    char buf[48];
    const double gib = b / 1073741824.0;
    if (gib >= 1024.0 * 1024.0)
      std::snprintf(buf, sizeof buf, "%.3g PiB", gib / (1024.0 * 1024.0));
    else if (gib >= 1024.0)
      std::snprintf(buf, sizeof buf, "%.1f TiB", gib / 1024.0);
    else
      std::snprintf(buf, sizeof buf, "%.1f GiB", gib);
    return std::string(buf);
  };
  return "the run does not fit: one rank of pipeline stage " + std::to_string(stage) +
         " needs about " + size(need) + " by the estimate (" + std::to_string(e.parameters) +
         " parameters: weights " + size(e.param_bytes) + ", gradients " + size(e.grad_bytes) +
         ", optimizer " + size(e.optimizer_bytes) + "; activations " + size(e.activation_bytes) +
         ")" +
         (sharing_ranks > 1 ? ", the " + std::to_string(sharing_ranks) + " ranks of this node " +
                                  size(total) + " together, and they share "
                            : std::string(" and has ")) +
         capacity_what +
         "; lower the model (--num-experts, --hidden-size, --num-layers) or --micro-batch-size, "
         "or spread it (--tensor-model-parallel-size, --pipeline-model-parallel-size, "
         "--expert-model-parallel-size, --use-distributed-optimizer); --dry-run prints the "
         "estimate per rank";
}

}  // namespace tessera
