// mtp.cpp: multi-token prediction's losses (--mtp-num-layers), as Megatron logs them: depth k's
// mean token loss over the training micro-batches of the steps (its own tokens: those with a
// target k + 1 ahead) as "mtp_k loss" in the iteration line, "mtp_k_loss" in the metrics file and
// "mtp_k loss" in TensorBoard (each step's). The LM loss logged stays the main one.
#include <cstdio>

#include "model/mtp.hpp"
#include "train/metrics.hpp"

namespace tessera {

namespace {

class MtpMetrics : public MetricSource {
 public:
  explicit MtpMetrics(const MetricContext& c) : c_(c) {
    const int D = c_.model.config().mtp_num_layers;
    for (int k = 1; k <= D; ++k) {
      names_.push_back("mtp_" + std::to_string(k) + " loss");
      names_.push_back("mtp_" + std::to_string(k) + "_loss");
    }
    step_.assign(static_cast<size_t>(D), 0.0);
    interval_.assign(static_cast<size_t>(2 * D), 0.0);
  }

  void collect(const StepStats&) override {
    // Each depth's loss sum and tokens: tp rank 0 of the stage that runs multi-token prediction
    // (the last, or a layout's own), of each DP replica and CP rank (each CP rank holds its
    // chunks of the samples).
    const int D = c_.model.config().mtp_num_layers;
    std::vector<double> v(static_cast<size_t>(2 * D), 0.0);
    const MtpHead* mtp = c_.model.mtp();
    if (mtp && c_.ctx.tp_rank == 0)
      for (int k = 0; k < D; ++k) {
        v[static_cast<size_t>(2 * k)] = mtp->losses()[static_cast<size_t>(k)].sum;
        v[static_cast<size_t>(2 * k + 1)] = mtp->losses()[static_cast<size_t>(k)].tokens;
      }
    c_.ctx.world->all_reduce_f64(v.data(), static_cast<int64_t>(v.size()), ReduceOp::Sum);
    for (int k = 0; k < D; ++k) {
      const double tokens = v[static_cast<size_t>(2 * k + 1)];
      step_[static_cast<size_t>(k)] = tokens > 0 ? v[static_cast<size_t>(2 * k)] / tokens : 0.0;
      interval_[static_cast<size_t>(2 * k)] += v[static_cast<size_t>(2 * k)];
      interval_[static_cast<size_t>(2 * k + 1)] += tokens;
    }
  }

  void step(const StepStats&, FigureSink& out) override {
    for (size_t k = 0; k < step_.size(); ++k)
      out.add(Figure{nullptr, nullptr, nullptr, nullptr, names_[2 * k].c_str(), true}, step_[k]);
  }

  void report(const LogInterval&, FigureSink& out) override {
    for (size_t k = 0; k < step_.size(); ++k) {
      const double tokens = interval_[2 * k + 1];
      const double loss = tokens > 0 ? interval_[2 * k] / tokens : 0.0;
      out.add(Figure{names_[2 * k].c_str(), "%.6E", names_[2 * k + 1].c_str(), "%.17g"}, loss);
    }
    std::fill(interval_.begin(), interval_.end(), 0.0);
  }

 private:
  MetricContext c_;
  std::vector<std::string> names_;  // per depth: the line's and TensorBoard's label, the key
  std::vector<double> step_;        // each depth's loss at the last step
  std::vector<double> interval_;    // per depth: the loss sum and tokens since the last line
};

}  // namespace

std::unique_ptr<MetricSource> make_mtp_metrics(const MetricContext& c) {
  if (!c.model.config().mtp()) return nullptr;
  return std::make_unique<MtpMetrics>(c);
}

}  // namespace tessera
