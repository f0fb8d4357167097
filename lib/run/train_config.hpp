// train_config.hpp: optimizer, schedule, batch and logging settings of a training run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.hpp"
#include "model/fp8_config.hpp"
#include "model/pipeline_split.hpp"
#include "model/recompute.hpp"
#include "run/sample_layout.hpp"

namespace tessera {

struct TrainConfig {
  int micro_batch_size = 1;
  int global_batch_size = 0;  // 0: micro-batch size * data-parallel size (no accumulation)
  int64_t train_iters = 0;
  double lr = 1e-4;
  double min_lr = 0.0;
  // constant | linear | cosine | inverse-square-root | WSD (step/lr_schedule.hpp)
  std::string lr_decay_style = "linear";
  int64_t lr_warmup_iters = 0;
  int64_t lr_decay_iters = 0;  // 0: train_iters
  double lr_warmup_init = 0;   // the warm-up starts at this learning rate
  // WSD: the final decay's length (0: not given) and style (empty: not given, exponential).
  int64_t lr_wsd_decay_iters = 0, lr_wsd_decay_samples = 0;
  std::string lr_wsd_decay_style;
  // Megatron's sample-based schedule and warm-up fraction; resolved() turns them into the
  // iteration counts above at the (constant) global batch (samples / global batch, rounded down,
  // as Megatron does for --train-samples). 0: not given.
  int64_t train_samples = 0, lr_decay_samples = 0, lr_warmup_samples = 0;
  double lr_warmup_fraction = 0;  // warm-up iterations = fraction x decay iterations
  // Megatron's --rampup-batch-size START INCR SAMPLES: the global batch starts at START and grows
  // by INCR in equal intervals of the first SAMPLES samples, up to the global batch size, then
  // stays there. Needs --train-samples. Empty: a constant global batch.
  std::vector<int64_t> rampup_batch_size;
  // Set by resolved() under a ramp (Megatron's sample-based scheduler): the learning-rate
  // schedule advances by the samples of each update, and lr_warmup_iters / lr_decay_iters count
  // samples.
  bool lr_schedule_in_samples = false;
  // Checkpoints without the optimizer state (--no-save-optim); a load that leaves it out
  // (--no-load-optim: the optimizer and its step count start fresh).
  bool no_save_optim = false;
  double weight_decay = 0.01;
  // Megatron's weight-decay increment over the run: constant (--weight-decay), or linear | cosine
  // from start_weight_decay to end_weight_decay (both required then, and only then).
  std::optional<double> start_weight_decay, end_weight_decay;
  std::string weight_decay_incr_style = "constant";
  // Set by resolved(): the steps over which the weight decay changes, the run's length in the
  // schedule's unit (iterations; samples under a ramp).
  int64_t weight_decay_incr_iters = 0;
  // Documents inside a sample: Megatron's --reset-position-ids, --reset-attention-mask,
  // --eod-mask-loss (run/sample_layout.hpp); eod set when the data opens.
  LtorOptions documents;
  // --calculate-per-token-loss: the objective is the global batch's summed token losses over its
  // loss tokens; without it Megatron's mean per micro-batch, averaged over the micro-batches (the
  // same when every token counts; step/step_executor.hpp, micro_grad_scale).
  bool per_token_loss = false;
  double clip_grad = 1.0;  // 0: no clipping
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  // --optimizer: "adam" (AdamW for every parameter) or "muon" (Muon for the hidden layers'
  // matrices, AdamW for the embeddings, the output layer, norms and biases; step/muon.hpp).
  std::string optimizer = "adam";
  // Muon's options, Megatron-Core's names and argparse defaults (Megatron-LM d98e8a6,
  // megatron/training/arguments.py; the math of Emerging-Optimizers v0.3.0).
  struct Muon {
    double momentum = 0.9;                 // --muon-momentum
    bool nesterov = false;                 // --muon-nesterov
    bool split_qkv = true;                 // --muon-no-split-qkv clears it
    std::string scale_mode = "spectral";   // spectral | unit_rms_norm | shape_scaling
    std::string matmul_prec = "medium";    // --muon-fp32-matmul-prec: low | medium | high
    std::string coefficients = "quintic";  // --muon-coefficient-type: quintic | simple
    int ns_steps = 5;                      // --muon-num-ns-steps
    std::string tp_mode = "duplicated";    // blockwise | duplicated | distributed
    double extra_scale = 1.0;              // --muon-extra-scale-factor
  } muon;
  uint64_t seed = 1234;
  int log_interval = 10;
  std::string metrics_file;           // JSONL, one line per logged iteration; empty: none
  int64_t ddp_bucket_size = 4 << 20;  // elements per data-parallel all-reduce bucket
  // The distributed optimizer (ZeRO-1, step/dist_optimizer.hpp) and what overlaps the backward
  // and the next forward. Gradient reduction overlaps the backward by default.
  bool use_distributed_optimizer = false;
  bool overlap_grad_reduce = true;
  bool overlap_param_gather = false;  // needs the distributed optimizer
  // Megatron-FSDP (--use-megatron-fsdp, step/fsdp.hpp): one bucket per FSDP unit (a layer, the
  // embedding, the head) and what --data-parallel-sharding-strategy shards over the DP ranks:
  // nothing (no_shard: DDP), the optimizer state (optim: the distributed optimizer), also the
  // gradients (optim_grads), also the parameters (optim_grads_params).
  enum class DpSharding { NoShard, Optim, OptimGrads, OptimGradsParams };
  bool megatron_fsdp = false;
  DpSharding dp_sharding = DpSharding::NoShard;
  bool fsdp_shards_grads() const {
    return megatron_fsdp &&
           (dp_sharding == DpSharding::OptimGrads || dp_sharding == DpSharding::OptimGradsParams);
  }
  bool fsdp_shards_params() const {
    return megatron_fsdp && dp_sharding == DpSharding::OptimGradsParams;
  }
  // HSDP / the partial distributed optimizer (--num-distributed-optimizer-instances N > 1): the
  // gradient group (DP x CP) is split into N instances of consecutive ranks; what is sharded is
  // cut over an instance's ranks and replicated across the instances, whose gradients are summed
  // once per step. With --outer-dp-sharding-strategy optim (Megatron-FSDP optim_grads_params
  // only) the optimizer state is cut again over the instances.
  int dist_opt_instances = 1;
  bool outer_dp_shards_optim = false;
  // Megatron's sequence parallelism (needs TP > 1): LayerNorm, dropout and residual regions split
  // over the TP group along the tokens; all-gather / reduce-scatter instead of all-reduce.
  bool sequence_parallel = false;
  // The interleaved 1F1B schedule: model chunks (virtual pipeline stages) per pipeline rank, from
  // --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage (named in
  // errors by virtual_option). 1: plain 1F1B.
  int virtual_pipeline_size = 1;
  const char* virtual_option = "--virtual-pipeline-model-parallel-size";
  // Which layers each stage holds (model/pipeline_split.hpp): uneven first/last stages, the
  // embedding and loss counted as layers, or Megatron's layout string; default an even split.
  PipelineSplitOptions pipeline_split;
  // --pipeline-schedule zero-bubble (alias --enable-zero-bubble): ZB-H1, each backward split
  // into its B and W passes (run/pipeline.hpp, model/weight_grads.hpp); false: 1F1B.
  bool zero_bubble = false;
  // Activation recomputation (--recompute-granularity/-method/-num-layers, model/recompute.hpp).
  RecomputeConfig recompute;
  // FP8 GEMMs in the transformer layers (--fp8-format and friends, model/fp8_config.hpp).
  Fp8Config fp8;
  double peak_tflops = 0;  // per rank, for MFU in the log; 0: MFU not printed
  // Megatron's timers (step/timers.hpp): level 0 (save-checkpoint only), 1, 2; minmax|max|all.
  int timing_log_level = 0;
  std::string timing_log_option = "minmax";
  // More figures in the iteration line: the parameters' L2 norm, zeros in the gradient.
  bool log_params_norm = false;
  bool log_num_zeros_in_grad = false;
  // --moe-per-layer-logging: each MoE layer's tokens per expert over the log interval (min, max,
  // coefficient of variation, experts without tokens) and its expert bias's range
  // (train/metrics/moe_layers.cpp).
  bool moe_per_layer_logging = false;
  // Per-rank memory (allocated, max allocated, reserved) against the --dry-run estimate: after the
  // first iteration, and every memory_report_interval iterations (0: only then).
  int64_t memory_report_interval = 0;
  // TensorBoard event files (core/tensorboard.hpp), written by the last rank as Megatron's are:
  // scalars every tensorboard_log_interval iterations, the timers and the validation perplexity on
  // request; flushed at every --log-interval and at the end.
  std::string tensorboard_dir;
  int64_t tensorboard_log_interval = 1;
  bool log_timers_to_tensorboard = false;
  bool log_validation_ppl_to_tensorboard = false;
  bool dry_run = false;
  // Evaluation: every eval_interval iterations (0: never), eval_iters global batches of the
  // validation data, the same samples each time.
  int64_t eval_interval = 0;
  int64_t eval_iters = 10;
  // Each evaluation continues through the validation split where the previous one stopped (the
  // k-th starts at sample (k-1) x eval_iters x global batch, so a resume continues the same way);
  // full_validation evaluates every whole global batch of the split each time instead.
  bool full_validation = false;
  // Checkpoints.
  std::string save;           // directory; empty: no checkpoints
  int64_t save_interval = 0;  // 0: only at the end of training
  int keep_checkpoints = 0;   // keep the newest N (0: all)
  // Megatron's --async-save: the loop blocks only while the state is staged in host memory; the
  // write, its verification and the commit complete in the background.
  bool async_save = false;
  std::string config_text;     // the run's options (INI), stored in every checkpoint
  std::string data_tokenizer;  // the training shards' tokenizer name, stored too ("": mock data)
  // Stopping early (Megatron's): after an iteration divisible by exit_interval, or once
  // exit_duration_mins have passed; both save a checkpoint first when --save is set.
  int64_t exit_interval = 0;
  double exit_duration_mins = 0;
  // A collective waiting longer than this ends the job (train/watchdog.hpp); 0: wait forever.
  double distributed_timeout_minutes = 10;
  // Profiling (docs/profiling.md): with profile, cudaProfilerStart before iteration
  // profile_step_start + 1 and cudaProfilerStop after iteration profile_step_end, on the ranks in
  // profile_ranks (empty: every rank).
  bool profile = false;
  // Precision (--bf16 / --fp16): the dtype of activations and compute weights; master weights,
  // gradients and Adam moments stay f32. fp16 scales the loss: loss_scale > 0 is a constant scale,
  // 0 is dynamic scaling from initial_loss_scale (Megatron's defaults).
  DType compute_dtype = DType::F32;
  double loss_scale = 0;
  double initial_loss_scale = 4294967296.0;  // 2^32
  double min_loss_scale = 1.0;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  int64_t profile_step_start = 10, profile_step_end = 12;
  std::vector<int> profile_ranks{0};
  // Result validation and reruns (train/result_validator.hpp; Megatron's rerun state machine):
  // disabled | validate_results | report_stats.
  std::string rerun_mode = "validate_results";
  bool check_nan = true;  // the loss and each gradient bucket, locally, before their reductions
  bool check_spiky_loss = false, check_large_grads = false;  // 10x the largest recent value
  // Empty: none (the default, <save>/result_rejected_tracker.txt with --save, is set by the
  // option group).
  std::string rejected_tracker_file;
  std::vector<int64_t> iterations_to_skip;  // 1-indexed: their samples consumed, no update
  // Error injection (drills and tests): one rejected result in error_injection_rate validations
  // (random, from --seed), and/or at (iteration, rank) pairs; of error_injection_type.
  int64_t error_injection_rate = 0;
  std::string error_injection_type = "transient_error";
  std::vector<std::pair<int64_t, int>> error_injection_at;
  // --log-straggler: each rank's compute and waiting per iteration, the slowest and fastest
  // straggler_minmax_count ranks named every log interval (train/metrics/straggler.cpp);
  // straggler_injection (RANK, SECONDS): that rank sleeps that long every iteration (tests).
  bool log_straggler = false;
  int straggler_minmax_count = 1;
  // --disable-straggler-on-startup; --straggler-ctrlr-port: a connection there toggles the report
  // (world rank 0 listens; 0: no listener).
  bool straggler_off_at_start = false;
  int straggler_ctrlr_port = 65535;
  std::pair<int, double> straggler_injection{-1, 0.0};

