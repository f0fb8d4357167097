// layout.cpp: the model shard of a rank and the layout check (run/layout.hpp).
#include "run/layout.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "run/context_parallel.hpp"

namespace tessera {

ModelShard make_model_shard(const GPTConfig& cfg, const ParallelContext& ctx,
                            const TrainConfig& t) {
  ModelShard s = model_shard_for(cfg, ctx.tp_size, ctx.tp_rank, ctx.pp_size, ctx.pp_rank,
                                 t.virtual_pipeline_size, t.pipeline_split);
  s.sequence_parallel = t.sequence_parallel && ctx.tp_size > 1;
  s.ep_size = ctx.ep_size;
  s.ep_rank = ctx.ep_rank;
  s.cp_size = ctx.cp_size;
  s.cp_rank = ctx.cp_rank;
  return s;
}

std::string saved_pipeline_layout(const GPTConfig& cfg, const TrainConfig& t, int pp) {
  const PipelineSplitOptions& s = t.pipeline_split;
  if (!s.uneven()) return std::string();
  return layout_string(split_stages(s, cfg.num_layers, cfg.mtp() ? cfg.mtp_num_layers : 0, pp,
                                    s.layout.empty() ? t.virtual_pipeline_size : 0));
}

int standalone_mtp_rank(const GPTConfig& cfg, const TrainConfig& t, int pp) {
  if (!cfg.mtp() || t.pipeline_split.layout.empty()) return -1;
  return standalone_mtp_rank(
      split_stages(t.pipeline_split, cfg.num_layers, cfg.mtp_num_layers, pp, 0), pp);
}

void validate_layout(const GPTConfig& cfg, const TrainConfig& t, int tp, int pp, int dp, int cp) {
  using detail::concat;
  t.validate(dp);  // the batch's options at this DP (the global batch splits into micro-batches)
  validate_context_parallel(cfg, t, tp, cp);
  if (cfg.num_attention_heads % tp != 0)
    throw ConfigError(concat("--num-attention-heads=", cfg.num_attention_heads,
                             " is not divisible by --tensor-model-parallel-size=", tp,
                             " (allowed TP: a divisor of ", cfg.num_attention_heads, ")"));
  if (cfg.group_query_attention && cfg.num_query_groups % tp != 0)
    throw ConfigError(concat(
        "--num-query-groups=", cfg.num_query_groups,
        " is not divisible by --tensor-model-parallel-size=", tp,
        " (each tensor-parallel rank holds whole key/value groups; Tessera does not replicate "
        "them: use a TP that divides ",
        cfg.num_query_groups, ")"));
  if (cfg.ffn() % tp != 0)
    throw ConfigError(concat("--ffn-hidden-size=", cfg.ffn(),
                             " is not divisible by --tensor-model-parallel-size=", tp));
  if (t.zero_bubble && pp < 2)
    throw ConfigError(
        concat("--pipeline-schedule=zero-bubble needs --pipeline-model-parallel-size "
               "> 1 (got ",
               pp, "): one stage has no pipeline bubble to fill"));
  if (t.zero_bubble && t.fp8.enabled)
    throw ConfigError(
        "--pipeline-schedule=zero-bubble does not combine with FP8 (--fp8-format): an FP8 "
        "GEMM's weight gradient reads the quantized operands, which a W pass would have to hold; "
        "use --pipeline-schedule=1f1b with FP8");
  const int V = t.virtual_pipeline_size;
  const PipelineSplitOptions& split = t.pipeline_split;
  if (!split.uneven() && cfg.num_layers % pp != 0)
    throw ConfigError(concat(
        "--num-layers=", cfg.num_layers, " is not divisible by --pipeline-model-parallel-size=", pp,
        " (allowed PP: a divisor of ", cfg.num_layers,
        "; or uneven stages: --decoder-first-pipeline-num-layers, "
        "--decoder-last-pipeline-num-layers, --pipeline-model-parallel-layout)"));
  if (V > 1) {
    if (pp == 1)
      throw ConfigError(concat(t.virtual_option,
                               " needs --pipeline-model-parallel-size > 1 (the "
                               "interleaved schedule spreads model chunks over pipeline stages)"));
    if (!split.uneven() && cfg.num_layers % (pp * V) != 0)
      throw ConfigError(concat("--num-layers=", cfg.num_layers,
                               " is not divisible by --pipeline-model-parallel-size=", pp,
                               " x virtual stages ", V, " = ", pp * V, " (", t.virtual_option,
                               ")"));
    for (const int g : t.global_batches(dp)) {  // every size of a batch-size ramp
      const int micro = g / (t.micro_batch_size * dp);
      if (micro % pp != 0)
        throw ConfigError(concat("the interleaved schedule (", t.virtual_option,
                                 ") needs the number of micro-batches ", "per step, ", micro,
                                 " (global batch ", g, " / (micro-batch ", t.micro_batch_size,
                                 " x DP ", dp,
                                 ")), to be a multiple of "
                                 "--pipeline-model-parallel-size=",
                                 pp));
    }
  }
  // The widest model chunk (every chunk alike without uneven stages).
  const std::vector<StageSpan> spans = split_stages(
      split, cfg.num_layers, cfg.mtp() ? cfg.mtp_num_layers : 0, pp, split.layout.empty() ? V : 0);
  int widest = 0;
  for (const StageSpan& s : spans) widest = std::max(widest, s.layers());
  t.recompute.validate(widest, V > 1);
  if (t.sequence_parallel && tp == 1)
    throw ConfigError(
        "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the LayerNorm and "
        "dropout regions over the tensor-parallel group); drop it or raise TP");
  if (t.sequence_parallel && cp == 1 && cfg.seq_length % tp != 0)
    throw ConfigError(concat("--seq-length=", cfg.seq_length,
                             " is not divisible by --tensor-model-parallel-size=", tp,
                             " as --sequence-parallel needs (each rank holds 1/TP of every "
                             "micro-batch's tokens, seq-length / TP of a sample)"));
  if (cfg.padded_vocab_size(tp) % tp != 0)
    throw ConfigError(
        concat("padded vocabulary ", cfg.padded_vocab_size(tp), " is not divisible by TP ", tp));
}

FlatLayout training_flat_layout(const TrainConfig& cfg, const GPTConfig& model_cfg,
                                const ParallelContext& ctx) {
  const bool dist = cfg.use_distributed_optimizer;
  FlatLayout layout;
  layout.bucket_elems = cfg.ddp_bucket_size;
  // The optimizer shards over DP x CP, or over one instance of it (HSDP), whose blocks
  // --outer-dp-sharding-strategy optim cuts again over the instances.
  layout.shards = dist ? ctx.grad_group_size() / cfg.dist_opt_instances : 1;
  if (dist && cfg.outer_dp_shards_optim) layout.shard_split = cfg.dist_opt_instances;
  layout.embedding_alone = dist && model_cfg.embedding_on_last_stage();
  layout.head_alone =
      dist && !model_cfg.tied_head() && standalone_mtp_rank(model_cfg, cfg, ctx.pp_size) >= 0;
  layout.master = !(dist && cfg.compute_dtype != DType::F32);  // else the optimizer's blocks
  if (cfg.megatron_fsdp) {  // one bucket per FSDP unit (step/fsdp.hpp)
    layout.fsdp_units = true;
    layout.bucket_elems = 0;
    // (The tied embedding is a unit of its own, embedding_alone: both ends read it.)
    layout.units_only_grads = cfg.fsdp_shards_grads();
    layout.units_only_compute = cfg.fsdp_shards_params();
    if (layout.units_only_compute) layout.master = false;  // the optimizer's blocks, f32 too
  }
  // Expert parallelism: the routed experts' gradients reduce over the expert-data-parallel group.
  layout.experts_apart = ctx.ep_size > 1;
  return layout;
}

}  // namespace tessera
