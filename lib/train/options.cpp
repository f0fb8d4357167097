// options.cpp: option definitions for tessera-train, the thread set-up and the --dry-run report.
#include "train/options.hpp"

#include <cblas.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <vector>

#include "backend/select.hpp"
#include "checkpoint/checkpoint.hpp"
#include "comm/mpi_check.hpp"
#include "comm/process_grid.hpp"
#include "core/config.hpp"
#include "data/blended_dataset.hpp"
#include "data/gpt_dataset.hpp"
#include "model/gpt.hpp"
#include "model/params.hpp"
#include "train/pipeline.hpp"
#include "train/layout.hpp"

namespace tessera {

std::vector<int> parse_rank_list(const std::string& text, const std::string& option) {
  std::vector<int> ranks;
  if (text == "all") return ranks;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int r = -1;
    try {
      r = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || r < 0)
      throw ConfigError(option + "=" + text +
                        " is not a list of ranks (allowed: 'all' or e.g. 0,8,16)");
    ranks.push_back(r);
  }
  if (ranks.empty()) throw ConfigError(option + " is empty (allowed: 'all' or e.g. 0,8,16)");
  return ranks;
}

// --rampup-batch-size START INCR SAMPLES: three integers, on the command line or as one INI value.
std::vector<int64_t> parse_rampup(const std::vector<std::string>& tokens) {
  std::string text;
  for (const std::string& t : tokens) text += (text.empty() ? "" : " ") + t;
  std::vector<int64_t> values;
  std::istringstream in(text);
  std::string item;
  while (in >> item) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size())
      throw ConfigError("--rampup-batch-size " + text + ": '" + item +
                        "' is not an integer (give START INCR SAMPLES, e.g. 16 16 "
                        "500000)");
    values.push_back(v);
  }
  if (!tokens.empty() && values.size() != 3)
    throw ConfigError("--rampup-batch-size " + text +
                      ": give three numbers, START INCR SAMPLES (e.g. --rampup-batch-size 16 16 "
                      "500000)");
  return values;
}

RecomputeConfig recompute_options(const std::string& granularity, const std::string& method,
                                  int num_layers, bool checkpoint_activations,
                                  int checkpoint_num_layers) {
  using detail::concat;
  RecomputeConfig rc;
  if (checkpoint_activations) {  // Megatron's older spelling of full + uniform
    if (!granularity.empty() && granularity != "full")
      throw ConfigError(
          "--checkpoint-activations means --recompute-granularity full; it was "
          "given with --recompute-granularity " +
          granularity + " (give one of them)");
    if (!method.empty() && method != "uniform")
      throw ConfigError(
          "--checkpoint-activations means --recompute-method uniform; it was given "
          "with --recompute-method " +
          method + " (use --recompute-granularity full for block)");
    rc.granularity = RecomputeGranularity::Full;
  } else if (checkpoint_num_layers > 0) {
    throw ConfigError(concat("--checkpoint-num-layers=", checkpoint_num_layers,
                             " needs --checkpoint-activations"));
  }
  if (!granularity.empty()) rc.granularity = parse_recompute_granularity(granularity);
  if (!method.empty()) {
    if (!rc.full())
      throw ConfigError("--recompute-method=" + method +
                        " needs --recompute-granularity full (selective recomputes every layer)");
    rc.method = parse_recompute_method(method);
  }
  if (checkpoint_num_layers > 0 && num_layers > 0 && checkpoint_num_layers != num_layers)
    throw ConfigError(concat("--checkpoint-num-layers=", checkpoint_num_layers,
                             " and --recompute-num-layers=", num_layers, " disagree; give one"));
  if (num_layers < 0)
    throw ConfigError(
        concat("--recompute-num-layers=", num_layers, " is out of range (allowed: >= 1)"));
  if (checkpoint_num_layers < 0)
    throw ConfigError(concat("--checkpoint-num-layers=", checkpoint_num_layers,
                             " is out of range (allowed: >= 1)"));
  const int n = num_layers > 0 ? num_layers : checkpoint_num_layers;
  const char* name = num_layers > 0 ? "--recompute-num-layers" : "--checkpoint-num-layers";
  if (n > 0 && !rc.full())
    throw ConfigError(concat(name, "=", n, " needs --recompute-granularity full"));
  if (n > 0 && num_layers <= 0) rc.num_layers_option = name;
  if (n > 0) rc.num_layers = n;
  return rc;
}

std::string no_checkpoint_in(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return "it does not exist yet";
  if (!fs::is_directory(dir, ec)) return "";  // resolve_checkpoint_dir says what is wrong
  int others = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    long long it = 0;
    char tail = 0;
    const bool iteration_dir = std::sscanf(name.c_str(), "iter_%lld%c", &it, &tail) == 1;
    if (name == "latest_checkpointed_iteration.txt" || iteration_dir ||
        name.rfind("mp_rank_", 0) == 0)
      return "";
    ++others;
  }
  if (ec) return "";  // unreadable: loading reports it
  return others == 0 ? "it is empty" : "it holds no latest_checkpointed_iteration.txt or iter_N";
}

namespace {

// Megatron-LM options that mean nothing in Tessera: accepted so that a launch script runs
// unchanged, each with one line at start-up saying why it has no effect.
struct AcceptedOption {
  const char* name;
  const char* values;  // nullptr: a switch; "": any integer; else the allowed words, '|'-separated
  const char* why;
};
constexpr AcceptedOption kAccepted[] = {
    {"use-flash-attn", nullptr,
     "attention is always fused (flash attention kernels on the GPU, blocked on the CPU)"},
    {"no-async-tensor-model-parallel-allreduce", nullptr,
     "tensor-parallel communication has one implementation"},
    {"exit-signal-handler", nullptr, "SIGTERM and SIGUSR1 always save a checkpoint and exit"},
    {"DDP-impl", "local|torch",
     "one data-parallel implementation (bucketed gradient all-reduce overlapped with the "
     "backward)"},
    {"distributed-backend", "nccl|gloo", "NCCL between GPUs and MPI for host tensors, always"},
    {"use-mcore-models", nullptr, "one model implementation"},
    {"use-legacy-models", nullptr, "one model implementation"},
    {"transformer-impl", "local|transformer_engine", "one transformer implementation"},
    {"no-masked-softmax-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"no-bias-gelu-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"no-bias-dropout-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"no-gradient-accumulation-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"attention-softmax-in-fp32", nullptr, "the attention softmax is always computed in fp32"},
    {"accumulate-allreduce-grads-in-fp32", nullptr,
     "gradients are always accumulated and reduced in fp32"},
    {"use-cpu-initialization", nullptr,
     "each rank draws its own slice of the initialization from a counter-based RNG"},
    {"log-throughput", nullptr, "the iteration line always carries tokens/s and TFLOP/s"},
    {"num-workers", "", "the loader reads ahead on one prefetch thread per rank"},
    {"override-opt_param-scheduler", nullptr,
     "a resumed run always takes this run's learning-rate and weight-decay schedule (a change "
     "from the checkpoint's is one warning line)"},
    {"override-opt-param-scheduler", nullptr,
     "a resumed run always takes this run's learning-rate and weight-decay schedule (a change "
     "from the checkpoint's is one warning line)"},
};

}  // namespace

