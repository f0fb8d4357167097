// metrics.hpp: the training metrics and the three places they go: the iteration log line,
// the JSONL metrics file (rank 0) and TensorBoard (the last rank, Megatron's tags). The line's
// fixed part is Megatron's; every other figure is declared once as a Figure by the metric source
// that computes it (train/metrics/sources.cpp lists them, in the order they appear), so a new
// figure is one new source and one line in that list.
#pragma once

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/tensorboard.hpp"
#include "data/dataset.hpp"
#include "model/gpt.hpp"
#include "run/train_config.hpp"
#include "step/optimizer_set.hpp"
#include "step/step_stats.hpp"
#include "step/timers.hpp"

namespace tessera {

// One figure, declared once: where it is written and how.
struct Figure {
  const char* log = nullptr;  // label in the iteration line (" | <log>: <value>"); null: not there
  const char* log_format = "%.6E";
  const char* json = nullptr;  // key in the metrics file; null: not there
  const char* json_format = "%.17g";
  const char* tensorboard = nullptr;  // tag; null: not written
  // TensorBoard takes each step's value every --tensorboard-log-interval (Megatron's per-step
  // scalars); otherwise the log line's value at each --log-interval.
  bool tensorboard_every_step = false;
};

// Where a metric source writes its figures: at a step (TensorBoard's every-step scalars) or at a
// log line (the line, the metrics file and TensorBoard's log-time scalars).
class FigureSink {
 public:
  // At a step: TensorBoard only (null: not due), at `step`.
  FigureSink(TensorBoardWriter* tb, int64_t step) : tb_(tb), step_(step) {}
  // At a log line.
  FigureSink(std::string* line, std::string* json, TensorBoardWriter* tb, int64_t step)
      : line_(line), json_(json), tb_(tb), step_(step), at_log_(true) {}
  void add(const Figure& f, double value);

 private:
  std::string* line_ = nullptr;
  std::string* json_ = nullptr;
  TensorBoardWriter* tb_ = nullptr;
  int64_t step_ = 0;
  bool at_log_ = false;
};

// What a log line's figures may use besides their own state.
struct LogInterval {
  const StepStats& last;       // the interval's last step
  double gflops_per_rank = 0;  // model FLOPs per second per rank over the interval, / 1e9
};

// A source of figures beyond the fixed line. Every rank calls every method at the same points
// (they may be collective).
class MetricSource {
 public:
  virtual ~MetricSource() = default;
  // Before every training step's first forward.
  virtual void begin_step() {}
  // Inside every training step, once its loss is known: statistics the grid sums (MoE's).
  virtual void collect(const StepStats&) {}
  // After every step: its every-step TensorBoard figures.
  virtual void step(const StepStats&, FigureSink&) {}
  // At each log line (the interval's figures; collective ones allowed).
  virtual void report(const LogInterval&, FigureSink&) = 0;
  // Lines of their own to log after the iteration line (report's; empty: none).
  virtual std::vector<std::string> lines_after() { return {}; }
};

// What the sources are built from.
struct MetricContext {
  GPTModel& model;
  const TrainConfig& cfg;
  const ParallelContext& ctx;
  OptimizerSet& optimizers;
};
// The sources of a run, in the order their figures appear (train/metrics/sources.cpp).
std::vector<std::unique_ptr<MetricSource>> make_metric_sources(const MetricContext& c);

// " validation loss at <where> | lm loss value: ... | lm loss PPL: ..." (one format everywhere).
std::string validation_loss_text(const std::string& where, double loss);
// The mean loss per counted token of an evaluation over samples [begin, end) of `data`; NaN with
// a warning when no token counted (record_validation then records nothing, validation_loss_text
// says "none").
double evaluation_loss(double loss_sum, double tokens, const TokenDataset& data, int64_t begin,
                       int64_t end);

class TrainingMetrics {
 public:
  // Collective: rank 0 opens --metrics-file and the last rank --tensorboard-dir; a failure is
  // every rank's ConfigError.
  TrainingMetrics(const MetricContext& c, IterationTimers& timers);
  ~TrainingMetrics();

  // Before every training step's passes, and inside it once the loss is known (collective):
  // MetricSource::begin_step and collect.
  void begin_step();
  void collect(const StepStats& s);
  // Collective, after every step: TensorBoard's scalars when due, and the log line (with the
  // timers) every --log-interval and at the last iteration.
  void record(const StepStats& s, int64_t consumed_samples);
  // The evaluation after iteration `iteration`: its line, metrics-file line and scalars.
  void record_validation(int64_t iteration, double loss, int64_t consumed_samples);
  // A train() call starts: the interval's loss and time start afresh.
  void begin_run();
  // Collective: every rank's memory against the --dry-run estimate, printed by rank 0.
  void memory_report(Backend& be, int64_t iteration);
  // After step `s`: the report when it is the run's first step that ran (a skipped one holds no
  // activations), then every --memory-report-interval iterations. Collective.
  void memory_report_after(Backend& be, const StepStats& s);
  void flush();

 private:
  // The last iteration was not run: its count (and the earlier ones' since the last line) said,
  // a line and a metrics record without a loss.
  void log_skipped(const StepStats& s, int64_t consumed_samples);
  void log_line(const StepStats& s, int64_t consumed_samples);

  MetricContext c_;
  IterationTimers& timers_;
  std::vector<std::unique_ptr<MetricSource>> sources_;
  std::ofstream metrics_;
  std::unique_ptr<TensorBoardWriter> tb_;  // on the last rank with --tensorboard-dir
  // The steps since the last log line.
  double interval_loss_ = 0, interval_loss_all_ = 0, interval_seconds_ = 0;
  int in_interval_ = 0, in_interval_updated_ = 0;
  int64_t interval_samples_ = 0;
  // Iterations not run since the last line (StepStats::not_run) and their samples.
  int64_t skipped_iterations_ = 0, skipped_samples_ = 0;
  bool memory_reported_ = false;
};

}  // namespace tessera
