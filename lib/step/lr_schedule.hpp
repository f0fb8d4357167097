// lr_schedule.hpp: the learning rate and the weight decay of each step, as Megatron-LM's
// OptimizerParamScheduler computes them (get_lr, get_wd). Both are pure functions of the step
// count, so a run resumed from a checkpoint continues them exactly. docs/training.md writes the
// formulas out.
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

struct TrainConfig;

// What the learning-rate schedule needs. Steps are iterations, or samples under a batch-size ramp
// (TrainConfig::lr_schedule_in_samples).
struct LrScheduleSpec {
  double max_lr = 0, min_lr = 0;
  double init_lr = 0;                     // where the warm-up starts (--lr-warmup-init)
  int64_t warmup = 0;                     // warm-up steps: the lr reaches max_lr at step `warmup`
  int64_t decay = 0;                      // the decay ends (at min_lr) at step `decay`
  std::string style = "linear";           // constant | linear | cosine | inverse-square-root | WSD
  int64_t wsd_decay = 0;                  // WSD: the last wsd_decay steps of the decay anneal
  std::string wsd_style = "exponential";  // exponential | linear | cosine | minus_sqrt
  // Samples per step when steps are iterations (the global batch), 1 when they are samples.
  // Megatron counts samples; only inverse-square-root without warm-up sees the difference
  // (max_lr / sqrt(samples), not / sqrt(iterations)).
  int64_t samples_per_step = 1;
};

class LrSchedule {
 public:
  explicit LrSchedule(LrScheduleSpec spec);
  LrSchedule(double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
             std::string style);
  // The schedule of a resolved TrainConfig (TrainConfig::resolved) at data-parallel size dp.
  static LrSchedule of(const TrainConfig& resolved, int dp_size);
  // Learning rate used at step `step` (1-based: the first update is step 1; Megatron's num_steps
  // after that update, the value its log line shows): warm-up reaches max_lr at step == warmup;
  // the decay runs from warmup to decay, then the rate stays at min_lr.
  double lr(int64_t step) const;
  const LrScheduleSpec& spec() const { return s_; }

 private:
  LrScheduleSpec s_;
};

// Megatron's weight-decay increment: from start to end over `incr_steps` steps (the whole run),
// constant (start == end == --weight-decay), linear or cosine.
class WeightDecaySchedule {
 public:
  WeightDecaySchedule(double start, double end, int64_t incr_steps, std::string style);
  static WeightDecaySchedule of(const TrainConfig& resolved);
  // Weight decay used at step `step` (the same count as LrSchedule::lr).
  double wd(int64_t step) const;
  // Whether the decay changes during the run (then the log shows it).
  bool scheduled() const { return style_ != "constant"; }

 private:
  double start_, end_;
  int64_t incr_;
  std::string style_;
};

// The schedule's options that differ between a checkpoint's run and this one, from their INI
// texts (TrainConfig::config_text): "lr 0.003 -> 0.0006, lr-decay-style cosine -> WSD"; empty when
// none. Options absent from either text are left out; the run's length (train-iters,
// train-samples) only where `length_matters` (it sets the decay's end or the weight-decay
// increment). Megatron refuses such a resume unless told which to use; Tessera takes this run's.
std::string schedule_changes(const std::string& saved_ini, const std::string& now_ini,
                             bool length_matters);

}  // namespace tessera