bool parse_run_options(int argc, const char* const* argv, RunOptions& o,
                       const RunOptionsProgram& program) {
  auto parser = std::make_shared<OptionParser>(program.name, program.usage);
  OptionParser& p = *parser;
  o.with_origins = [parser](const std::string& message) { return parser->with_origins(message); };
  std::vector<std::string> data_path_words, train_path_words, valid_path_words, test_path_words;
  GPTConfig& m = o.model;
  TrainConfig& t = o.train;
  std::string log_level = "info";
  std::string profile_ranks;
  std::vector<std::string> rampup;
  bool bf16 = false, fp16 = false;
  double start_weight_decay = 0, end_weight_decay = 0;
  std::string recompute_granularity, recompute_method;
  int recompute_num_layers = 0, checkpoint_num_layers = 0;
  int virtual_size = 0, layers_per_virtual_stage = 0;
  std::string cp_comm_type;
  bool checkpoint_activations = false;
  bool disable_bias_linear = false;
  bool recompute_activations = false;
  std::string capacity_factor, drop_policy;  // MoE: "" when not given
  bool pad_to_capacity = false;
  double norm_epsilon = 0;
  p.group("Model").add_options()(
      "num-layers", po::value(&m.num_layers)->default_value(m.num_layers), "transformer layers")(
      "hidden-size", po::value(&m.hidden_size)->default_value(m.hidden_size), "hidden width")(
      "num-attention-heads",
      po::value(&m.num_attention_heads)->default_value(m.num_attention_heads),
      "attention heads (must divide hidden-size, unless --kv-channels is given)")(
      "ffn-hidden-size", po::value(&m.ffn_hidden_size)->default_value(0),
      "MLP width (0: 4 * hidden-size)")(
      "seq-length", po::value(&m.seq_length)->default_value(m.seq_length), "tokens per sample")(
      "max-position-embeddings", po::value(&m.max_position_embeddings)->default_value(0),
      "positions of the model (0: seq-length)")(
      "vocab-size", po::value(&m.vocab_size)->default_value(0),
      "vocabulary size (0: from the data's shards; 512 for mock data)")(
      "make-vocab-size-divisible-by",
      po::value(&m.make_vocab_size_divisible_by)->default_value(128),
      "pad the vocabulary to a multiple of this times TP (padding is masked out of the loss)")(
      "init-method-std", po::value(&m.init_method_std)->default_value(0.02),
      "std of the normal init (residual projections use std/sqrt(2*layers))")(
      "layernorm-epsilon", po::value(&m.layernorm_epsilon)->default_value(1e-5),
      "LayerNorm epsilon")("attention-dropout", po::value(&m.attention_dropout)->default_value(0),
                           "dropout on the attention probabilities in training (GPT-2: 0.1)")(
      "hidden-dropout", po::value(&m.hidden_dropout)->default_value(0),
      "dropout on the embedding output and on each attention and MLP output before the residual "
      "add, in training (GPT-2: 0.1)")(
      "position-embedding-type",
      po::value(&m.position_embedding_type)->default_value(m.position_embedding_type),
      "learned_absolute (GPT-2) | rope (rotary, Llama) | alibi (linear distance penalty per head) "
      "| none (causal attention alone)")("rotary-base",
                                         po::value(&m.rotary_base)->default_value(m.rotary_base),
                                         "RoPE base (theta; Llama 3: 500000)")(
      "rotary-percent", po::value(&m.rotary_percent)->default_value(m.rotary_percent),
      "share of each head's features that RoPE rotates, 0 < p <= 1")(
      "use-rope-scaling", po::bool_switch(&m.use_rope_scaling),
      "Llama 3.1's RoPE frequency scaling (low/high frequency factors 1/4, original context 8192)")(
      "rope-scaling-factor",
      po::value(&m.rope_scaling_factor)->default_value(m.rope_scaling_factor),
      "with --use-rope-scaling: how much the long wavelengths are slowed (Llama 3.1: 8, 3.2: 32)")(
      "rope-scaling-low-freq-factor",
      po::value(&m.rope_scaling_low_freq_factor)->default_value(m.rope_scaling_low_freq_factor),
      "with --use-rope-scaling: wavelengths above original / this are slowed (Llama 3: 1)")(
      "rope-scaling-high-freq-factor",
      po::value(&m.rope_scaling_high_freq_factor)->default_value(m.rope_scaling_high_freq_factor),
      "with --use-rope-scaling: wavelengths below original / this are kept (Llama 3: 4)")(
      "rope-scaling-original-max-position-embeddings",
      po::value(&m.rope_scaling_original_max_positions)
          ->default_value(m.rope_scaling_original_max_positions),
      "with --use-rope-scaling: the context the frequencies were trained for (Llama 3: 8192)")(
      "normalization", po::value(&m.normalization)->default_value(m.normalization),
      "LayerNorm (GPT-2) | RMSNorm (Llama)")(
      "norm-epsilon", po::value(&norm_epsilon),
      "epsilon of the norms (Megatron's name for --layernorm-epsilon)")(
      "swiglu", po::bool_switch(&m.swiglu),
      "SwiGLU MLP (gate and up projections, silu(gate) * up) instead of GELU; Llama uses "
      "--ffn-hidden-size 8/3 h rounded")(
      "group-query-attention", po::bool_switch(&m.group_query_attention),
      "grouped-query attention: --num-query-groups key/value heads shared by the query heads")(
      "num-query-groups", po::value(&m.num_query_groups)->default_value(m.num_query_groups),
      "key/value heads with --group-query-attention (1: multi-query attention); must divide "
      "the heads and be divisible by TP")(
      "untie-embeddings-and-output-weights",
      po::bool_switch(&m.untie_embeddings_and_output_weights),
      "an output layer (lm_head) of its own instead of the word embedding's transpose")(
      "disable-bias-linear", po::bool_switch(&disable_bias_linear),
      "no biases in the QKV, projection and MLP layers (Llama)")(
      "add-qkv-bias", po::bool_switch(&m.add_qkv_bias),
      "biases on the QKV projection even with --disable-bias-linear (Qwen2)")(
      "kv-channels", po::value(&m.kv_channels)->default_value(0),
      "features per attention head (0: hidden-size / num-attention-heads)")(
      "apply-layernorm-1p", po::bool_switch(&m.apply_layernorm_1p),
      "norm weights stored as w and applied as (1 + w), initialized to 0")(
      "rotary-interleaved", po::bool_switch(&m.rotary_interleaved),
      "RoPE rotates adjacent feature pairs (2i, 2i+1) instead of the two halves")(
      "squared-relu", po::bool_switch(&m.squared_relu), "MLP activation relu(x)^2 instead of GELU");
  p.group("Mixture of Experts")
      .add_options()("num-experts", po::value(&m.num_experts)->default_value(0),
                     "experts per MoE layer (0: a dense model)")(
          "moe-router-topk", po::value(&m.moe_router_topk)->default_value(m.moe_router_topk),
          "experts each token goes to")("moe-ffn-hidden-size",
                                        po::value(&m.moe_ffn_hidden_size)->default_value(0),
                                        "each expert's MLP width (0: --ffn-hidden-size)")(
          "moe-layer-freq", po::value(&m.moe_layer_freq)->default_value(m.moe_layer_freq),
          "which layers are MoE: N (every N-th layer from layer 0) or a 0/1 list per layer "
          "such as [1,0,1,0] or ([1]*3+[0])*2")(
          "moe-router-load-balancing-type",
          po::value(&m.moe_router_load_balancing_type)
              ->default_value(m.moe_router_load_balancing_type),
          "aux_loss (per micro-batch) | seq_aux_loss (per sequence) | none")(
          "moe-aux-loss-coeff", po::value(&m.moe_aux_loss_coeff)->default_value(0),
          "the load-balancing loss's weight in the objective")(
          "moe-z-loss-coeff", po::value(&m.moe_z_loss_coeff)->default_value(0),
          "the router z-loss's weight (mean logsumexp(logits)^2)")(
          "moe-router-score-function",
          po::value(&m.moe_router_score_function)->default_value(m.moe_router_score_function),
          "softmax | sigmoid (normalized over the top k)")(
          "moe-router-pre-softmax", po::bool_switch(&m.moe_router_pre_softmax),
          "routing weights from the softmax over all experts (not renormalized over the top k)")(
          "moe-router-topk-scaling-factor",
          po::value(&m.moe_router_topk_scaling_factor)->default_value(0),
          "routing weights times this (0: unscaled)")(
          "moe-shared-expert-intermediate-size",
          po::value(&m.moe_shared_expert_intermediate_size)->default_value(0),
          "width of a shared expert every token goes through beside its routed ones (0: none)")(
          "moe-expert-capacity-factor", po::value(&capacity_factor),
          "drop token copies beyond ceil(tokens * topk / experts * factor) per expert and "
          "micro-batch (default: dropless)")(
          "moe-token-drop-policy", po::value(&drop_policy),
          "with a capacity factor: keep the highest routing weights (probs, default) or the "
          "earliest tokens (position)")(
          "moe-pad-expert-input-to-capacity", po::bool_switch(&pad_to_capacity),
          "with a capacity factor: accepted (Tessera computes the kept rows only; results are "
          "the same)")(
          "expert-model-parallel-size", po::value(&o.ep)->default_value(1),
          "ranks the experts are split over, carved out of the data-parallel ranks (must "
          "divide DP and --num-experts)")(
          "moe-token-dispatcher-type",
          po::value(&m.moe_token_dispatcher_type)->default_value(m.moe_token_dispatcher_type),
          "alltoall | allgather: how tokens reach their experts' ranks (same results)")(
          "moe-grouped-gemm", po::bool_switch(&m.moe_grouped_gemm),
          "the experts' GEMMs as one grouped GEMM per projection (same results; needs "
          "--disable-bias-linear)");
  p.group("Parallelism")
      .add_options()("tensor-model-parallel-size", po::value(&o.tp)->default_value(1),
                     "tensor-parallel ranks (consecutive ranks; keep them in one node)")(
          "pipeline-model-parallel-size", po::value(&o.pp)->default_value(1),
          "pipeline stages (layers split evenly); DP = world / (TP * CP * PP)")(
          "cp-comm-type", po::value(&cp_comm_type)->default_value("p2p"),
          "context parallelism's communication: p2p (the K/V ring; the only one Tessera has)")(
          "context-parallel-size", po::value(&o.cp)->default_value(1),
          "context parallelism: each sequence split over CP ranks (two of its 2 x CP chunks "
          "each), attention around their ring; same losses (needs --seq-length a multiple of "
          "2 x CP)")(
          "num-layers-per-virtual-pipeline-stage",
          po::value(&layers_per_virtual_stage)->default_value(0),
          "the interleaved 1F1B schedule: model chunks of N layers, each pipeline rank holding "
          "every PP-th chunk (needs PP > 1 and micro-batches per step a multiple of PP)")(
          "virtual-pipeline-model-parallel-size", po::value(&virtual_size)->default_value(0),
          "the interleaved 1F1B schedule given as the number of model chunks per pipeline rank")(
          "sequence-parallel", po::bool_switch(&t.sequence_parallel),
          "with TP > 1: split the LayerNorm, dropout and residual regions along the tokens "
          "(each rank 1/TP of a micro-batch's) over the tensor-parallel group (all-gather before "
          "and reduce-scatter after the "
          "tensor-parallel GEMMs instead of all-reduces; activations of those regions / TP)")(
          "ddp-bucket-size", po::value(&t.ddp_bucket_size)->default_value(t.ddp_bucket_size),
          "elements per data-parallel gradient all-reduce bucket")(
          "use-distributed-optimizer", po::bool_switch(&t.use_distributed_optimizer),
          "shard the fp32 master weights and Adam moments over the data-parallel ranks (ZeRO-1): "
          "gradients reduce-scattered, updated weights all-gathered")(
          "overlap-grad-reduce",
          po::value(&t.overlap_grad_reduce)->default_value(true)->implicit_value(true),
          "reduce gradient buckets while the backward runs (true | false; default true)")(
          "overlap-param-gather",
          po::value(&t.overlap_param_gather)->default_value(false)->implicit_value(true),
          "with --use-distributed-optimizer: gather updated weights bucket by bucket while the "
          "next forward runs");
  p.group("Training")
      .add_options()("micro-batch-size", po::value(&t.micro_batch_size)->default_value(1),
                     "samples per micro-batch")("global-batch-size",
                                                po::value(&t.global_batch_size)->default_value(0),
                                                "samples per iteration (0: micro-batch-size * DP); "
                                                "gradients accumulate over micro-batches")(
          "train-iters", po::value(&t.train_iters)->default_value(0), "iterations to train")(
          "lr", po::value(&t.lr)->default_value(1e-4), "peak learning rate")(
          "min-lr", po::value(&t.min_lr)->default_value(0.0), "learning rate at the end of decay")(
          "lr-decay-style", po::value(&t.lr_decay_style)->default_value("linear"),
          "constant | linear | cosine | inverse-square-root | WSD (docs/training.md)")(
          "lr-warmup-iters", po::value(&t.lr_warmup_iters)->default_value(0),
          "linear warm-up iterations")("lr-warmup-init",
                                       po::value(&t.lr_warmup_init)->default_value(0.0),
                                       "learning rate the warm-up starts from")(
          "lr-wsd-decay-style", po::value(&t.lr_wsd_decay_style),
          "WSD's final decay: exponential (the default) | linear | cosine | minus_sqrt")(
          "lr-wsd-decay-iters", po::value(&t.lr_wsd_decay_iters)->default_value(0),
          "WSD: iterations of the final decay, the last ones of the decay phase")(
          "lr-wsd-decay-samples", po::value(&t.lr_wsd_decay_samples)->default_value(0),
          "WSD: samples of the final decay (instead of --lr-wsd-decay-iters)")(
          "lr-decay-iters", po::value(&t.lr_decay_iters)->default_value(0),
          "iterations over which to decay (0: train-iters)")(
          "lr-warmup-fraction", po::value(&t.lr_warmup_fraction)->default_value(0.0),
          "warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters)")(
          "train-samples", po::value(&t.train_samples)->default_value(0),
          "samples to train (instead of --train-iters): train-samples / global batch iterations")(
          "lr-decay-samples", po::value(&t.lr_decay_samples)->default_value(0),
          "samples over which to decay (instead of --lr-decay-iters)")(
          "lr-warmup-samples", po::value(&t.lr_warmup_samples)->default_value(0),
          "warm-up samples (instead of --lr-warmup-iters)")(
          "rampup-batch-size", po::value(&rampup)->multitoken(),
          "START INCR SAMPLES: grow the global batch from START by INCR over the first SAMPLES "
          "samples (needs --train-samples)")(
          "weight-decay", po::value(&t.weight_decay)->default_value(0.01),
          "decoupled weight decay for weight matrices and embeddings (not biases or LayerNorm)")(
          "weight-decay-incr-style",
          po::value(&t.weight_decay_incr_style)->default_value("constant"),
          "constant (--weight-decay) | linear | cosine: from --start-weight-decay to "
          "--end-weight-decay over the run")(
          "start-weight-decay", po::value(&start_weight_decay),
          "weight decay at the start (--weight-decay-incr-style linear or cosine)")(
          "end-weight-decay", po::value(&end_weight_decay),
          "weight decay at the end of the run (--weight-decay-incr-style linear or cosine)")(
          "clip-grad", po::value(&t.clip_grad)->default_value(1.0),
          "clip the global gradient norm to this (0: off)")(
          "adam-beta1", po::value(&t.adam_beta1)->default_value(0.9), "Adam beta1")(
          "adam-beta2", po::value(&t.adam_beta2)->default_value(0.999), "Adam beta2")(
          "adam-eps", po::value(&t.adam_eps)->default_value(1e-8), "Adam epsilon")(
          "seed", po::value(&t.seed)->default_value(1234), "seed of initialization and data order")(
          "bf16", po::bool_switch(&bf16),
          "mixed precision: bf16 activations and weights in the passes, f32 master weights, "
          "gradients and Adam moments")("fp16", po::bool_switch(&fp16),
                                        "mixed precision in fp16, with loss scaling")(
          "loss-scale", po::value(&t.loss_scale)->default_value(0.0),
          "--fp16: a constant loss scale (0: dynamic scaling)")(
          "initial-loss-scale", po::value(&t.initial_loss_scale)->default_value(4294967296.0),
          "--fp16 dynamic scaling: the first scale")(
          "min-loss-scale", po::value(&t.min_loss_scale)->default_value(1.0),
          "--fp16 dynamic scaling: the scale never goes below this")(
          "loss-scale-window", po::value(&t.loss_scale_window)->default_value(1000),
          "--fp16 dynamic scaling: good steps in a row before the scale doubles")(
          "hysteresis", po::value(&t.hysteresis)->default_value(2),
          "--fp16 dynamic scaling: overflows in a row before the scale halves")(
          "dry-run", po::bool_switch(&t.dry_run),
          "print parameter count and memory estimate, then exit");
  p.group("Memory").add_options()(
      "recompute-granularity", po::value(&recompute_granularity),
      "recompute activations in the backward instead of storing them: full (only "
      "each chunk's input is kept) | selective (the LayerNorm, attention core and "
      "GELU outputs are recomputed); bitwise the same results")(
      "recompute-method", po::value(&recompute_method),
      "with full: uniform (the stage's layers in chunks of --recompute-num-layers; the "
      "default) | block (only the first --recompute-num-layers layers of each stage)")(
      "recompute-num-layers", po::value(&recompute_num_layers)->default_value(0),
      "with full: layers per chunk (uniform) or recomputed layers per stage (block); "
      "default 1")("checkpoint-activations", po::bool_switch(&checkpoint_activations),
                   "older name of --recompute-granularity full --recompute-method uniform")(
      "checkpoint-num-layers", po::value(&checkpoint_num_layers)->default_value(0),
      "older name of --recompute-num-layers")(
      "recompute-activations", po::bool_switch(&recompute_activations),
      "Megatron's shorthand for --recompute-granularity selective");
  p.group("Data").add_options()(
      "data-path", po::value(&data_path_words)->multitoken(),
      "prefix of the HDF5 token shards made by tessera-preprocess (PREFIX_00000.h5, ...); "
      "or Megatron's blend `W1 PREFIX1 W2 PREFIX2 ...` (weights normalized); --split cuts each "
      "dataset into train, valid and test")(
      "train-data-path", po::value(&train_path_words)->multitoken(),
      "the training data alone: a prefix or a blend, all of each dataset (instead of "
      "--data-path and --split)")(
      "valid-data-path", po::value(&valid_path_words)->multitoken(),
      "the validation data: a prefix or a blend (with --train-data-path)")(
      "test-data-path", po::value(&test_path_words)->multitoken(),
      "the test data: a prefix or a blend (with --train-data-path)")(
      "data-cache-path", po::value(&o.data_cache_path),
      "directory for the blend's index file (default: the directory of the first prefix's "
      "shards); a start finds it there instead of computing the order again")(
      "tokenizer-type", po::value(&o.tokenizer.type),
      "GPT2BPETokenizer | HuggingFaceTokenizer: checked against the tokenizer the shards were "
      "made with (not needed: the shards name it)")(
      "vocab-file", po::value(&o.tokenizer.vocab_file),
      "GPT2BPETokenizer's encoder.json, checked against the shards' tokenizer")(
      "merge-file", po::value(&o.tokenizer.merge_file),
      "GPT2BPETokenizer's vocab.bpe, checked against the shards' tokenizer")(
      "tokenizer-model", po::value(&o.tokenizer.model),
      "HuggingFaceTokenizer's tokenizer.json (or its directory), checked against the shards' "
      "tokenizer")("split", po::value(&o.split)->default_value(o.split),
                   "train,valid,test weights over the documents, in order (e.g. 949,50,1)")(
      "mock-data", po::bool_switch(&o.mock_data),
      "train on synthetic Markov-chain data (the default when no --data-path is given)");
  p.group("Checkpoints and evaluation")
      .add_options()(
          "save", po::value(&t.save),
          "directory for checkpoints (iter_NNNNNNN/ and latest_checkpointed_iteration.txt)")(
          "save-interval", po::value(&t.save_interval)->default_value(0),
          "iterations between checkpoints (0: only at the end)")(
          "keep-checkpoints", po::value(&t.keep_checkpoints)->default_value(0),
          "keep the newest N checkpoints (0: all)")(
          "load", po::value(&o.load),
          "checkpoint directory to resume from (any TP/PP layout; resharded on load)")(
          "finetune", po::bool_switch(&o.finetune),
          "with --load: take the model only; iteration, data position and optimizer start fresh")(
          "no-load-optim", po::bool_switch(&o.no_load_optim),
          "with --load: leave out the optimizer state (Adam moments, step count and learning-rate "
          "warm-up start fresh; iteration and data position are loaded)")(
          "no-load-rng", po::bool_switch(),
          "accepted for Megatron-LM's scripts: there is no RNG state to load (initialization and "
          "dropout masks are functions of --seed, the iteration and global coordinates)")(
          "no-save-optim", po::bool_switch(&t.no_save_optim),
          "save checkpoints without the optimizer state (a third of the size; a resume then "
          "starts Adam from zero)")(
          "async-save", po::bool_switch(&t.async_save),
          "save checkpoints in the background: the loop blocks only while the state is copied to "
          "host memory; the write commits when every rank has finished")(
          "use-checkpoint-args", po::bool_switch(&o.use_checkpoint_args),
          "with --load: take the model's options (layers, hidden size, heads, sequence length, "
          "vocabulary, architecture) from the checkpoint instead of the command line")(
          "exit-interval", po::value(&t.exit_interval)->default_value(0),
          "stop (after saving) once the iteration is divisible by this (0: never)")(
          "exit-duration-in-mins", po::value(&t.exit_duration_mins)->default_value(0.0),
          "stop (after saving) once training has run this long (0: never)")(
          "eval-interval", po::value(&t.eval_interval)->default_value(0),
          "iterations between evaluations on the validation data (0: none)")(
          "eval-iters", po::value(&t.eval_iters)->default_value(10),
          "global batches per evaluation; each evaluation continues through the validation split "
          "where the previous one stopped")(
          "full-validation", po::bool_switch(&t.full_validation),
          "evaluate every whole global batch of the validation split each time")(
          "skip-train", po::bool_switch(&o.skip_train),
          "do not train: evaluate --eval-iters batches (after --load) and exit");
  p.group("Logging and system")
      .add_options()("log-interval", po::value(&t.log_interval)->default_value(10),
                     "iterations between log lines")("log-level",
                                                     po::value(&log_level)->default_value("info"),
                                                     "debug | info | warning | error")(
          "log-file", po::value(&o.log.file), "also append this rank's log to this file")(
          "log-all-ranks", po::bool_switch(&o.log.all_ranks),
          "every rank prints, prefixed with its rank")(
          "metrics-file", po::value(&t.metrics_file),
          "append one JSON line per logged iteration to this file")(
          "peak-tflops", po::value(&t.peak_tflops)->default_value(0.0),
          "peak TFLOP/s per rank, to print MFU")(
          "timing-log-level", po::value(&t.timing_log_level)->default_value(0),
          "timers printed after the iteration line: 0 (only save-checkpoint, at each save), 1 "
          "(forward-backward, gradient reduction, parameter gather, optimizer), 2 (also the "
          "forward and backward compute, pipeline sends and receives, batch generator); timed "
          "phases synchronize the device")(
          "timing-log-option", po::value(&t.timing_log_option)->default_value("minmax"),
          "minmax (min and max over ranks) | max | all (every rank)")(
          "log-params-norm", po::bool_switch(&t.log_params_norm),
          "print the L2 norm of the parameters in the iteration line")(
          "log-num-zeros-in-grad", po::bool_switch(&t.log_num_zeros_in_grad),
          "print the number of zeros in the gradient in the iteration line")(
          "tensorboard-dir", po::value(&t.tensorboard_dir),
          "write TensorBoard event files here (the last rank writes them)")(
          "tensorboard-log-interval", po::value(&t.tensorboard_log_interval)->default_value(1),
          "iterations between TensorBoard scalars")(
          "log-timers-to-tensorboard", po::bool_switch(&t.log_timers_to_tensorboard),
          "also write the --timing-log-level timers (ms per iteration, max over ranks)")(
          "log-validation-ppl-to-tensorboard",
          po::bool_switch(&t.log_validation_ppl_to_tensorboard),
          "also write the validation perplexity")(
          "memory-report-interval", po::value(&t.memory_report_interval)->default_value(0),
          "print every rank's memory (allocated, max allocated, reserved) against the --dry-run "
          "estimate after the first iteration and every N iterations (0: after the first only)")(
          "distributed-timeout-minutes",
          po::value(&t.distributed_timeout_minutes)->default_value(10.0),
          "no progress for this long (a rank died or hangs) ends the job with an error naming the "
          "rank (0: wait forever)")(
          "threads", po::value(&o.threads)->default_value(0),
          "OpenMP/BLAS threads per rank (0: this rank's share of the cores in its affinity mask)")(
          "device", po::value(&o.device)->default_value("auto"),
          "cpu | cuda | auto (cuda when a GPU is visible and the build has CUDA); each rank "
          "takes the GPU of its local rank")(
          "profile", po::bool_switch(&t.profile),
          "bracket iterations with cudaProfilerStart/Stop for nsys --capture-range=cudaProfilerApi "
          "(docs/profiling.md)")("profile-step-start",
                                 po::value(&t.profile_step_start)->default_value(10),
                                 "with --profile: start capturing before iteration N+1")(
          "profile-step-end", po::value(&t.profile_step_end)->default_value(12),
          "with --profile: stop capturing after iteration N")(
          "profile-ranks", po::value(&profile_ranks)->default_value("0"),
          "with --profile: comma-separated global ranks that capture, or 'all'");
  {
    auto& g =
        p.group("Accepted for Megatron-LM's scripts, without effect (one line each at start-up)");
    for (const AcceptedOption& a : kAccepted) {
      if (!a.values)
        g.add_options()(a.name, po::bool_switch(), a.why);
      else
        g.add_options()(a.name, po::value<std::string>(),
                        *a.values ? (std::string(a.values) + ": " + a.why).c_str() : a.why);
    }
  }
  if (program.add_options) program.add_options(p);
  // A negative blend weight would reach the parser as an unknown option ("-1"): name it here.
  for (int i = 1, in_blend = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      in_blend = a == "--data-path" || a == "--train-data-path" || a == "--valid-data-path" ||
                 a == "--test-data-path";
      if (in_blend) in_blend = i;
    } else if (in_blend && a.size() > 1 && a[0] == '-' && (std::isdigit(a[1]) || a[1] == '.')) {
      throw ConfigError(std::string(argv[in_blend]) + ": the weight " + a +
                        (i + 1 < argc ? std::string(" of '") + argv[i + 1] + "'" : std::string()) +
                        " must be positive (leave a dataset out to give it no samples)");
    }
  }
  // A command-line option replaces the config file's alternatives to it (configs/*.ini set
  // train-iters and lr-warmup-iters; `--train-samples N` on the command line switches the run).
  p.alternatives({"train-iters", "train-samples"});
  p.alternatives({"train-iters", "rampup-batch-size"});
  p.alternatives({"lr-warmup-iters", "lr-warmup-samples", "lr-warmup-fraction"});
  p.alternatives({"lr-decay-iters", "lr-decay-samples"});
  p.alternatives({"lr-wsd-decay-iters", "lr-wsd-decay-samples"});
  p.alternatives({"layernorm-epsilon", "norm-epsilon"});
  p.alternatives({"num-layers-per-virtual-pipeline-stage", "virtual-pipeline-model-parallel-size"});
  p.alternatives({"bf16", "fp16"});
  p.alternatives({"mock-data", "data-path"});
  p.alternatives({"mock-data", "train-data-path"});
  p.alternatives({"recompute-granularity", "checkpoint-activations"});
  p.alternatives({"recompute-granularity", "recompute-activations"});
  if (!p.parse(argc, argv)) return false;
  o.notes = p.replaced();
  for (const AcceptedOption& a : kAccepted) {
    if (!p.given(a.name)) continue;
    std::string given = std::string("--") + a.name;
    if (a.values) {
      const std::string v = p.get<std::string>(a.name);
      given += " " + v;
      if (!*a.values) {
        size_t used = 0;
        try {
          if (std::stoll(v, &used) < 0) used = 0;
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != v.size()) throw ConfigError(given + ": not a whole number >= 0");
      } else if (("|" + std::string(a.values) + "|").find("|" + v + "|") == std::string::npos) {
        std::string allowed = a.values;
        std::replace(allowed.begin(), allowed.end(), '|', ',');
        throw ConfigError(given + " is not a choice (allowed: " + allowed + ")");
      }
    } else if (!p.get<bool>(a.name)) {
      continue;  // `use-flash-attn = false` in a config file
    }
    o.notes.push_back(given + ": accepted without effect: " + a.why);
  }
  if (p.given("start-weight-decay")) t.start_weight_decay = start_weight_decay;
  if (p.given("end-weight-decay")) t.end_weight_decay = end_weight_decay;
  o.data_path = parse_data_blend(data_path_words, "data-path");
  o.train_data_path = parse_data_blend(train_path_words, "train-data-path");
  o.valid_data_path = parse_data_blend(valid_path_words, "valid-data-path");
  o.test_data_path = parse_data_blend(test_path_words, "test-data-path");
  if (o.data_path.size() == 1 && o.data_path.text != o.data_path.prefixes[0])
    o.notes.push_back("--data-path " + o.data_path.text +
                      ": a blend of one dataset, which is all of '" + o.data_path.prefixes[0] +
                      "'");
  const bool per_split =
      !o.train_data_path.empty() || !o.valid_data_path.empty() || !o.test_data_path.empty();
  if (per_split && !o.data_path.empty())
    throw ConfigError("--data-path and --" +
                      std::string(!o.train_data_path.empty()   ? "train"
                                  : !o.valid_data_path.empty() ? "valid"
                                                               : "test") +
                      "-data-path both given; give --data-path (cut by --split) or the paths of "
                      "each split, as in Megatron-LM");
  if (per_split && o.train_data_path.empty())
    throw ConfigError(
        "--valid-data-path / --test-data-path need --train-data-path (the training data)");
  if (per_split && p.given("split"))
    throw ConfigError("--split " + o.split +
                      " cuts --data-path into train, valid and test; with --train-data-path each "
                      "path is a whole split (leave --split out)");
  o.tokenizer_given = p.given("tokenizer-type") || p.given("vocab-file") || p.given("merge-file") ||
                      p.given("tokenizer-model");
  if (o.tokenizer_given && !p.given("tokenizer-type"))
    o.tokenizer.type = p.given("tokenizer-model") ? "HuggingFaceTokenizer" : "GPT2BPETokenizer";
  if (t.async_save && t.save.empty())
    throw ConfigError("--async-save needs --save (there is nothing to save in the background)");
  if (p.given("num-query-groups") && !m.group_query_attention)
    throw ConfigError(detail::concat("--num-query-groups=", m.num_query_groups,
                                     " needs --group-query-attention (without it every head has "
                                     "keys and values of its own)"));
  o.log.level = log_level_from_name(log_level);
  m.add_bias_linear = !disable_bias_linear;
  if (!capacity_factor.empty() && capacity_factor != "None" && capacity_factor != "none") {
    char* end = nullptr;
    m.moe_expert_capacity_factor = std::strtod(capacity_factor.c_str(), &end);
    if (end == capacity_factor.c_str() || *end != '\0' || !(m.moe_expert_capacity_factor > 0))
      throw ConfigError("--moe-expert-capacity-factor=" + capacity_factor +
                        " is out of range (allowed: a number > 0; leave it out for dropless)");
  }
  if (m.moe_dropless() && (!drop_policy.empty() || pad_to_capacity))
    throw ConfigError(std::string(pad_to_capacity ? "--moe-pad-expert-input-to-capacity"
                                                  : "--moe-token-drop-policy") +
                      " needs --moe-expert-capacity-factor (without one every token reaches "
                      "its experts and none is dropped)");
  if (!drop_policy.empty()) m.moe_token_drop_policy = drop_policy;

  if (o.ep < 1)
    throw ConfigError(
        detail::concat("--expert-model-parallel-size=", o.ep, " is out of range (allowed: >= 1)"));
  if (o.ep > 1 && !m.moe())
    throw ConfigError("--expert-model-parallel-size needs --num-experts (a MoE model)");
  if (m.moe() && m.num_experts % o.ep != 0)
    throw ConfigError(detail::concat("--expert-model-parallel-size=", o.ep,
                                     " does not divide --num-experts=", m.num_experts,
                                     " (allowed: a divisor of ", m.num_experts, ")"));

  if (p.given("norm-epsilon")) {
    if (p.given("layernorm-epsilon") && norm_epsilon != m.layernorm_epsilon)
      throw ConfigError(detail::concat("--norm-epsilon=", norm_epsilon, " and --layernorm-epsilon=",
                                       m.layernorm_epsilon, " disagree; give one"));
    m.layernorm_epsilon = norm_epsilon;
  }
  t.profile_ranks = parse_rank_list(profile_ranks, "--profile-ranks");
  t.rampup_batch_size = parse_rampup(rampup);
  if (bf16 && fp16) throw ConfigError("--bf16 and --fp16 both given; choose one");
  t.compute_dtype = bf16 ? DType::BF16 : fp16 ? DType::F16 : DType::F32;
  if (recompute_activations) {
    if (checkpoint_activations)
      throw ConfigError(
          "--recompute-activations (selective) and --checkpoint-activations (full) both given; "
          "choose one");
    recompute_granularity = "selective";
  }
  t.recompute = recompute_options(recompute_granularity, recompute_method, recompute_num_layers,
                                  checkpoint_activations, checkpoint_num_layers);
  {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    o.device = resolve_device(o.device, host);
  }
  if (o.mock_data && o.has_data())
    throw ConfigError(std::string("--mock-data and --") +
                      (o.data_path.empty() ? "train-data-path" : "data-path") +
                      " both given; choose one");
  if (!o.has_data()) {
    o.mock_data = true;
    if (m.vocab_size == 0 && o.tokenizer_given) {  // Megatron's mock data: the tokenizer's size
      m.vocab_size = load_tokenizer(o.tokenizer)->vocab_size();
      o.notes.push_back(
          detail::concat("mock data over the ", m.vocab_size, " tokens of the tokenizer options"));
    }
    if (m.vocab_size == 0) m.vocab_size = 512;
  }
  parse_split(o.split);
  if (o.threads < 0)
    throw ConfigError(detail::concat("--threads=", o.threads, " is out of range (allowed: >= 0)"));
  if (o.tp < 1)
    throw ConfigError(
        detail::concat("--tensor-model-parallel-size=", o.tp, " is out of range (allowed: >= 1)"));
  if (o.pp < 1)
    throw ConfigError(detail::concat("--pipeline-model-parallel-size=", o.pp,
                                     " is out of range (allowed: >= 1)"));
  if (o.cp < 1)
    throw ConfigError(
        detail::concat("--context-parallel-size=", o.cp, " is out of range (allowed: >= 1)"));
  if (cp_comm_type != "p2p")
    throw ConfigError("--cp-comm-type=" + cp_comm_type +
                      " is not available: Tessera's context parallelism passes K/V blocks around "
                      "a ring, point to point (allowed: p2p)");
  if (o.finetune && o.load.empty()) throw ConfigError("--finetune needs --load");
  if (o.no_load_optim && o.load.empty()) throw ConfigError("--no-load-optim needs --load");
  if (t.full_validation && o.mock_data)
    throw ConfigError("--full-validation needs --data-path (mock data has no end)");
  if (!o.load.empty()) {
    const std::string why = no_checkpoint_in(o.load);
    if (!why.empty()) {
      o.load_fresh = true;
      o.notes.push_back(
          "--load '" + o.load + "' holds no checkpoint yet (" + why +
          "): training starts from iteration 0, as in Megatron-LM" +
          (o.use_checkpoint_args ? "; the model's options come from the command line" : ""));
    }
  }
  if (o.use_checkpoint_args && !o.load_fresh) {
    if (o.load.empty()) throw ConfigError("--use-checkpoint-args needs --load");
    // Megatron's load_args_from_checkpoint: the model's shape and architecture are the
    // checkpoint's; dropout stays this run's (a training choice).
    const GPTConfig from = CheckpointReader(o.load).meta().model;
    const double attention_dropout = m.attention_dropout, hidden_dropout = m.hidden_dropout;
    m = from;
    m.attention_dropout = attention_dropout;
    m.hidden_dropout = hidden_dropout;
  }
  if (layers_per_virtual_stage < 0)
    throw ConfigError(detail::concat("--num-layers-per-virtual-pipeline-stage=",
                                     layers_per_virtual_stage, " is out of range (allowed: >= 1)"));
  if (virtual_size < 0)
    throw ConfigError(detail::concat("--virtual-pipeline-model-parallel-size=", virtual_size,
                                     " is out of range (allowed: >= 1)"));
  if (layers_per_virtual_stage > 0) {
    if (m.num_layers % (o.pp * layers_per_virtual_stage) != 0)
      throw ConfigError(detail::concat(
          "--num-layers=", m.num_layers, " is not divisible by --pipeline-model-parallel-size=",
          o.pp, " x --num-layers-per-virtual-pipeline-stage=", layers_per_virtual_stage, " = ",
          o.pp * layers_per_virtual_stage));
    const int v = m.num_layers / (o.pp * layers_per_virtual_stage);
    if (virtual_size > 0 && virtual_size != v)
      throw ConfigError(
          detail::concat("--virtual-pipeline-model-parallel-size=", virtual_size,
                         " and --num-layers-per-virtual-pipeline-stage=", layers_per_virtual_stage,
                         " disagree (the latter means ", v, " chunks per rank); give one"));
    t.virtual_pipeline_size = v;
    t.virtual_option = "--num-layers-per-virtual-pipeline-stage";
  } else if (virtual_size > 0) {
    t.virtual_pipeline_size = virtual_size;
  }
  if (t.virtual_pipeline_size == 1 && (layers_per_virtual_stage > 0 || virtual_size > 0))
    o.notes.push_back(
        layers_per_virtual_stage > 0
            ? detail::concat("--num-layers-per-virtual-pipeline-stage=", layers_per_virtual_stage,
                             " makes one model chunk per pipeline rank (", m.num_layers,
                             " layers / PP ", o.pp,
                             "): the plain 1F1B schedule runs, as in Megatron-LM")
            : std::string("--virtual-pipeline-model-parallel-size=1: one model chunk per "
                          "pipeline rank, the plain 1F1B schedule"));
  t.config_text = p.to_ini();
  GPTConfig check = m;
  if (check.vocab_size == 0) check.vocab_size = 2;  // known once the shards are open
  check.validate();
  if (program.data_only) {
    TrainConfig c = t;  // the micro-batch is the trainer's business: any global batch works
    c.micro_batch_size = 1;
    c.validate(1);
  } else {
    t.validate(1);
  }
  if (!t.dry_run && !o.skip_train && t.train_iters <= 0 && t.train_samples <= 0)
    throw ConfigError(
        "give the length of the run: --train-iters N or --train-samples N (as in Megatron-LM; "
        "--dry-run and --skip-train need neither)");
  return true;
}

