// lr_schedule.cpp: the learning-rate and weight-decay schedules (Megatron's get_lr and get_wd).
#include "step/lr_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.hpp"
#include "core/ini.hpp"
#include "run/train_config.hpp"

namespace tessera {

LrSchedule::LrSchedule(LrScheduleSpec spec) : s_(std::move(spec)) {
  const std::string& st = s_.style;
  if (st != "constant" && st != "linear" && st != "cosine" && st != "inverse-square-root" &&
      st != "WSD")
    throw ConfigError("--lr-decay-style=" + st +
                      " is not a style (allowed: constant, linear, cosine, inverse-square-root, "
                      "WSD)");
  const std::string& w = s_.wsd_style;
  if (st == "WSD" && w != "exponential" && w != "linear" && w != "cosine" && w != "minus_sqrt")
    throw ConfigError("--lr-wsd-decay-style=" + w +
                      " is not a style (allowed: exponential, linear, cosine, minus_sqrt)");
}

LrSchedule::LrSchedule(double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
                       std::string style)
    : LrSchedule([&] {
        LrScheduleSpec s;
        s.max_lr = max_lr;
        s.min_lr = min_lr;
        s.warmup = warmup_iters;
        s.decay = decay_iters;
        s.style = std::move(style);
        return s;
      }()) {}

LrSchedule LrSchedule::of(const TrainConfig& t, int dp_size) {
  LrScheduleSpec s;
  s.max_lr = t.lr;
  s.min_lr = t.min_lr;
  s.init_lr = t.lr_warmup_init;
  s.warmup = t.lr_warmup_iters;
  s.decay = t.lr_decay_iters > 0 ? t.lr_decay_iters : t.train_iters;
  s.style = t.lr_decay_style;
  s.wsd_decay = t.lr_wsd_decay_iters;
  if (!t.lr_wsd_decay_style.empty()) s.wsd_style = t.lr_wsd_decay_style;
  s.samples_per_step = t.lr_schedule_in_samples ? 1 : t.global_batch(dp_size);
  return LrSchedule(s);
}

double LrSchedule::lr(int64_t step) const {
  const double max_lr = s_.max_lr, min_lr = s_.min_lr;
  if (s_.warmup > 0 && step <= s_.warmup)
    return s_.init_lr + (max_lr - s_.init_lr) * static_cast<double>(step) / s_.warmup;
  if (s_.style == "constant") return max_lr;
  if (step > s_.decay) return min_lr;
  if (s_.style == "inverse-square-root") {
    // Megatron counts samples: max(warm-up samples, 1) and max(samples, 1).
    const double w = static_cast<double>(std::max<int64_t>(s_.warmup * s_.samples_per_step, 1));
    const double n = static_cast<double>(std::max<int64_t>(step * s_.samples_per_step, 1));
    return std::max(min_lr, max_lr * std::sqrt(w) / std::sqrt(n));
  }
  const double span = static_cast<double>(s_.decay - s_.warmup);
  const double ratio = span > 0 ? static_cast<double>(step - s_.warmup) / span : 1.0;
  double coeff = 0;
  if (s_.style == "linear") {
    coeff = 1.0 - ratio;
  } else if (s_.style == "cosine") {
    coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0);
  } else {  // WSD: max_lr until the last wsd_decay steps of the decay, then the annealing style
    const int64_t anneal_start = s_.decay - s_.wsd_decay;
    if (step <= anneal_start) {
      coeff = 1.0;
    } else {
      const double r = static_cast<double>(step - anneal_start) / static_cast<double>(s_.wsd_decay);
      if (s_.wsd_style == "linear")
        coeff = 1.0 - r;
      else if (s_.wsd_style == "cosine")
        coeff = 0.5 * (std::cos(M_PI * r) + 1.0);
      else if (s_.wsd_style == "exponential")
        coeff = 2.0 * std::pow(0.5, r) - 1.0;
      else  // minus_sqrt
        coeff = 1.0 - std::sqrt(r);
    }
  }
  return min_lr + coeff * (max_lr - min_lr);
}

WeightDecaySchedule::WeightDecaySchedule(double start, double end, int64_t incr_steps,
                                         std::string style)
    : start_(start), end_(end), incr_(incr_steps), style_(std::move(style)) {
  if (style_ != "constant" && style_ != "linear" && style_ != "cosine")
    throw ConfigError("--weight-decay-incr-style=" + style_ +
                      " is not a style (allowed: constant, linear, cosine)");
}

WeightDecaySchedule WeightDecaySchedule::of(const TrainConfig& t) {
  if (t.weight_decay_incr_style == "constant")
    return WeightDecaySchedule(t.weight_decay, t.weight_decay, t.weight_decay_incr_iters,
                               "constant");
  return WeightDecaySchedule(t.start_weight_decay.value_or(t.weight_decay),
                             t.end_weight_decay.value_or(t.weight_decay), t.weight_decay_incr_iters,
                             t.weight_decay_incr_style);
}

double WeightDecaySchedule::wd(int64_t step) const {
  if (step > incr_ || style_ == "constant" || incr_ <= 0) return end_;
  const double ratio = static_cast<double>(step) / static_cast<double>(incr_);
  const double coeff = style_ == "linear" ? ratio : 0.5 * (std::cos(M_PI * (1.0 - ratio)) + 1.0);
  return start_ + coeff * (end_ - start_);
}

std::string schedule_changes(const std::string& saved_ini, const std::string& now_ini,
                             bool length_matters) {
  static const char* const kKeys[] = {"lr",
                                      "min-lr",
                                      "lr-decay-style",
                                      "lr-warmup-iters",
                                      "lr-warmup-samples",
                                      "lr-warmup-fraction",
                                      "lr-warmup-init",
                                      "lr-decay-iters",
                                      "lr-decay-samples",
                                      "lr-wsd-decay-style",
                                      "lr-wsd-decay-iters",
                                      "lr-wsd-decay-samples",
                                      "weight-decay",
                                      "weight-decay-incr-style",
                                      "start-weight-decay",
                                      "end-weight-decay",
                                      "train-iters",
                                      "train-samples"};
  const auto before = ini_values(saved_ini), now = ini_values(now_ini);
  std::string out;
  for (const char* k : kKeys) {
    if (!length_matters && (std::string(k) == "train-iters" || std::string(k) == "train-samples"))
      continue;
    const auto a = before.find(k), b = now.find(k);
    if (a == before.end() || b == now.end() || a->second == b->second) continue;
    out += (out.empty() ? "" : ", ") + std::string(k) + " " + a->second + " -> " + b->second;
  }
  return out;
}

}  // namespace tessera
