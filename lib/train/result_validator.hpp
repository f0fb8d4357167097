// result_validator.hpp: result validation and reruns, Megatron-LM's rerun state machine as a
// component of the trainer (docs/training.md, "Result validation and reruns", has the state
// diagram). Each rank checks its own results before they are reduced: the loss of its micro-batches
// (not finite: fatal; --check-for-spiky-loss: more than 10x the largest of the last 100, not
// fatal) and the L2 norm of each gradient bucket before its data-parallel reduction (not finite:
// fatal; --check-for-large-grads: 10x, not fatal). The findings travel in the step's loss
// all-reduce, so a step where nothing is rejected costs one kernel over the gradients and nothing
// else. Decisions are taken by all ranks together:
//   rejected                     -> the iteration reruns in place (data, RNG streams, gradients,
//                                   MoE statistics, FP8 amaxes and the loss scaler as before it)
//   fatal, rerun differs         -> transient error: exit 17, the host named
//   fatal, rerun reproduces      -> checkpoint (the state before the iteration, this rerun state)
//                                   and exit 16; the next launch reruns it on other hardware
//   ... on the same hardware     -> exit 16 again, saying so (nothing is run or saved)
//   ... other hardware differs   -> persistent error of the first host: exit 17, that host named
//   ... other hardware agrees    -> correct result (the NaN is real): exit 17
//   not fatal                    -> training goes on with the rerun's result
// Every event is a line of the tracker file (train/rerun_tracker.hpp); an iteration reproduced
// twice on a rank is skipped by the next launch, and a launch that would only repeat a known
// failure stops at once with exit 17.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "run/train_config.hpp"
#include "step/step_stats.hpp"
#include "train/rerun_tracker.hpp"

namespace tessera {

// Megatron's exit codes.
constexpr int kExitResumeToDisambiguate = 16;
constexpr int kExitFailedOnResultValidation = 17;

// Thrown on every rank together when result validation ends the run (after the checkpoint exit 16
// needs); tessera-train exits with code() and the message as its last line.
class RerunExit : public Error {
 public:
  RerunExit(int code, const std::string& what) : Error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// --check-for-spiky-loss / --check-for-large-grads: a value more than `factor` times the largest
// of the last `window` accepted values (none before the first accepted one).
class SpikeDetector {
 public:
  explicit SpikeDetector(double factor = 10, size_t window = 100)
      : factor_(factor), window_(window) {}
  bool spiky(double v) const;
  void accept(double v);  // a finite value the step kept

 private:
  double factor_;
  size_t window_;
  std::deque<double> recent_;
};

// Megatron's comparison: 0 when equal (or both NaN), infinite when one is not finite and the other
// is, else |2 (a - b) / (a + b)|.
double compare_results(double a, double b);

class ResultValidator {
 public:
  enum class Mode { Disabled, ValidateResults, ReportStats };
  // The step's findings that ride on the loss all-reduce (summed over the world).
  static constexpr int kFlags = 2;

  // Collective (the tracker file's pre-flight). The hardware identity is this rank's host name (as
  // Megatron's os.uname()[1]) and the backend's device.
  ResultValidator(const TrainConfig& cfg, const ParallelContext& ctx, Backend& be);

  Mode mode() const { return mode_; }
  const RerunTracker& tracker() const { return tracker_; }
  // Whether the gradient reducer calls check_bucket (a kernel a bucket, read once a step).
  bool checks_gradients() const;

  // Collective, before the first iteration of a launch. `rerun_state`: what the loaded checkpoint
  // holds (empty: nothing pending). Reads the tracker file: the iterations it skips, the
  // injections already made, a diagnosis already made. Throws RerunExit(17) when this launch would
  // only repeat a known failure, and RerunExit(16) when it is on the hardware a pending rerun must
  // avoid.
  void start(const std::string& rerun_state, int64_t next_iteration);
  // --iterations-to-skip and the tracker's skips (1-indexed).
  bool skip(int64_t iteration) const { return skip_.count(iteration) > 0; }
  // Such an iteration: its samples are consumed, nothing is updated (the learning-rate schedule
  // does not advance); `state` moves past it.
  // An iteration whose global batch has no token that counts toward the loss (the StepStats
  // loaded): not run, said in a warning, its samples consumed (docs/data.md).
  StepStats skip_without_loss(TrainState& state, StepStats st) const;
  StepStats skip_step(TrainState& state) const;