std::unique_ptr<Backend> make_rank_backend(ProcessGrid& grid, const std::string& device,
                                           bool pipeline_ring) {
  // Megatron's setting: one hardware queue, so kernels of the compute and NCCL streams start in
  // the order the host issued them on every rank (no cross-stream reordering between ranks).
  if (device == "cuda") setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", /*overwrite=*/0);
  std::unique_ptr<Backend> be;
  try {
    be = make_backend(device, grid.local_rank(), grid.local_size(), grid.host());
    // Every rank of the node learns which GPU each took (collective over the node).
    constexpr int kId = 32;
    char mine[kId] = {0};
    std::snprintf(mine, sizeof mine, "%s", backend_gpu_id(*be).c_str());
    std::vector<char> all(static_cast<size_t>(kId) * grid.local_size());
    MPI_CHECK(MPI_Allgather(mine, kId, MPI_CHAR, all.data(), kId, MPI_CHAR, grid.node_comm()));
    std::vector<std::string> ids;
    for (int r = 0; r < grid.local_size(); ++r) ids.emplace_back(all.data() + size_t(r) * kId);
    check_distinct_gpus(ids, grid.host());
  } catch (const ConfigError& e) {
    abort_job(e.what(), 2);
  }
  if (pipeline_ring) grid.use_pipeline_ring();
  if (be->device() == Device::CUDA) grid.use_nccl(be->stream());
  return be;
}

