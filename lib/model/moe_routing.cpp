// moe_routing.cpp: the MoE router's state of GPTModel across micro-batches and steps: its
// settings, the rows each TP rank routes, the routed tokens per expert (summed over the CP ring,
// the global batch at the step's end: the step hook), the aux-loss-free expert bias and its
// update, the logged load-balance and z-loss statistics (model/moe.cpp has the passes).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <sstream>

#include "core/phase_timer.hpp"
#include "core/test_hooks.hpp"
#include "model/slots.hpp"

namespace tessera {

int64_t GPTModel::router_rows(const Activations& a) const {
  return int64_t(a.B) * a.T / shard_.tp_size;
}

void GPTModel::cp_sum(std::vector<int64_t>& counts) {
  TESSERA_CHECK(cp_comm_ && cp_comm_->size() == shard_.cp_size,
                "context parallelism: no ring (GPTModel::set_context_comm)");
  std::vector<double> d(counts.begin(), counts.end());  // exact integers in doubles
  cp_comm_->all_reduce_f64(d.data(), static_cast<int64_t>(d.size()), ReduceOp::Sum);
  for (size_t i = 0; i < d.size(); ++i) counts[i] = static_cast<int64_t>(d[i]);
}

namespace {

// The router's per-step state: each attempt counts the routed tokens (and the logged load-balance
// statistics) again; after the step's last backward the loads are summed over the global batch
// and the aux-loss-free expert bias moves (GPTModel::end_step_routing).
class RoutingHook final : public StepHook {
 public:
  explicit RoutingHook(GPTModel& m) : m_(m) {}
  void begin_attempt(bool) override {
    m_.begin_step_routing();
    m_.reset_moe_stats();
  }
  void end_step(Communicator* grad_group) override { m_.end_step_routing(grad_group); }

