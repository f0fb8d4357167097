// moe.cpp: Megatron's MoE figures: the load-balancing loss and the router z-loss
// without their coefficients, averaged over the micro-batches of the global batch and over the
// MoE layers, in the log line and the metrics file (the interval's mean) and in TensorBoard (each
// step's).
#include "model/parts.hpp"
#include "train/metrics.hpp"

namespace tessera {

namespace {

const Figure kLoadBalancing{"load_balancing_loss", "%.6E",
                            "load_balancing_loss", "%.17g",
                            "load_balancing_loss", /*tensorboard_every_step=*/true};
const Figure kZLoss{"z_loss",
                    "%.6E",
                    "z_loss",
                    "%.17g",
                    "z_loss",
                    /*tensorboard_every_step=*/true};

class MoEMetrics : public MetricSource {
 public:
  explicit MoEMetrics(const MetricContext& c) : c_(c) {}

  void collect(const StepStats& s) override {
    // Each layer's metrics summed over this rank's micro-batches; the TP ranks hold the same
    // ones, so tp rank 0 contributes; summed over DP and the pipeline stages, then averaged over
    // the micro-batches of the global batch and the MoE layers (Megatron's tracker). (With
    // context parallelism every CP rank holds the whole sequences' figures: cp rank 0's.)
    double v[2] = {0, 0};
    if (c_.ctx.tp_rank == 0 && c_.ctx.cp_rank == 0)
      for (int l : c_.model.shard().layers())
        if (const MoeRouter* r = c_.model.mlp_part(l).router()) {
          v[0] += r->stats().balance;
          v[1] += r->stats().z;
        }
    c_.ctx.world->all_reduce_f64(v, 2, ReduceOp::Sum);
    const double micro = double(s.global_batch) / c_.cfg.micro_batch_size;
    // The MoE layers: the model's, and multi-token prediction's (of the last layer's kind).
    const GPTConfig& m = c_.model.config();
    const double layers =
        m.num_moe_layers() + (m.is_moe_layer(m.num_layers - 1) ? m.mtp_num_layers : 0);
    balance_ = v[0] / (micro * layers);
    z_ = v[1] / (micro * layers);
    interval_balance_ += balance_;
    interval_z_ += z_;
    ++interval_steps_;
  }

  void step(const StepStats&, FigureSink& out) override {
    if (balance_on()) out.add(kLoadBalancing, balance_);
    if (z_on()) out.add(kZLoss, z_);
  }

  void report(const LogInterval&, FigureSink& out) override {
    const double balance = interval_steps_ > 0 ? interval_balance_ / interval_steps_ : 0;
    const double z = interval_steps_ > 0 ? interval_z_ / interval_steps_ : 0;
    interval_balance_ = interval_z_ = 0;
    interval_steps_ = 0;
    if (balance_on()) out.add(kLoadBalancing, balance);
    if (z_on()) out.add(kZLoss, z);
  }

 private:
  bool balance_on() const { return c_.model.config().moe_router_load_balancing_type != "none"; }
  bool z_on() const { return c_.model.config().moe_z_loss_coeff > 0; }

  MetricContext c_;
  double balance_ = 0, z_ = 0;                    // this step's
  double interval_balance_ = 0, interval_z_ = 0;  // summed over the interval's steps
  int interval_steps_ = 0;
};

}  // namespace

std::unique_ptr<MetricSource> make_moe_metrics(const MetricContext& c) {
  if (!c.model.config().moe()) return nullptr;
  return std::make_unique<MoEMetrics>(c);
}

}  // namespace tessera