namespace {

// Where split `s` comes from: --data-path cut by --split, or the split's own path.
struct SplitSource {
  const DataBlend* blend = nullptr;
  std::string option;  // "--data-path", "--valid-data-path", ...
  std::array<double, 3> weights{0, 0, 0};
};

SplitSource source_of(const RunOptions& o, Split s) {
  SplitSource src;
  if (!o.data_path.empty()) {
    src.blend = &o.data_path;
    src.option = "--data-path";
    src.weights = parse_split(o.split);
    return src;
  }
  src.blend = s == Split::Train   ? &o.train_data_path
              : s == Split::Valid ? &o.valid_data_path
                                  : &o.test_data_path;
  src.option = std::string("--") + split_name(s) + "-data-path";
  src.weights[static_cast<int>(s)] = 1;
  return src;
}

// Megatron's tokenizer options name the tokenizer the data was made with; the shards name it too
// (attribute `tokenizer`). A mismatch is an error naming both.
void check_data_tokenizer(const RunOptions& o, const ShardMeta& meta, const std::string& option,
                          const std::string& prefix) {
  const std::string shards = "the shards of " + option + " '" + prefix + "'";
  const std::string kind = meta.tokenizer == "gpt2-bpe"          ? "GPT2BPETokenizer"
                           : meta.tokenizer.rfind("hf:", 0) == 0 ? "HuggingFaceTokenizer"
                                                                 : meta.tokenizer;
  if (o.tokenizer.type != kind)
    throw ConfigError("--tokenizer-type " + o.tokenizer.type + " is not the tokenizer " + shards +
                      " were made with (" + kind + ", '" + meta.tokenizer +
                      "'); give that one, or leave the tokenizer options out (the shards name "
                      "their tokenizer)");
  const TokenizerOptions& t = o.tokenizer;
  if (t.vocab_file.empty() && t.merge_file.empty() && t.model.empty()) return;  // the type alone
  const std::shared_ptr<const Tokenizer> tok = load_tokenizer(t);
  const std::string given =
      t.model.empty() ? "--vocab-file '" + t.vocab_file + "' / --merge-file '" + t.merge_file + "'"
                      : "--tokenizer-model '" + t.model + "'";
  if (tok->name() != meta.tokenizer || tok->vocab_size() != meta.vocab_size)
    throw ConfigError(detail::concat("the tokenizer of ", given, " ('", tok->name(), "', ",
                                     tok->vocab_size(), " tokens) is not the one ", shards,
                                     " were made with ('", meta.tokenizer, "', ", meta.vocab_size,
                                     " tokens); give the files the data was preprocessed with, "
                                     "or leave the tokenizer options out"));
}

// The datasets of split `s`, every corpus checked against `ref` (the tokenizer of the first
// corpus opened; set here when empty). Null when the source gives the split no data.
std::unique_ptr<BlendedDataset> open_blend(const RunOptions& o, Split s, ShardMeta& ref,
                                           std::string& ref_prefix) {
  const SplitSource src = source_of(o, s);
  if (src.blend->empty()) return nullptr;
  std::vector<std::unique_ptr<GPTDataset>> parts;
  for (const std::string& prefix : src.blend->prefixes) {
    auto corpus = std::make_shared<const ShardedCorpus>(prefix);
    const ShardMeta& m = corpus->meta();
    if (ref_prefix.empty()) {
      ref = m;
      ref_prefix = prefix;
      if (o.tokenizer_given) check_data_tokenizer(o, m, src.option, prefix);
    } else if (m.vocab_size != ref.vocab_size || m.eod_id != ref.eod_id ||
               m.tokenizer != ref.tokenizer) {
      throw ConfigError(
          detail::concat(src.option, ": the shards of '", prefix,
                         "' were made with another tokenizer than those of '", ref_prefix, "' ('",
                         m.tokenizer, "', ", m.vocab_size, " tokens, end of document ", m.eod_id,
                         " vs '", ref.tokenizer, "', ", ref.vocab_size, " tokens, ", ref.eod_id,
                         "); every dataset of a run must share one vocabulary"));
    }
    parts.push_back(
        std::make_unique<GPTDataset>(corpus, s, src.weights, o.model.seq_length, o.train.seed));
  }
  return std::make_unique<BlendedDataset>(std::move(parts), *src.blend);
}

// The first dataset of `ds` without a sample for split `s`, or -1.
int first_empty(const BlendedDataset& ds) {
  for (int d = 0; d < ds.num_datasets(); ++d)
    if (ds.dataset(d).num_samples() == 0) return d;
  return -1;
}

std::string empty_split_message(const RunOptions& o, const BlendedDataset& ds, int d, Split s) {
  const SplitSource src = source_of(o, s);
  return detail::concat("the ", split_name(s), " split of '", ds.blend().prefixes[d], "' (",
                        src.option,
                        src.option == "--data-path" ? " with --split " + o.split : std::string(),
                        ") has no sample of --seq-length+1 = ", o.model.seq_length + 1,
                        " tokens: ", ds.dataset(d).describe());
}

}  // namespace

