// moe_layers.cpp: --moe-per-layer-logging (Megatron's option): each MoE layer's load over the log
// interval, from the tokens per expert the routers counted over the global batch of every step
// (the MoE layers' step hook, model/moe.hpp): the fewest and most tokens an expert received, their
// coefficient of variation (std / mean over the experts), and the experts that received none; with
// the aux-loss-free expert bias, its range. One line per MoE layer after the iteration line, the
// figures in the metrics file (moe_layer_L_tokens_min, ...) and TensorBoard (moe/layer_L/...).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "model/parts.hpp"
#include "train/metrics.hpp"

namespace tessera {

namespace {

class MoELayerMetrics : public MetricSource {
 public:
  explicit MoELayerMetrics(const MetricContext& c) : c_(c) {
    const GPTConfig& m = c_.model.config();
    for (int l = 0; l < m.num_layers; ++l)
      if (m.is_moe_layer(l)) layers_.push_back(l);
    // The figures' names, built once (Figure holds pointers to them).
    const char* parts[] = {"tokens_min",   "tokens_max", "tokens_cv",
                           "idle_experts", "bias_min",   "bias_max"};
    names_.reserve(layers_.size() * 12);
    for (int l : layers_)
      for (const char* p : parts) {
        names_.push_back("moe_layer_" + std::to_string(l) + "_" + p);
        names_.push_back("moe/layer_" + std::to_string(l) + "/" + p);
      }
  }

  void report(const LogInterval&, FigureSink& out) override {
    const GPTModel& model = c_.model;
    const GPTConfig& m = model.config();
    const ParallelContext& ctx = c_.ctx;
    const int E = m.num_experts;
    const bool bias = m.moe_router_enable_expert_bias;
    // Every MoE layer's counts (and bias) to every rank: the counts are global already and the
    // same on the ranks of a stage, so one rank of each stage contributes (tp, cp, dp rank 0).
    std::vector<std::vector<int64_t>> counts;  // by local layer (empty for a dense one)
    for (int l : model.shard().layers()) {
      MoeRouter* r = model.mlp_part(l).router();
      counts.push_back(r ? r->take_logged_tokens() : std::vector<int64_t>());
    }
    const size_t per = static_cast<size_t>(E) * (bias ? 2 : 1);
    std::vector<double> all(layers_.size() * per, 0.0);
    const bool mine = ctx.tp_rank == 0 && ctx.cp_rank == 0 && ctx.dp_rank == 0;
    for (size_t j = 0; j < layers_.size() && mine; ++j) {
      const int li = model.shard().local_index(layers_[j]);
      if (li < 0) continue;
      const std::vector<int64_t>& c = counts[static_cast<size_t>(li)];
      for (size_t e = 0; e < c.size(); ++e) all[j * per + e] = static_cast<double>(c[e]);
      if (bias) {
        const std::vector<float>& b = model.mlp_part(layers_[j]).router()->expert_bias();
        for (int e = 0; e < E; ++e) all[j * per + static_cast<size_t>(E + e)] = b[e];
      }
    }
    ctx.world->all_reduce_f64(all.data(), static_cast<int64_t>(all.size()), ReduceOp::Sum);
    lines_.clear();
    for (size_t j = 0; j < layers_.size(); ++j) {
      const double* t = all.data() + j * per;
      double lo = t[0], hi = t[0], sum = 0, sq = 0;
      int idle = 0;
      for (int e = 0; e < E; ++e) {
        lo = std::min(lo, t[e]);
        hi = std::max(hi, t[e]);
        sum += t[e];
        idle += t[e] == 0;
      }
      const double mean = sum / E;
      for (int e = 0; e < E; ++e) sq += (t[e] - mean) * (t[e] - mean);
      const double cv = mean > 0 ? std::sqrt(sq / E) / mean : 0.0;
      double blo = 0, bhi = 0;
      if (bias) {
        blo = *std::min_element(t + E, t + 2 * E);
        bhi = *std::max_element(t + E, t + 2 * E);
      }
      const double v[6] = {lo, hi, cv, double(idle), blo, bhi};
      for (int k = 0; k < (bias ? 6 : 4); ++k) {
        const Figure f{nullptr, nullptr, names_[(j * 6 + k) * 2].c_str(), "%.17g",
                       names_[(j * 6 + k) * 2 + 1].c_str()};
        out.add(f, v[k]);
      }
      char line[300];
      std::snprintf(line, sizeof line,
                    " MoE layer %d | tokens per expert: min %.0f, max %.0f, mean %.1f, cv %.4f | "
                    "experts without tokens: %d of %d",
                    layers_[j], lo, hi, mean, cv, idle, E);
      std::string text = line;
      if (bias) {
        std::snprintf(line, sizeof line, " | expert bias: [%.6g, %.6g]", blo, bhi);
        text += line;
      }
      lines_.push_back(text);
    }
  }

  std::vector<std::string> lines_after() override { return lines_; }

 private:
  MetricContext c_;
  std::vector<int> layers_;         // the model's MoE layers
  std::vector<std::string> names_;  // per layer and figure: the metrics-file key, the tag
  std::vector<std::string> lines_;  // the last report's
};

}  // namespace

std::unique_ptr<MetricSource> make_moe_layer_metrics(const MetricContext& c) {
  if (!c.model.config().moe() || !c.cfg.moe_per_layer_logging) return nullptr;
  return std::make_unique<MoELayerMetrics>(c);
}

}  // namespace tessera
