// sources.cpp: the figures of the iteration line beyond Megatron's fixed part, and the
// one list of metric sources. A new figure: a MetricSource in a file of its own (as
// metrics/moe.cpp), its factory declared and listed below.
#include "train/metrics.hpp"

namespace tessera {

// Sources in files of their own: null where the run has nothing to report.
std::unique_ptr<MetricSource> make_moe_metrics(const MetricContext& c);
std::unique_ptr<MetricSource> make_moe_layer_metrics(const MetricContext& c);  // moe_layers.cpp
std::unique_ptr<MetricSource> make_mtp_metrics(const MetricContext& c);        // mtp.cpp
std::unique_ptr<MetricSource> make_straggler_metrics(const MetricContext& c);  // straggler.cpp

namespace {

// --peak-tflops (or the device's known peak): model FLOPs utilization, in percent in the line and
// as a fraction in the metrics file (two declarations: the values are computed apart).
class MfuMetric : public MetricSource {
 public:
  explicit MfuMetric(double peak_tflops) : peak_(peak_tflops) {}
  void report(const LogInterval& in, FigureSink& out) override {
    static const Figure kPercent{"MFU", "%.1f%%"};
    static const Figure kFraction{nullptr, nullptr, "mfu", "%.6f"};
    out.add(kPercent, 100.0 * in.gflops_per_rank / (peak_ * 1e3));
    out.add(kFraction, in.gflops_per_rank / (peak_ * 1e3));
  }

 private:
  double peak_;
};

// --fp16: the loss scale (the current one in the line, each step's in TensorBoard) and the
// updates skipped on overflow.
class LossScaleMetric : public MetricSource {
 public:
  explicit LossScaleMetric(const OptimizerSet& o) : o_(o) {}
  void step(const StepStats& s, FigureSink& out) override { out.add(kScale, s.loss_scale); }
  void report(const LogInterval&, FigureSink& out) override {
    static const Figure kSkipped{"number of skipped iterations", "%.0f"};
    out.add(kScale, o_.scaler().scale());
    out.add(kSkipped, static_cast<double>(o_.skipped_iterations()));
  }

 private:
  static constexpr Figure kScale{"loss scale",
                                 "%.1f",
                                 nullptr,
                                 "%.17g",
                                 "loss-scale",
                                 /*tensorboard_every_step=*/true};
  const OptimizerSet& o_;
};

// --log-params-norm: the L2 norm of the parameters (collective).
class ParamsNormMetric : public MetricSource {
 public:
  explicit ParamsNormMetric(OptimizerSet& o) : o_(o) {}
  void report(const LogInterval&, FigureSink& out) override {
    static const Figure kNorm{"params norm", "%.3f", "params_norm", "%.17g", "params-norm"};
    out.add(kNorm, o_.params_norm());
  }

 private:
  OptimizerSet& o_;
};

// --log-num-zeros-in-grad: zeros in the last step's gradient (counted by the optimizer step).
class NumZerosMetric : public MetricSource {
 public:
  void report(const LogInterval& in, FigureSink& out) override {
    static const Figure kZeros{"num zeros", "%.0f", "num_zeros_in_grad", "%.0f", "num-zeros"};
    out.add(kZeros, in.last.num_zeros);
  }
};

// --weight-decay-incr-style linear|cosine: the step's weight decay.
class WeightDecayMetric : public MetricSource {
 public:
  void step(const StepStats& s, FigureSink& out) override { out.add(kDecay, s.weight_decay); }
  void report(const LogInterval& in, FigureSink& out) override {
    out.add(kDecay, in.last.weight_decay);
  }

 private:
  static constexpr Figure kDecay{"weight decay", "%.6E",         "weight_decay",
                                 "%.17g",        "weight-decay", /*tensorboard_every_step=*/true};
};

}  // namespace

std::vector<std::unique_ptr<MetricSource>> make_metric_sources(const MetricContext& c) {
  const TrainConfig& t = c.cfg;
  std::vector<std::unique_ptr<MetricSource>> all;  // in the order of the line
  if (t.peak_tflops > 0) all.push_back(std::make_unique<MfuMetric>(t.peak_tflops));
  if (t.compute_dtype == DType::F16) all.push_back(std::make_unique<LossScaleMetric>(c.optimizers));
  if (t.log_params_norm) all.push_back(std::make_unique<ParamsNormMetric>(c.optimizers));
  if (t.log_num_zeros_in_grad) all.push_back(std::make_unique<NumZerosMetric>());
  if (c.optimizers.weight_decay_scheduled()) all.push_back(std::make_unique<WeightDecayMetric>());
  all.push_back(make_mtp_metrics(c));
  all.push_back(make_moe_metrics(c));
  all.push_back(make_moe_layer_metrics(c));
  all.push_back(make_straggler_metrics(c));
  all.erase(std::remove(all.begin(), all.end(), nullptr), all.end());
  return all;
}

}  // namespace tessera