std::unique_ptr<TokenDataset> open_valid_data(const RunOptions& o) {
  if (o.mock_data)  // another stream of the same chain: unseen samples
    return make_mock_dataset(o.model.vocab_size, o.model.seq_length, o.train.seed + 1000003);
  ShardMeta ref = o.data_meta;
  std::string ref_prefix = o.data_meta_prefix;
  auto ds = open_blend(o, Split::Valid, ref, ref_prefix);
  if (!ds)
    throw ConfigError(
        "evaluation needs validation data: give --valid-data-path (with --train-data-path), or "
        "turn evaluation off (--eval-interval 0)");
  const int d = first_empty(*ds);
  if (d >= 0)
    throw ConfigError("evaluation needs validation data, but " +
                      empty_split_message(o, *ds, d, Split::Valid) +
                      "; give valid a share or turn evaluation off (--eval-interval 0)");
  return ds;
}

std::unique_ptr<TokenDataset> open_test_data(const RunOptions& o) {
  if (o.mock_data)  // a third stream of the chain
    return make_mock_dataset(o.model.vocab_size, o.model.seq_length, o.train.seed + 2000003);
  ShardMeta ref = o.data_meta;
  std::string ref_prefix = o.data_meta_prefix;
  auto ds = open_blend(o, Split::Test, ref, ref_prefix);
  if (!ds) return nullptr;
  const int d = first_empty(*ds);
  if (d >= 0) {
    TLOG(info) << "no evaluation on the test split: "
               << empty_split_message(o, *ds, d, Split::Test);
    return nullptr;
  }
  return ds;
}

