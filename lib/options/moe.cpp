// moe.cpp: the Mixture-of-Experts options (experts, router, capacity, expert parallelism), their
// checks and MoE's --dry-run lines (active parameters, each stage's experts and dispatch buffers).
#include <cstdio>
#include <cstdlib>
#include <ostream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"

namespace tessera {
namespace {

class MoEOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    GPTConfig& m = o.model;
    po::options_description& g = p.group("Mixture of Experts");
    declare_model_options(g, "Mixture of Experts", m);
    g.add_options()(
        "moe-expert-capacity-factor", po::value(&capacity_factor_),
        "drop token copies beyond ceil(tokens * topk / experts * factor) per expert and "
        "micro-batch (default: dropless; none: dropless again over a config file's factor)")(
        "moe-token-drop-policy", po::value(&drop_policy_),
        "with a capacity factor: keep the highest routing weights (probs, default) or the "
        "earliest tokens (position)")(
        "moe-pad-expert-input-to-capacity", po::bool_switch(&pad_to_capacity_),
        "with a capacity factor: accepted (Tessera computes the kept rows only; results are "
        "the same)")(
        "expert-model-parallel-size", po::value(&o.ep)->default_value(1),
        "ranks the experts are split over, carved out of the data-parallel ranks (must "
        "divide DP and --num-experts)")(
        "moe-per-layer-logging", po::bool_switch(&o.train.moe_per_layer_logging),
        "each MoE layer's tokens per expert over the log interval (min, max, coefficient of "
        "variation, experts without tokens) and expert bias range: a line per layer, the "
        "metrics file and TensorBoard");
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes& notes) override {
    GPTConfig& m = o.model;
    refuse_unused_model_options(p, "Mixture of Experts", m.num_experts > 0,
                                "--num-experts (a MoE model)", {"num-experts"});
    // Megatron-Core ignores --moe-router-pre-softmax with sigmoid scores (DeepSeek-V3's scripts
    // pass both): accepted, and said so.
    if (m.moe_router_pre_softmax && m.moe_router_score_function == "sigmoid") {
      m.moe_router_pre_softmax = false;
      notes.input.push_back(
          "--moe-router-pre-softmax: accepted without effect with --moe-router-score-function "
          "sigmoid (the weights are the chosen experts' sigmoid scores, as in Megatron-Core)");
    }
    if (!capacity_factor_.empty() && capacity_factor_ != "None" && capacity_factor_ != "none") {
      char* end = nullptr;
      m.moe_expert_capacity_factor = std::strtod(capacity_factor_.c_str(), &end);
      if (end == capacity_factor_.c_str() || *end != '\0' || !(m.moe_expert_capacity_factor > 0))
        throw ConfigError("--moe-expert-capacity-factor=" + capacity_factor_ +
                          " is out of range (allowed: a number > 0; leave it out for dropless)");
    }
    if (m.moe_dropless() && (!drop_policy_.empty() || pad_to_capacity_))
      throw ConfigError(std::string(pad_to_capacity_ ? "--moe-pad-expert-input-to-capacity"
                                                     : "--moe-token-drop-policy") +
                        " needs --moe-expert-capacity-factor (without one every token reaches "
                        "its experts and none is dropped)");
    if (!drop_policy_.empty()) m.moe_token_drop_policy = drop_policy_;
    if (o.ep < 1)
      throw ConfigError(detail::concat("--expert-model-parallel-size=", o.ep,
                                       " is out of range (allowed: >= 1)"));
    if (o.ep > 1 && !m.moe())
      throw ConfigError("--expert-model-parallel-size needs --num-experts (a MoE model)");
    if (m.moe() && m.num_experts % o.ep != 0)
      throw ConfigError(detail::concat("--expert-model-parallel-size=", o.ep,
                                       " does not divide --num-experts=", m.num_experts,
                                       " (allowed: a divisor of ", m.num_experts, ")"));
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    const GPTConfig& m = d.o.model;
    if (!m.moe()) return;
    const int ep = d.o.ep;
    char buf[400];
    if (s == DryRunSection::Totals) {
      std::snprintf(buf, sizeof buf,
                    "MoE: %lld parameters active per token (top-%d of %d experts in %d layers); "
                    "each rank holds %d expert%s per MoE layer (expert-parallel size %d)\n",
                    (long long)m.num_active_parameters(), m.moe_router_topk, m.num_experts,
                    m.num_moe_layers(), m.num_experts / ep, m.num_experts / ep == 1 ? "" : "s", ep);
      out << buf;
    } else if (s == DryRunSection::StageDetail) {
      const MemoryEstimate& e = *d.estimate;
      std::snprintf(buf, sizeof buf,
                    "  MoE: routed experts %lld parameters per rank (%.3f GiB of weights, "
                    "gradients and optimizer state at EP %d); token dispatch buffers %.2f MiB per "
                    "MoE layer per micro-batch\n",
                    (long long)e.expert_parameters, e.expert_bytes / (1024.0 * 1024.0 * 1024.0), ep,
                    e.dispatch_bytes / (1024.0 * 1024.0));
      out << buf;
    }
  }

 private:
  std::string capacity_factor_, drop_policy_;  // "" when not given
  bool pad_to_capacity_ = false;
};

}  // namespace

std::unique_ptr<OptionGroup> make_moe_options() {
  return std::make_unique<MoEOptions>();
}

}  // namespace tessera
