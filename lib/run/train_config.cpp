// train_config.cpp: validation of the training settings.
#include "run/train_config.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/error.hpp"

namespace tessera {

namespace {

std::string ramp_text(const std::vector<int64_t>& r) {
  std::string s;
  for (int64_t v : r) s += (s.empty() ? "" : " ") + std::to_string(v);
  return s;
}

// Megatron's conditions on --rampup-batch-size, checked before the first step (Megatron finds a
// batch that does not split into micro-batches only when the ramp reaches it).
void validate_rampup(const TrainConfig& t, int dp_size) {
  using detail::concat;
  const std::vector<int64_t>& r = t.rampup_batch_size;
  if (r.empty()) return;
  const std::string given = "--rampup-batch-size " + ramp_text(r);
  if (r.size() != 3)
    throw ConfigError(given +
                      ": give three numbers, START INCR SAMPLES (e.g. --rampup-batch-size 16 16 "
                      "500000)");
  const int64_t start = r[0], incr = r[1], samples = r[2], G = t.global_batch(dp_size);
  if (start < 1 || incr < 1 || samples < 1)
    throw ConfigError(given + ": START, INCR and SAMPLES must be >= 1");
  if (start > G)
    throw ConfigError(concat(given, ": START ", start, " exceeds --global-batch-size=", G,
                             "; the ramp grows the batch up to the global batch size"));
  if ((G - start) % incr != 0)
    throw ConfigError(concat(given, " does not reach --global-batch-size=", G,
                             " in whole steps: ", G, " - START ", start, " = ", G - start,
                             " is not a multiple of INCR ", incr));
  const int64_t unit = int64_t(t.micro_batch_size) * dp_size;
  for (int64_t b = start; b <= G; b += incr)
    if (b % unit != 0)
      throw ConfigError(concat(given, ": the ramp's global batch ", b,
                               " is not divisible by --micro-batch-size=", t.micro_batch_size,
                               " x data-parallel size ", dp_size, " = ", unit,
                               " (START and INCR must be multiples of ", unit, ")"));
  if (t.train_samples <= 0)
    throw ConfigError(given +
                      " needs --train-samples (as in Megatron-LM: iterations of a growing batch "
                      "do not measure the run; give its length in samples)");
  if (t.lr_warmup_iters > 0 || t.lr_decay_iters > 0)
    throw ConfigError(concat("--lr-warmup-iters=", t.lr_warmup_iters,
                             " / --lr-decay-iters=", t.lr_decay_iters,
                             " count iterations, whose size changes under ", given,
                             "; give --lr-warmup-samples or --lr-warmup-fraction and "
                             "--lr-decay-samples (set the iteration options to 0)"));
  if (t.lr_wsd_decay_iters > 0)
    throw ConfigError(concat("--lr-wsd-decay-iters=", t.lr_wsd_decay_iters,
                             " counts iterations, whose size changes under ", given,
                             "; give --lr-wsd-decay-samples"));
}

// The learning-rate schedule's options on their own (the lengths' relation to the decay phase is
// checked by resolved(), once they are counted in one unit).
void validate_schedule(const TrainConfig& t) {
  using detail::concat;
  const std::string& style = t.lr_decay_style;
  if (style != "constant" && style != "linear" && style != "cosine" &&
      style != "inverse-square-root" && style != "WSD")
    throw ConfigError("--lr-decay-style=" + style +
                      " is not a style (allowed: constant, linear, cosine, inverse-square-root, "
                      "WSD)");
  if (!(t.lr_warmup_init >= 0 && t.lr_warmup_init <= t.lr))
    throw ConfigError(concat("--lr-warmup-init=", t.lr_warmup_init,
                             " is out of range (allowed: 0 <= init <= --lr=", t.lr, ")"));
  if (t.lr_wsd_decay_iters < 0)
    throw ConfigError(
        concat("--lr-wsd-decay-iters=", t.lr_wsd_decay_iters, " is out of range (allowed: >= 1)"));
  if (t.lr_wsd_decay_samples < 0)
    throw ConfigError(concat("--lr-wsd-decay-samples=", t.lr_wsd_decay_samples,
                             " is out of range (allowed: >= 1)"));
  const std::string& w = t.lr_wsd_decay_style;
  if (!w.empty() && w != "exponential" && w != "linear" && w != "cosine" && w != "minus_sqrt")
    throw ConfigError("--lr-wsd-decay-style=" + w +
                      " is not a style (allowed: exponential, linear, cosine, minus_sqrt)");
  const bool wsd_length = t.lr_wsd_decay_iters > 0 || t.lr_wsd_decay_samples > 0;
  if (style != "WSD" && (wsd_length || !w.empty()))
    throw ConfigError(std::string(!w.empty()                 ? "--lr-wsd-decay-style"
                                  : t.lr_wsd_decay_iters > 0 ? "--lr-wsd-decay-iters"
                                                             : "--lr-wsd-decay-samples") +
                      " applies only to --lr-decay-style WSD (the style is " + style + ")");
  if (style == "WSD" && !wsd_length)
    throw ConfigError(
        "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples (the length "
        "of the final decay)");
}

// Megatron's conditions on the weight-decay increment (arguments.py and the scheduler's asserts).
void validate_weight_decay_schedule(const TrainConfig& t) {
  using detail::concat;
  const std::string& style = t.weight_decay_incr_style;
  if (style != "constant" && style != "linear" && style != "cosine")
    throw ConfigError("--weight-decay-incr-style=" + style +
                      " is not a style (allowed: constant, linear, cosine)");
  const bool start = t.start_weight_decay.has_value(), end = t.end_weight_decay.has_value();
  if (style == "constant" && (start || end))
    throw ConfigError(std::string(start ? "--start-weight-decay" : "--end-weight-decay") +
                      " needs --weight-decay-incr-style linear or cosine (constant: the decay is "
                      "--weight-decay)");
  if (style != "constant" && !(start && end))
    throw ConfigError("--weight-decay-incr-style " + style +
                      " needs --start-weight-decay and --end-weight-decay");
  if (style == "constant") return;
  if (!(*t.start_weight_decay >= 0 && *t.end_weight_decay >= *t.start_weight_decay))
    throw ConfigError(concat("--start-weight-decay=", *t.start_weight_decay,
                             " / --end-weight-decay=", *t.end_weight_decay,
                             " are out of range (allowed: 0 <= start <= end: Megatron's schedule "
                             "increases the decay)"));
}

// WSD's final decay lies inside the decay phase: after the warm-up, before the decay's end.
void check_wsd_length(const TrainConfig& t, const TrainConfig& given) {
  using detail::concat;
  if (t.lr_decay_style != "WSD") return;
  const int64_t decay = t.lr_decay_iters > 0 ? t.lr_decay_iters : t.train_iters;
  if (decay <= 0) return;  // nothing trains (--skip-train, --dry-run)
  const char* unit = t.lr_schedule_in_samples ? " samples" : " iterations";
  if (t.lr_wsd_decay_iters > decay - t.lr_warmup_iters)
    throw ConfigError(concat(
        given.lr_wsd_decay_samples > 0 ? "--lr-wsd-decay-samples=" : "--lr-wsd-decay-iters=",
        given.lr_wsd_decay_samples > 0 ? given.lr_wsd_decay_samples : given.lr_wsd_decay_iters,
        " (", t.lr_wsd_decay_iters, unit, ") is longer than the decay phase after the warm-up: ",
        decay, " (--lr-decay-iters/-samples, or the run) - ", t.lr_warmup_iters,
        " warm-up = ", decay - t.lr_warmup_iters, unit));
}

}  // namespace

int TrainConfig::global_batch_at(int dp_size, int64_t consumed) const {
  const int G = global_batch(dp_size);
  if (rampup_batch_size.size() != 3) return G;
  const int64_t start = rampup_batch_size[0], incr = rampup_batch_size[1],
                samples = rampup_batch_size[2];
  if (consumed > samples || start >= G || incr <= 0) return G;
  const int64_t increments = (G - start) / incr;
  const double per_increment = static_cast<double>(samples) / static_cast<double>(increments);
  const int64_t steps = static_cast<int64_t>(static_cast<double>(consumed) / per_increment);
  return static_cast<int>(std::min<int64_t>(G, start + steps * incr));
}

int64_t TrainConfig::samples_before_iteration(int dp_size, int64_t iteration) const {
  const int64_t G = global_batch(dp_size);
  int64_t consumed = 0, it = 1;
  // The ramp's steps one by one; then whole global batches.
  while (it < iteration && global_batch_at(dp_size, consumed) != G) {
    consumed += global_batch_at(dp_size, consumed);
    ++it;
  }
  return consumed + (iteration - it) * G;
}

std::vector<int> TrainConfig::global_batches(int dp_size) const {
  const int G = global_batch(dp_size);
  std::vector<int> sizes;
  if (rampup_batch_size.size() == 3 && rampup_batch_size[1] > 0)
    for (int64_t b = rampup_batch_size[0]; b < G; b += rampup_batch_size[1])
      sizes.push_back(static_cast<int>(b));
  sizes.push_back(G);
  return sizes;
}

void TrainConfig::validate(int dp_size) const {
  using detail::concat;
  if (timing_log_level < 0 || timing_log_level > 2)
    throw ConfigError(
        concat("--timing-log-level=", timing_log_level, " is out of range (allowed: 0, 1, 2)"));
  if (tensorboard_log_interval < 1)
    throw ConfigError(concat("--tensorboard-log-interval=", tensorboard_log_interval,
                             " is out of range (allowed: >= 1)"));
  if (timing_log_option != "minmax" && timing_log_option != "max" && timing_log_option != "all")
    throw ConfigError("--timing-log-option '" + timing_log_option +
                      "' is not an option (allowed: minmax, max, all)");
  if (micro_batch_size <= 0)
    throw ConfigError(
        concat("--micro-batch-size=", micro_batch_size, " is out of range (allowed: >= 1)"));
  if (global_batch_size < 0)
    throw ConfigError(concat("--global-batch-size=", global_batch_size,
                             " is out of range (allowed: >= 1, or 0 for micro-batch * DP)"));
  if (global_batch(dp_size) % (micro_batch_size * dp_size) != 0)
    throw ConfigError(concat("--global-batch-size=", global_batch(dp_size),
                             " must be a multiple of --micro-batch-size=", micro_batch_size,
                             " times the data-parallel size ", dp_size, " (allowed: multiples of ",
                             micro_batch_size * dp_size, ")"));
  if (train_iters < 0)
    throw ConfigError(concat("--train-iters=", train_iters, " is out of range (allowed: >= 0)"));
  if (train_samples < 0)
    throw ConfigError(
        concat("--train-samples=", train_samples, " is out of range (allowed: >= 1)"));
  // Infinities are refused as NaNs are: a rate or decay of inf trains nothing but NaNs, an
  // epsilon of inf nothing at all (--clip-grad inf is allowed: no clipping, as 0 says).
  for (const auto& [name, v] : {std::pair<const char*, double>{"--lr", lr},
                                {"--min-lr", min_lr},
                                {"--lr-warmup-init", lr_warmup_init},
                                {"--weight-decay", weight_decay},
                                {"--adam-eps", adam_eps},
                                {"--start-weight-decay", start_weight_decay.value_or(0)},
                                {"--end-weight-decay", end_weight_decay.value_or(0)}})
    if (std::isinf(v))
      throw ConfigError(concat(name, "=", v, " is not a finite number; give a finite value"));
  if (!(lr >= 0)) throw ConfigError(concat("--lr=", lr, " is out of range (allowed: >= 0)"));
  if (!(min_lr >= 0 && min_lr <= lr))
    throw ConfigError(
        concat("--min-lr=", min_lr, " is out of range (allowed: 0 <= min-lr <= --lr=", lr, ")"));
  validate_schedule(*this);
  // Counted in iterations already (else resolved() checks it once they are).
  if (!lr_schedule_in_samples && train_samples == 0 && lr_decay_samples == 0 &&
      lr_warmup_samples == 0 && lr_wsd_decay_samples == 0 && lr_warmup_fraction == 0)
    check_wsd_length(*this, *this);
  if (lr_warmup_iters < 0)
    throw ConfigError(
        concat("--lr-warmup-iters=", lr_warmup_iters, " is out of range (allowed: >= 0)"));
  if (lr_decay_iters < 0)
    throw ConfigError(
        concat("--lr-decay-iters=", lr_decay_iters, " is out of range (allowed: >= 0)"));
  // Megatron's scheduler asserts warm-up < decay; a warm-up past the run's end (the decay from
  // the run's length) is a start-up warning instead (warmup_past_the_run, app/tessera-train).
  if (!lr_schedule_in_samples && lr_decay_iters > 0 && lr_warmup_iters >= lr_decay_iters)
    throw ConfigError(concat("--lr-warmup-iters=", lr_warmup_iters,
                             " is not shorter than --lr-decay-iters=", lr_decay_iters,
                             ": the warm-up must end before the decay does (lower the warm-up or "
                             "lengthen the decay)"));
  if (lr_decay_samples > 0 && lr_warmup_samples >= lr_decay_samples)
    throw ConfigError(concat("--lr-warmup-samples=", lr_warmup_samples,
                             " is not shorter than --lr-decay-samples=", lr_decay_samples,
                             ": the warm-up must end before the decay does (lower the warm-up or "
                             "lengthen the decay)"));
  if (!(weight_decay >= 0))
    throw ConfigError(concat("--weight-decay=", weight_decay, " is out of range (allowed: >= 0)"));
  validate_weight_decay_schedule(*this);
  if (!(clip_grad >= 0))
    throw ConfigError(
        concat("--clip-grad=", clip_grad, " is out of range (allowed: >= 0, 0 = off)"));
  if (!(adam_beta1 >= 0 && adam_beta1 < 1))
    throw ConfigError(concat("--adam-beta1=", adam_beta1, " is out of range (allowed: [0, 1))"));
  if (!(adam_beta2 >= 0 && adam_beta2 < 1))
    throw ConfigError(concat("--adam-beta2=", adam_beta2, " is out of range (allowed: [0, 1))"));
  if (!(adam_eps > 0))
    throw ConfigError(concat("--adam-eps=", adam_eps, " is out of range (allowed: > 0)"));
  if (log_interval <= 0)
    throw ConfigError(concat("--log-interval=", log_interval, " is out of range (allowed: >= 1)"));
  if (ddp_bucket_size <= 0)
    throw ConfigError(
        concat("--ddp-bucket-size=", ddp_bucket_size, " is out of range (allowed: >= 1)"));
  if (eval_interval < 0)
    throw ConfigError(
        concat("--eval-interval=", eval_interval, " is out of range (allowed: >= 0)"));
  if (eval_iters < 0)
    throw ConfigError(concat("--eval-iters=", eval_iters, " is out of range (allowed: >= 0)"));
  if (eval_interval > 0 && eval_iters < 1)
    throw ConfigError(concat("--eval-iters=", eval_iters,
                             " evaluates nothing; with --eval-interval=", eval_interval,
                             " it must be >= 1"));
  if (save_interval < 0)
    throw ConfigError(
        concat("--save-interval=", save_interval, " is out of range (allowed: >= 0)"));
  if (exit_interval < 0)
    throw ConfigError(
        concat("--exit-interval=", exit_interval, " is out of range (allowed: >= 0)"));
  if (!(exit_duration_mins >= 0))
    throw ConfigError(
        concat("--exit-duration-in-mins=", exit_duration_mins, " is out of range (allowed: >= 0)"));
  if (keep_checkpoints < 0)
    throw ConfigError(
        concat("--keep-checkpoints=", keep_checkpoints, " is out of range (allowed: >= 0)"));
  if (compute_dtype == DType::F16 &&
      !(loss_scale >= 0 && initial_loss_scale > 0 && min_loss_scale > 0 &&
        min_loss_scale <= initial_loss_scale && loss_scale_window >= 1 && hysteresis >= 1))
    throw ConfigError(concat("--fp16 loss scaling: --loss-scale=", loss_scale,
                             " (>= 0, 0 = dynamic), --initial-loss-scale=", initial_loss_scale,
                             " and --min-loss-scale=", min_loss_scale,
                             " (> 0, min <= initial), --loss-scale-window=", loss_scale_window,
                             " and --hysteresis=", hysteresis, " (>= 1) are out of range"));
  if (profile && !(profile_step_start >= 0 && profile_step_end > profile_step_start))
    throw ConfigError(concat("--profile-step-start=", profile_step_start, " / --profile-step-end=",
                             profile_step_end, " capture nothing (allowed: 0 <= start < end)"));
  if (overlap_param_gather && !use_distributed_optimizer)
    throw ConfigError(
        "--overlap-param-gather needs --use-distributed-optimizer (without it there is no "
        "parameter gather to overlap)");
  if (overlap_param_gather && !overlap_grad_reduce)  // Megatron-LM's assertion
    throw ConfigError(
        "--overlap-param-gather needs --overlap-grad-reduce (on by default; as Megatron-LM, the "
        "gather overlaps only with the reduction overlapped): drop --overlap-grad-reduce false "
        "or --overlap-param-gather");
  if (!(peak_tflops >= 0))
    throw ConfigError(concat("--peak-tflops=", peak_tflops, " is out of range (allowed: >= 0)"));
  if (!lr_schedule_in_samples) validate_rampup(*this, dp_size);  // resolved() checked it
}

std::string describe_dp_sharding(const TrainConfig& t, int dp, int cp) {
  const int n = t.dist_opt_instances;
  // HSDP: sharded inside each of n instances, replicated (or the optimizer state cut) across.
  const std::string over =
      n > 1 ? detail::concat(" over the ", cp > 1 ? "DP x CP " : "DP ", dp * cp, " ranks' ", n,
                             " instances of ", dp * cp / n, ", ",
                             t.outer_dp_shards_optim ? "the optimizer state cut again across "
                                                       "the instances"
                                                     : "replicated across the instances")
            : " over DP " + std::to_string(dp);
  if (t.megatron_fsdp) {
    using S = TrainConfig::DpSharding;
    switch (t.dp_sharding) {
      case S::NoShard:
        return "Megatron-FSDP no_shard (replicated, one bucket per layer)";
      case S::Optim:
        return "Megatron-FSDP optim (the optimizer state" + over + ")";
      case S::OptimGrads:
        return "Megatron-FSDP optim_grads (the optimizer state and gradients" + over + ")";
      case S::OptimGradsParams:
        return "Megatron-FSDP optim_grads_params (the optimizer state, gradients and "
               "parameters" +
               over + ")";
    }
  }
  if (!t.use_distributed_optimizer) return "replicated";
  return "distributed" + over + (t.overlap_param_gather ? " (parameter gather overlapped)" : "");
}

std::string warmup_past_the_run(const TrainConfig& t) {
  if (t.train_iters <= 0 || t.lr_warmup_iters <= 0) return std::string();
  const char* unit = t.lr_schedule_in_samples ? " samples" : " iterations";
  const int64_t run = t.lr_schedule_in_samples ? t.weight_decay_incr_iters : t.train_iters;
  if (t.lr_warmup_iters < run) return std::string();
  return detail::concat("the learning-rate warm-up (", t.lr_warmup_iters, unit,
                        ") lasts the whole run (", run, unit,
                        "): the learning rate never reaches "
                        "--lr=",
                        t.lr, "; shorten the warm-up or lengthen the run");
}

namespace {
// Iterations named by --iterations-to-skip and --error-injection-at lie within the run.
void check_within_run(const TrainConfig& t) {
  if (t.train_iters <= 0) return;
  for (int64_t it : t.iterations_to_skip)
    if (it > t.train_iters)
      throw ConfigError(detail::concat("--iterations-to-skip ", it, " is beyond the run (",
                                       t.train_iters, " iterations): it would never be skipped"));
  for (const auto& [it, rank] : t.error_injection_at)
    if (it > t.train_iters)
      throw ConfigError(detail::concat("--error-injection-at ", it, ":", rank,
                                       " is beyond the run (", t.train_iters,
                                       " iterations): nothing would be injected"));
}
}  // namespace

TrainConfig TrainConfig::resolved(int dp_size) const {
  using detail::concat;
  TrainConfig t = *this;
  const int64_t G = global_batch(dp_size);
  if (G <= 0) return t;  // validate() names the bad batch size
  if (!rampup_batch_size.empty()) {
    if (micro_batch_size <= 0) return t;  // validate() names it
    validate_rampup(*this, dp_size);
    if (train_iters > 0)
      throw ConfigError("--train-samples and --train-iters both given; choose one");
    // Megatron's iteration count: ramp steps while the ramp lasts (and the run), then whole
    // global batches of what is left.
    int64_t iters = 0, consumed = 0;
    const int64_t ramp = rampup_batch_size[2];
    while (consumed <= ramp && consumed <= train_samples) {
      consumed += global_batch_at(dp_size, consumed);
      ++iters;
    }
    if (train_samples > consumed) iters += (train_samples - consumed) / G;
    t.train_iters = iters;
    t.lr_schedule_in_samples = true;
    if (lr_decay_samples < 0 || lr_warmup_samples < 0)
      throw ConfigError(concat("--lr-decay-samples=", lr_decay_samples, " / --lr-warmup-samples=",
                               lr_warmup_samples, " are out of range (allowed: >= 0)"));
    t.lr_decay_iters = lr_decay_samples > 0 ? lr_decay_samples : train_samples;
    t.lr_warmup_iters = lr_warmup_samples;
    if (lr_decay_samples > 0 && lr_warmup_samples >= lr_decay_samples)
      throw ConfigError(concat("--lr-warmup-samples=", lr_warmup_samples,
                               " is not shorter than --lr-decay-samples=", lr_decay_samples,
                               ": the warm-up must end before the decay does (lower the warm-up "
                               "or lengthen the decay)"));
    if (lr_warmup_fraction != 0) {
      if (!(lr_warmup_fraction > 0 && lr_warmup_fraction <= 1))
        throw ConfigError(concat("--lr-warmup-fraction=", lr_warmup_fraction,
                                 " is out of range (allowed: 0 < f <= 1)"));
      if (lr_warmup_samples > 0)
        throw ConfigError("--lr-warmup-fraction and --lr-warmup-samples both given; choose one");
      t.lr_warmup_iters =
          static_cast<int64_t>(lr_warmup_fraction * static_cast<double>(t.lr_decay_iters));
    }
    if (lr_wsd_decay_samples < 0)
      throw ConfigError(concat("--lr-wsd-decay-samples=", lr_wsd_decay_samples,
                               " is out of range (allowed: >= 1)"));
    t.lr_wsd_decay_iters = lr_wsd_decay_samples;
    t.weight_decay_incr_iters = train_samples;  // Megatron's wd_incr_steps: the run, in samples
    t.train_samples = t.lr_decay_samples = t.lr_warmup_samples = t.lr_wsd_decay_samples = 0;
    t.lr_warmup_fraction = 0;
    check_wsd_length(t, *this);
    check_within_run(t);
    return t;
  }
  auto iters = [&](int64_t samples, const char* option, const char* iter_option, int64_t given) {
    if (samples < 0)
      throw ConfigError(concat(option, "=", samples, " is out of range (allowed: >= 1)"));
    if (samples > 0 && given > 0)
      throw ConfigError(concat(option, " and ", iter_option, " both given; choose one"));
    return samples > 0 ? samples / G : given;
  };
  t.train_iters = iters(train_samples, "--train-samples", "--train-iters", train_iters);
  if (train_samples > 0 && t.train_iters == 0)
    throw ConfigError(concat("--train-samples=", train_samples, " is less than one global batch (",
                             G, " samples)"));
  t.lr_decay_iters =
      iters(lr_decay_samples, "--lr-decay-samples", "--lr-decay-iters", lr_decay_iters);
  t.lr_warmup_iters =
      iters(lr_warmup_samples, "--lr-warmup-samples", "--lr-warmup-iters", lr_warmup_iters);
  if (lr_warmup_fraction != 0) {
    if (!(lr_warmup_fraction > 0 && lr_warmup_fraction <= 1))
      throw ConfigError(concat("--lr-warmup-fraction=", lr_warmup_fraction,
                               " is out of range (allowed: 0 < f <= 1)"));
    if (t.lr_warmup_iters > 0)
      throw ConfigError(
          "--lr-warmup-fraction and --lr-warmup-iters (or --lr-warmup-samples) "
          "both given; choose one");
    const int64_t decay = t.lr_decay_iters > 0 ? t.lr_decay_iters : t.train_iters;
    t.lr_warmup_iters = static_cast<int64_t>(lr_warmup_fraction * static_cast<double>(decay));
  }
  if (t.lr_decay_iters > 0 && t.lr_warmup_iters >= t.lr_decay_iters &&
      (lr_decay_samples > 0 || lr_warmup_samples > 0 || lr_warmup_fraction != 0)) {
    // Counted in samples (or a fraction): named as given, with the iterations they come to.
    const std::string warm =
        lr_warmup_samples > 0     ? concat("--lr-warmup-samples=", lr_warmup_samples)
        : lr_warmup_fraction != 0 ? concat("--lr-warmup-fraction=", lr_warmup_fraction)
                                  : concat("--lr-warmup-iters=", lr_warmup_iters);
    const std::string decay = lr_decay_samples > 0 ? concat("--lr-decay-samples=", lr_decay_samples)
                                                   : concat("--lr-decay-iters=", lr_decay_iters);
    throw ConfigError(concat(warm, " (", t.lr_warmup_iters, " iterations) is not shorter than ",
                             decay, " (", t.lr_decay_iters,
                             " iterations): the warm-up must end before the decay does (lower "
                             "the warm-up or lengthen the decay)"));
  }
  t.lr_wsd_decay_iters = iters(lr_wsd_decay_samples, "--lr-wsd-decay-samples",
                               "--lr-wsd-decay-iters", lr_wsd_decay_iters);
  if (lr_wsd_decay_samples > 0 && t.lr_wsd_decay_iters == 0)
    throw ConfigError(concat("--lr-wsd-decay-samples=", lr_wsd_decay_samples,
                             " is less than one global batch (", G, " samples)"));
  t.weight_decay_incr_iters = t.train_iters;  // Megatron's wd_incr_steps: the whole run
  t.train_samples = t.lr_decay_samples = t.lr_warmup_samples = t.lr_wsd_decay_samples = 0;
  t.lr_warmup_fraction = 0;
  check_wsd_length(t, *this);
  check_within_run(t);
  return t;
}

}  // namespace tessera