std::unique_ptr<TokenDataset> open_train_data(RunOptions& o) {
  if (o.mock_data) return make_mock_dataset(o.model.vocab_size, o.model.seq_length, o.train.seed);
  // The vocabulary is known once the first corpus is open; the datasets need only the length.
  auto ds = open_blend(o, Split::Train, o.data_meta, o.data_meta_prefix);
  TESSERA_CHECK(ds, "no training data");
  const int64_t vocab = o.data_meta.vocab_size;
  if (o.model.vocab_size == 0) {
    o.model.vocab_size = vocab;
  } else if (o.model.vocab_size != vocab) {
    throw ConfigError(detail::concat("--vocab-size=", o.model.vocab_size, " differs from the ",
                                     vocab, " tokens of the tokenizer of '", o.data_meta_prefix,
                                     "' (leave --vocab-size out to take it from the data)"));
  }
  o.model.validate();
  const int d = first_empty(*ds);
  if (d < 0 && ds->num_datasets() > 1) {
    // The blend's order over the whole run: from the cache file of an earlier start when there
    // is one (world rank 0 writes it), else computed here.
    int initialized = 0, rank = 0, world = 1;
    MPI_Initialized(&initialized);
    if (initialized) {
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Comm_size(MPI_COMM_WORLD, &world);
    }
    const int dp = std::max(1, world / std::max(1, o.tp * o.pp * o.cp));
    const TrainConfig t = o.train.resolved(dp);
    const int64_t run = t.samples_before_iteration(dp, t.train_iters + 1);
    std::string dir = o.data_cache_path;
    if (!dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec)
        throw ConfigError("--data-cache-path '" + dir +
                          "': cannot create the directory: " + ec.message());
    } else {
      const std::string& first = ds->blend().prefixes[0];
      const size_t slash = first.rfind('/');
      dir = slash == std::string::npos ? "." : slash == 0 ? "/" : first.substr(0, slash);
    }
    o.notes.push_back(ds->index().use_cache(dir, run, rank == 0));
  }
  if (d >= 0)
    throw ConfigError(empty_split_message(o, *ds, d, Split::Train) +
                      (o.data_path.empty() ? "; lower --seq-length or give more documents"
                                           : "; give train a larger share or lower --seq-length"));
  return ds;
}