  // A copy with the sample-based options and the warm-up fraction turned into iterations (under
  // a ramp: train_iters counted as Megatron does, the schedule kept in samples).
  TrainConfig resolved(int dp_size) const;
  int global_batch(int dp_size) const {
    return global_batch_size > 0 ? global_batch_size : micro_batch_size * dp_size;
  }
  int num_micro_batches(int dp_size) const {
    return global_batch(dp_size) / (micro_batch_size * dp_size);
  }
  // The global batch of the step that starts after `consumed` samples (Megatron's ramp: START +
  // INCR x floor(consumed / (SAMPLES / increments)) while consumed <= SAMPLES).
  int global_batch_at(int dp_size, int64_t consumed) const;
  // Samples consumed before iteration `iteration` (1-based) starts: iteration - 1 global batches,
  // of the ramp's sizes while it lasts.
  int64_t samples_before_iteration(int dp_size, int64_t iteration) const;
  // Every global batch size the run takes, smallest first (one without a ramp).
  std::vector<int> global_batches(int dp_size) const;
  // Throws ConfigError naming the option and the allowed values.
  void validate(int dp_size) const;
  // The learning-rate schedule's lengths cleared (warm-up, decay, WSD decay), for tools that read
  // a run's data order only (tessera-inspect): their checks do not apply there.
  void drop_lr_schedule() {
    lr_warmup_iters = lr_decay_iters = lr_wsd_decay_iters = 0;
    lr_warmup_samples = lr_decay_samples = lr_wsd_decay_samples = 0;
    lr_warmup_fraction = 0;
  }
};

// What the data-parallel ranks shard, for the start-up and --dry-run lines: "replicated",
// "distributed over DP 4", or Megatron-FSDP's strategy and what it shards (with HSDP's
// instances over the DP x CP ranks).
std::string describe_dp_sharding(const TrainConfig& t, int dp, int cp = 1);

// For a resolved config: the warning line when the warm-up lasts the whole run (the learning
// rate never reaches --lr), else "". A warm-up not shorter than an explicit decay is refused by
// validate(), as Megatron asserts.
std::string warmup_past_the_run(const TrainConfig& resolved);

}  // namespace tessera