 private:
  GPTModel& m_;
};

}  // namespace

void GPTModel::init_moe() {
  if (cfg_.num_experts == 0) return;
  for (int l : shard_.layers())
    if (moe_layer(l)) routing_hook_ = std::make_unique<RoutingHook>(*this);
  TESSERA_CHECK(cfg_.num_experts % shard_.ep_size == 0, "--num-experts=", cfg_.num_experts,
                " does not divide over the expert-parallel size ", shard_.ep_size);
  TESSERA_CHECK(cfg_.moe_ffn() % shard_.tp_size == 0 &&
                    cfg_.moe_shared_expert_intermediate_size % shard_.tp_size == 0,
                "the expert widths must divide by the tensor-parallel size");
  TESSERA_CHECK(shard_.tp_size == 1 || cfg_.seq_length % shard_.tp_size == 0,
                "MoE with tensor parallelism needs --seq-length divisible by the "
                "tensor-parallel size (each TP rank routes its share of the tokens)");
  routing_.experts = cfg_.num_experts;
  routing_.topk = cfg_.moe_router_topk;
  routing_.sigmoid = cfg_.moe_router_score_function == "sigmoid";
  routing_.pre_softmax = cfg_.moe_router_pre_softmax;
  routing_.scaling = cfg_.moe_router_topk_scaling_factor;
  routing_.capacity_factor = cfg_.moe_expert_capacity_factor;
  routing_.drop_by_position = cfg_.moe_token_drop_policy == "position";
  routing_.groups = cfg_.moe_router_num_groups;
  routing_.group_topk = cfg_.moe_router_group_topk;
  routing_.group_score = cfg_.moe_router_num_groups > 0 ? cfg_.moe_group_score_experts() : 0;
  test_logit_bias_ = test_hooks::moe_logit_bias(cfg_.num_experts);  // testing: edge cases
  fault_wrong_rank_ = test_hooks::moe_dispatch_wrong_rank();        // testing: a mutation
  fault_bias_in_weights_ = test_hooks::router_bias_in_weights();    // testing: mutations
  fault_no_group_limit_ = test_hooks::router_no_group_limit();
}

void GPTModel::reset_moe_stats() {
  for (MoEStats& s : moe_stats_) s = MoEStats{};
}

MoERouting GPTModel::routing_of(int layer) const {
  MoERouting r = routing_;
  if (cfg_.moe_router_enable_expert_bias) r.expert_bias = expert_bias_[shard_.local_index(layer)];
  if (fault_no_group_limit_) r.groups = r.group_topk = r.group_score = 0;  // testing: a mutation
  return r;
}

void GPTModel::count_step_tokens(int local_layer, const std::vector<int64_t>& routed) {
  // routed: per load-balancing group (the micro-batch, or each sample), per expert; summed over
  // the CP ring already.
  std::vector<int64_t>& c = step_tokens_[static_cast<size_t>(local_layer)];
  const size_t E = static_cast<size_t>(cfg_.num_experts);
  c.resize(E, 0);
  for (size_t i = 0; i < routed.size(); ++i) c[i % E] += routed[i];
}

void GPTModel::begin_step_routing() {
  for (std::vector<int64_t>& c : step_tokens_) c.assign(static_cast<size_t>(cfg_.num_experts), 0);
}

void GPTModel::end_step_routing(Communicator* grad_group) {
  const int E = cfg_.num_experts;
  // Every MoE layer of this rank's in one all-reduce: the global batch's tokens per expert (the
  // counts are CP-ring totals already, so the sum over the DP x CP group counts each CP times).
  std::vector<int> layers;
  std::vector<double> all;
  for (int l : shard_.layers()) {
    if (!moe_layer(l)) continue;
    std::vector<int64_t>& c = step_tokens_[static_cast<size_t>(shard_.local_index(l))];
    c.resize(static_cast<size_t>(E), 0);
    layers.push_back(l);
    all.insert(all.end(), c.begin(), c.end());  // exact integers in doubles
  }
  if (all.empty()) return;
  if (grad_group && grad_group->size() > 1)
    grad_group->all_reduce_f64(all.data(), static_cast<int64_t>(all.size()), ReduceOp::Sum);
  for (size_t j = 0; j < layers.size(); ++j) {
    const size_t li = static_cast<size_t>(shard_.local_index(layers[j]));
    std::vector<int64_t>& logged = logged_tokens_[li];
    logged.resize(static_cast<size_t>(E), 0);
    double sum = 0;
    for (int e = 0; e < E; ++e) {
      const double load = all[j * E + static_cast<size_t>(e)] / shard_.cp_size;
      logged[static_cast<size_t>(e)] += static_cast<int64_t>(load);
      sum += load;
    }
    if (!cfg_.moe_router_enable_expert_bias) continue;
    // Megatron-Core's update: bias += rate * sign(mean load - load), the same on every rank.
    const double mean = sum / E;
    std::vector<float>& b = expert_bias_[li];
    for (int e = 0; e < E; ++e) {
      const double d = mean - all[j * E + static_cast<size_t>(e)] / shard_.cp_size;
      const float step = static_cast<float>(cfg_.moe_router_bias_update_rate);
      b[static_cast<size_t>(e)] += d > 0 ? step : d < 0 ? -step : 0.f;
    }
  }
}

std::vector<std::vector<int64_t>> GPTModel::take_logged_tokens() {
  std::vector<std::vector<int64_t>> out = logged_tokens_;
  for (std::vector<int64_t>& c : logged_tokens_) std::fill(c.begin(), c.end(), 0);
  return out;
}

const std::vector<float>& GPTModel::expert_bias(int layer) const {
  TESSERA_CHECK(
      cfg_.moe_router_enable_expert_bias && moe_layer(layer) && shard_.local_index(layer) >= 0,
      "no expert bias for layer ", layer, " on this rank");
  return expert_bias_[static_cast<size_t>(shard_.local_index(layer))];
}

void GPTModel::set_expert_bias(int layer, const float* values) {
  TESSERA_CHECK(
      cfg_.moe_router_enable_expert_bias && moe_layer(layer) && shard_.local_index(layer) >= 0,
      "no expert bias for layer ", layer, " on this rank");
  std::vector<float>& b = expert_bias_[static_cast<size_t>(shard_.local_index(layer))];
  b.assign(values, values + cfg_.num_experts);
}

void GPTModel::set_expert_comm(Communicator& ep) {
  TESSERA_CHECK(ep.size() == shard_.ep_size && ep.rank() == shard_.ep_rank,
                "expert-parallel communicator does not match the model shard");
  ep_ = &ep;
}

// The logged metrics of a micro-batch: the load balance and the z-loss, over the CP ring.
void GPTModel::moe_record_stats(int local_layer, const Activations& a, const LayerActivations& la,
                                int64_t group_rows) {
  const int64_t N = int64_t(a.B) * a.T, E = cfg_.num_experts, K = cfg_.moe_router_topk;
  const int cpn = shard_.cp_size;
  std::vector<double> score_sums;
  double lse_sq = 0;
  be_.moe_router_stats(la.moe_logits, routing_, group_rows, score_sums, lse_sq);
  if (cpn > 1) {
    score_sums.push_back(lse_sq);
    cp_comm_->all_reduce_f64(score_sums.data(), static_cast<int64_t>(score_sums.size()),
                             ReduceOp::Sum);
    lse_sq = score_sums.back();
    score_sums.pop_back();
  }
  const int64_t groups = N / group_rows;
  const double rows = double(group_rows) * cpn;  // a group's tokens over the whole ring
  double balance = 0;  // E / (K T^2) sum_i P_i count_i, averaged over the groups
  for (size_t i = 0; i < score_sums.size(); ++i)
    balance += score_sums[i] * static_cast<double>(la.moe_routed[i]);
  balance *= double(E) / (double(K) * rows * rows * double(groups));
  MoEStats& st = moe_stats_[static_cast<size_t>(local_layer)];
  st.balance += balance;
  st.z += lse_sq / (double(N) * cpn);
  ++st.micro_batches;
}

}  // namespace tessera