std::vector<std::string> data_report(const TokenDataset& data, const TrainConfig& t, int dp_size) {
  const auto* ds = dynamic_cast<const BlendedDataset*>(&data);
  if (!ds) return {"data: " + data.describe()};
  std::vector<std::string> lines;
  const int64_t run = t.samples_before_iteration(dp_size, t.resolved(dp_size).train_iters + 1);
  const std::vector<int64_t> drawn = ds->index().counts_before(run);
  if (ds->num_datasets() > 1)
    lines.push_back(detail::concat("data: ", ds->describe(), "; ", run,
                                   " samples over the run in Megatron's blending order"));
  for (int d = 0; d < ds->num_datasets(); ++d) {
    const GPTDataset& g = ds->dataset(d);
    std::ostringstream os;
    os << "data: dataset " << d << " '" << ds->blend().prefixes[d] << "'";
    if (ds->num_datasets() > 1) os << ", weight " << ds->blend().weights[d];
    os << ": " << split_name(g.split()) << " split, documents " << g.doc_begin() << "-"
       << g.doc_end() << " of " << g.corpus().num_docs() << ", " << g.num_tokens() << " tokens, "
       << g.num_samples() << " samples of " << g.seq_length() + 1 << " tokens per epoch; "
       << drawn[d] << " drawn over the run (";
    os.setf(std::ios::fixed);
    os.precision(2);
    os << double(drawn[d]) / double(std::max<int64_t>(1, g.num_samples())) << " epochs";
    if (ds->num_datasets() > 1)
      os << "; Megatron would size it " << megatron_dataset_size(ds->blend().weights[d], run);
    os << ")";
    lines.push_back(os.str());
  }
  return lines;
}

int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

int default_threads(MPI_Comm node) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) return 1;
  int n = 1;
  MPI_Comm_size(node, &n);
  std::vector<cpu_set_t> all(n);
  MPI_Allgather(&mine, sizeof(cpu_set_t), MPI_BYTE, all.data(), sizeof(cpu_set_t), MPI_BYTE, node);
  int sharing = 0;
  for (cpu_set_t& other : all) {
    cpu_set_t both;
    CPU_AND(&both, &mine, &other);
    sharing += CPU_COUNT(&both) > 0;
  }
  return std::max(1, CPU_COUNT(&mine) / std::max(1, sharing));
}