  // Before each run of the iteration's forward and backward (attempt 0 is the first).
  void begin_attempt(int64_t iteration, int attempt);
  // The gradient reducer's hook: a bucket of this rank's gradients before its reduction.
  void check_bucket(const Tensor& grads);
  // After the attempt's reductions: this rank's checks. `local_loss`: the mean loss of this rank's
  // micro-batches (has_loss: on the ranks that compute the loss). Returns the values to add to
  // the step's loss all-reduce (flags[kFlags]).
  void check(double local_loss, bool has_loss, double flags[kFlags]);
  // Collective, after that all-reduce: true when the iteration must run again (in place). Throws
  // RerunExit(17) when the run ends; returns false with exit16() set when it must checkpoint
  // and exit 16 (the trainer saves, then calls exit16()).
  bool rerun(const double reduced_flags[kFlags]);
  // After the step's update: report_stats's figures every log interval.
  void end_step(int64_t iteration);

  // Exit 16 is due: the rerun state to save with the checkpoint, then the exit.
  bool exit16_due() const { return !pending_state_.empty(); }
  const std::string& pending_state() const { return pending_state_; }
  [[noreturn]] void exit16(const std::string& checkpoint);

 private:
  struct Failure {  // one rank's rejected result of the iteration
    int rank = 0;
    std::string host;
    int device = -1;
    double result = 0;
    bool fatal = true, grads = false;
    std::string injected;
    int code = 0;  // gather_failures: the rank's outcome code
  };
  enum class State { Initial, InPlace, FromCheckpoint };
  bool nan_check_grads() const;
  void write(RerunStatus s, double result, const std::string& injected, const std::string& message);
  bool decide_in_place();
  bool decide_from_checkpoint();
  std::vector<Failure> gather_failures(int code);
  std::string encode_state(const std::vector<Failure>& f) const;
  bool decode_state(const std::string& text, int64_t& iteration, std::vector<Failure>& f) const;
  bool injects_now() const;

  const TrainConfig& cfg_;
  const ParallelContext& ctx_;
  Backend& be_;
  Mode mode_ = Mode::ValidateResults;
  std::string host_, job_;
  int device_ = -1;
  RerunTracker tracker_;
  std::set<int64_t> skip_;
  std::set<std::pair<int64_t, int>> injected_before_;  // (iteration, rank) in this lineage
  SpikeDetector loss_spikes_, grad_spikes_;

  State state_ = State::Initial;
  int64_t iteration_ = 0;
  int attempt_ = 0;
  double grad_norm2_ = 0;
  bool bucket_seen_ = false;
  // This rank's results of the attempt, and of the first attempt.
  double loss_ = 0, grad_norm_ = 0, first_loss_ = 0, first_grad_norm_ = 0;
  bool has_loss_ = false;
  std::string injecting_;  // the injection of this attempt (empty: none)
  // This rank's rejection of the first attempt (validate_results).
  bool rejected_ = false, rejected_fatal_ = false, rejected_grads_ = false;
  double rejected_result_ = 0;
  std::string rejected_injected_;
  // A rerun from a checkpoint (the failures of the first run, on their hosts).
  int64_t from_checkpoint_iteration_ = -1;
  std::vector<Failure> from_checkpoint_;
  std::string pending_state_, pending_message_;
  // report_stats over the current log interval.
  int64_t stats_first_ = 0, stats_compared_ = 0, stats_identical_ = 0;
  double stats_max_ = 0;
};

}  // namespace tessera