void set_num_threads(int n) {
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

RingTraffic cp_ring_traffic(const GPTConfig& cfg, const TrainConfig& t, int tp, int cp) {
  RingTraffic r;
  if (cp <= 1) return r;
  r.block = double(t.micro_batch_size) * (cfg.seq_length / cp) * 2.0 * (cfg.kv_heads() / tp) *
            cfg.head_dim() * dtype_size(t.compute_dtype);
  r.forward = (cp - 1) * r.block;
  r.backward = (cp - 1) * r.block + cp * r.block;
  r.recompute = t.recompute.granularity == RecomputeGranularity::None ? 0.0 : r.forward;
  return r;
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
  const ModelShard shard = make_model_shard(cfg, ctx, t.sequence_parallel, t.virtual_pipeline_size);
  MemoryEstimate e;
  for (const auto& s : build_param_specs(cfg, shard)) {
    e.parameters += s.numel();
    if (s.expert) e.expert_parameters += s.numel();
  }
  const int V = t.virtual_pipeline_size;
  const int micro = t.num_micro_batches(layout.dp);
  std::vector<int> chunk_slots{pipeline_slots(layout.pp, stage, micro)};
  if (V > 1)
    chunk_slots = pipeline_chunk_slots(schedule_interleaved(layout.pp, stage, micro, V), V);
  e.slots = 0;
  for (int n : chunk_slots) e.slots += n;
  // f32 master weights, plus their bf16/f16 copy in mixed precision; with the distributed
  // optimizer the master weights (mixed precision) and the Adam moments of 1/DP of them.
  const bool mixed = t.compute_dtype != DType::F32;
  // Routed experts' blocks are cut over the expert-data-parallel group (DP / EP).
  const double dp = t.use_distributed_optimizer ? double(layout.dp) * layout.cp : 1.0;
  const double edp = t.use_distributed_optimizer ? double(layout.dp) / ep * layout.cp : 1.0;
  const double dense = static_cast<double>(e.parameters - e.expert_parameters);
  const double experts = static_cast<double>(e.expert_parameters);
  e.param_bytes =
      mixed ? 2.0 * e.parameters + 4.0 * (dense / dp + experts / edp) : 4.0 * e.parameters;
  e.grad_bytes = 4.0 * e.parameters;
  e.optimizer_bytes = 8.0 * (dense / dp + experts / edp);
  e.expert_bytes = experts * ((mixed ? 2.0 + 4.0 / edp : 4.0) + 4.0 + 8.0 / edp);
  if (cfg.moe()) {  // one MoE layer's token copies for one micro-batch (in activation_bytes)
    const double N = double(t.micro_batch_size) * T, K = cfg.moe_router_topk;
    const double R = ep > 1 ? ep * N * std::min<double>(K, cfg.num_experts / ep) : N * K;
    const double width = dtype_size(t.compute_dtype);
    // sent and returned copies (N*K rows each), and with EP the rows received (R)
    e.dispatch_bytes = width * cfg.hidden_size * (2 * N * K + (ep > 1 ? R : 0));
  }
  const ActivationFootprint fp =
      activation_footprint(cfg, shard, t.recompute, t.micro_batch_size, T, t.compute_dtype);
  e.activation_bytes = activation_bytes(cfg, shard, t.recompute, t.micro_batch_size, T,
                                        t.compute_dtype, chunk_slots);
  e.activation_shared_bytes = fp.shared;
  e.stage_layers = shard.num_layers();
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

std::string dry_run_report(const RunOptions& o, int world_size) {
  const int world = world_size > 1 ? world_size : o.tp * o.cp * o.pp * o.ep;
  const GridLayout layout = GridLayout::make(world, o.tp, o.pp, o.cp);
  if (layout.dp % o.ep != 0)
    throw ConfigError(detail::concat("--expert-model-parallel-size=", o.ep,
                                     " does not divide the data-parallel size ", layout.dp,
                                     " (world ", world, " / (TP ", o.tp, " x PP ", o.pp,
                                     "); allowed: a divisor of ", layout.dp, ")"));
  validate_layout(o.model, o.train, layout.tp, layout.pp, layout.dp, layout.cp);
  auto gib = [](double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); };
  std::ostringstream os;
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "parameters: %lld (model%s); padded vocabulary %lld (true "
                "%lld, multiple of %d x TP)\n",
                (long long)o.model.num_parameters(),
                o.model.tied_head() ? ", tied head counted once" : "",
                (long long)o.model.padded_vocab_size(o.tp), (long long)o.model.vocab_size,
                o.model.make_vocab_size_divisible_by);
  os << buf;
  if (o.model.moe()) {
    std::snprintf(buf, sizeof buf,
                  "MoE: %lld parameters active per token (top-%d of %d experts in %d layers); "
                  "each rank holds %d expert%s per MoE layer (expert-parallel size %d)\n",
                  (long long)o.model.num_active_parameters(), o.model.moe_router_topk,
                  o.model.num_experts, o.model.num_moe_layers(), o.model.num_experts / o.ep,
                  o.model.num_experts / o.ep == 1 ? "" : "s", o.ep);
    os << buf;
  }
  os << "architecture: " << o.model.describe() << "\n";
  os << "activation recomputation: " << o.train.recompute.describe() << "; optimizer: "
     << (o.train.use_distributed_optimizer ? "distributed (master weights and Adam moments of "
                                             "1/DP of the parameters per rank)"
                                           : "replicated on every DP rank")
     << "; sequence parallelism: " << (o.train.sequence_parallel ? "on" : "off") << "\n";
  const int micro = o.train.num_micro_batches(layout.dp);
  std::snprintf(
      buf, sizeof buf,
      "layout: world %d = TP %d x%s PP %d x DP %d%s%s; global batch %d = micro-batch %d x "
      "%d micro-batches x DP %d\n",
      world, layout.tp, layout.cp > 1 ? detail::concat(" CP ", layout.cp, " x").c_str() : "",
      layout.pp, layout.dp,
      o.ep > 1
          ? detail::concat(" (EP ", o.ep, " x expert-data-parallel ", layout.dp / o.ep, ")").c_str()
          : "",
      world_size > 1 ? "" : " (assumed: run under mpirun for another DP)",
      o.train.global_batch(layout.dp), o.train.micro_batch_size, micro, layout.dp);
  os << buf;
  if (layout.cp > 1) {
    const RingTraffic ring = cp_ring_traffic(o.model, o.train, layout.tp, layout.cp);
    const int S = o.model.seq_length, c = S / (2 * layout.cp);
    char recomputed[64] = "";
    if (ring.recompute > 0)
      std::snprintf(recomputed, sizeof recomputed, " + %.2f MiB recomputed",
                    ring.recompute / (1024.0 * 1024.0));
    std::snprintf(buf, sizeof buf,
                  "context parallelism: CP %d; each rank holds %d of the %d tokens of a sample "
                  "(chunks r and %d-r of %d tokens); per-token activations / %d; ring per layer "
                  "per micro-batch: K/V block %.2f MiB, sent %.2f MiB forward + %.2f MiB "
                  "backward%s = %.2f MiB per rank\n",
                  layout.cp, S / layout.cp, S, 2 * layout.cp - 1, c, layout.cp,
                  ring.block / (1024.0 * 1024.0), ring.forward / (1024.0 * 1024.0),
                  ring.backward / (1024.0 * 1024.0), recomputed,
                  ring.per_layer() / (1024.0 * 1024.0));
    os << buf;
  }
  for (int stage = 0; stage < layout.pp; ++stage) {
    ParallelContext ctx;
    ctx.tp_size = layout.tp;
    ctx.pp_size = layout.pp;
    ctx.pp_rank = stage;
    ctx.cp_size = layout.cp;
    const ModelShard shard =
        make_model_shard(o.model, ctx, o.train.sequence_parallel, o.train.virtual_pipeline_size);
    const MemoryEstimate e = estimate_rank_memory(o.model, o.train, layout, stage, o.ep);
    const int64_t local = e.parameters;
    const int slots = e.slots;
    const double act = e.activation_bytes, p = e.param_bytes, g = e.grad_bytes,
                 adam = e.optimizer_bytes;
    std::snprintf(buf, sizeof buf,
                  "stage %d (layers %s%s%s): parameters per rank %lld | memory per rank (GiB): "
                  "parameters %.3f, gradients %.3f, optimizer state %.3f, activations %.3f "
                  "(%d micro-batch%s in flight%s), total %.3f\n",
                  stage, shard.describe_layers().c_str(), shard.has_embedding ? ", embedding" : "",
                  shard.has_head ? ", head" : "", (long long)local, gib(p), gib(g), gib(adam),
                  gib(act), slots, slots == 1 ? "" : "es",
                  shard.num_chunks() > 1 ? " over its model chunks" : "", gib(p + g + adam + act));
    os << buf;
    std::snprintf(buf, sizeof buf,
                  "  bytes per parameter %.1f (weights %.1f, gradients %.1f, optimizer %.1f) | "
                  "activations kept per layer per micro-batch %.2f MiB, shared working set %.2f "
                  "MiB\n",
                  (p + g + adam) / local, p / local, g / local, adam / local,
                  e.activation_layer_bytes / (1024.0 * 1024.0),
                  e.activation_shared_bytes / (1024.0 * 1024.0));
    os << buf;
    if (layout.tp > 1) {
      std::snprintf(buf, sizeof buf,
                    "  LayerNorm/dropout/residual regions per layer per micro-batch %.2f MiB "
                    "(%.2f MiB without sequence parallelism, %.2f MiB with it: / TP %d)\n",
                    e.sp_region_layer_bytes / (1024.0 * 1024.0),
                    e.sp_region_layer_bytes_without / (1024.0 * 1024.0),
                    e.sp_region_layer_bytes_without / layout.tp / (1024.0 * 1024.0), layout.tp);
      os << buf;
    }
    if (o.model.moe()) {
      std::snprintf(buf, sizeof buf,
                    "  MoE: routed experts %lld parameters per rank (%.3f GiB of weights, "
                    "gradients and optimizer state at EP %d); token dispatch buffers %.2f MiB per "
                    "MoE layer per micro-batch\n",
                    (long long)e.expert_parameters, gib(e.expert_bytes), o.ep,
                    e.dispatch_bytes / (1024.0 * 1024.0));
      os << buf;
    }
  }
  return os.str();
}

}  // namespace tessera
