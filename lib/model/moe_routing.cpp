// moe_routing.cpp: the MoE router's state across micro-batches and steps (model/moe.hpp): its
// settings, the rows each TP rank routes, the routed tokens per expert (summed over the CP ring,
// the global batch at the step's end: the model's MoE layers' one step hook), the aux-loss-free
// expert bias and its update, the logged load-balance and z-loss statistics (model/moe.cpp has
// the passes).
#include <algorithm>
#include <cmath>

#include "core/test_hooks.hpp"
#include "model/moe.hpp"

namespace tessera {

MoeMlp::MoeMlp(const GPTConfig& cfg, const ModelShard& shard, const LayerSpec& spec,
               PartServices* services)
    : MlpPart(cfg, shard, spec, services) {
  if (!services) return;  // a planning instance: parameters and buffers only
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
  if (cfg_.moe_router_enable_expert_bias)  // starts at zero
    expert_bias_.assign(static_cast<size_t>(cfg_.num_experts), 0.f);
  test_logit_bias_ = test_hooks::moe_logit_bias(cfg_.num_experts);  // testing: edge cases
  fault_wrong_rank_ = test_hooks::moe_dispatch_wrong_rank();        // testing: a mutation
  fault_bias_in_weights_ = test_hooks::router_bias_in_weights();    // testing: mutations
  fault_no_group_limit_ = test_hooks::router_no_group_limit();
  if (spec_.dense_width > 0)  // the shared expert: a dense MLP beside the routed experts
    shared_ = std::make_unique<DenseMlp>(cfg, shard, spec, services, "mlp.shared_expert.");
  routers_ = &services->shared<MoeRouters>();
  routers_->add(this);
}

int64_t MoeMlp::router_rows(const Activations& a) const {
  return int64_t(a.B) * a.T / shard_.tp_size;
}

Communicator& MoeMlp::ep_group() const {
  Communicator* ep = s().expert_comm();
  TESSERA_CHECK(ep, "expert parallelism without its communicator (GPTModel::set_expert_comm)");
  return *ep;
}

MoERouting MoeMlp::current_routing() const {
  MoERouting r = routing_;
  if (cfg_.moe_router_enable_expert_bias) r.expert_bias = expert_bias_;
  if (fault_no_group_limit_) r.groups = r.group_topk = r.group_score = 0;  // testing: a mutation
  return r;
}

void MoeMlp::count_step_tokens(const std::vector<int64_t>& routed) {
  // routed: per load-balancing group (the micro-batch, or each sample), per expert; summed over
  // the CP ring already.
  const size_t E = static_cast<size_t>(cfg_.num_experts);
  step_tokens_.resize(E, 0);
  for (size_t i = 0; i < routed.size(); ++i) step_tokens_[i % E] += routed[i];
}

void MoeMlp::begin_attempt() {
  step_tokens_.assign(static_cast<size_t>(cfg_.num_experts), 0);
  stats_ = Stats{};
}

const std::vector<int64_t>& MoeMlp::step_tokens() {
  step_tokens_.resize(static_cast<size_t>(cfg_.num_experts), 0);
  return step_tokens_;
}

void MoeMlp::end_step(const double* all) {
  const int E = cfg_.num_experts;
  logged_tokens_.resize(static_cast<size_t>(E), 0);
  double sum = 0;
  for (int e = 0; e < E; ++e) {
    const double load = all[e] / shard_.cp_size;
    logged_tokens_[static_cast<size_t>(e)] += static_cast<int64_t>(load);
    sum += load;
  }
  if (!cfg_.moe_router_enable_expert_bias) return;
  // Megatron-Core's update: bias += rate * sign(mean load - load), the same on every rank.
  const double mean = sum / E;
  for (int e = 0; e < E; ++e) {
    const double d = mean - all[e] / shard_.cp_size;
    const float step = static_cast<float>(cfg_.moe_router_bias_update_rate);
    expert_bias_[static_cast<size_t>(e)] += d > 0 ? step : d < 0 ? -step : 0.f;
  }
}

void MoeRouters::begin_attempt(bool) {
  for (MoeMlp* m : layers_) m->begin_attempt();
}

void MoeRouters::end_step(Communicator* grad_group) {
  // Every MoE layer of this rank's in one all-reduce: the global batch's tokens per expert (the
  // counts are CP-ring totals already, so the sum over the DP x CP group counts each CP times).
  std::vector<double> all;
  size_t E = 0;
  for (MoeMlp* m : layers_) {
    const std::vector<int64_t>& c = m->step_tokens();
    E = c.size();
    all.insert(all.end(), c.begin(), c.end());  // exact integers in doubles
  }
  if (all.empty()) return;
  if (grad_group && grad_group->size() > 1)
    grad_group->all_reduce_f64(all.data(), static_cast<int64_t>(all.size()), ReduceOp::Sum);
  for (size_t j = 0; j < layers_.size(); ++j) layers_[j]->end_step(all.data() + j * E);
}

std::vector<int64_t> MoeMlp::take_logged_tokens() {
  std::vector<int64_t> out = logged_tokens_;
  std::fill(logged_tokens_.begin(), logged_tokens_.end(), 0);
  return out;
}

const std::vector<float>& MoeMlp::expert_bias() const {
  TESSERA_CHECK(cfg_.moe_router_enable_expert_bias,
                "no expert bias without --moe-router-enable-expert-bias");
  return expert_bias_;
}

void MoeMlp::set_expert_bias(const float* values) {
  TESSERA_CHECK(cfg_.moe_router_enable_expert_bias,
                "no expert bias without --moe-router-enable-expert-bias");
  expert_bias_.assign(values, values + cfg_.num_experts);
}

// The logged metrics of a micro-batch: the load balance and the z-loss, over the CP ring.
void MoeMlp::record_stats(const Activations& a, const LayerActivations& la, int64_t group_rows) {
  const MoeBuffers& mb = la.parts.get<MoeBuffers>();
  const int64_t N = int64_t(a.B) * a.T, E = cfg_.num_experts, K = cfg_.moe_router_topk;
  const int cpn = shard_.cp_size;
  std::vector<double> score_sums;
  double lse_sq = 0;
  be().moe_router_stats(mb.logits, routing_, group_rows, score_sums, lse_sq);
  if (cpn > 1) {
    score_sums.push_back(lse_sq);
    s().context_comm()->all_reduce_f64(score_sums.data(), static_cast<int64_t>(score_sums.size()),
                                       ReduceOp::Sum);
    lse_sq = score_sums.back();
    score_sums.pop_back();
  }
  const int64_t groups = N / group_rows;
  const double rows = double(group_rows) * cpn;  // a group's tokens over the whole ring
  double balance = 0;  // E / (K T^2) sum_i P_i count_i, averaged over the groups
  for (size_t i = 0; i < score_sums.size(); ++i)
    balance += score_sums[i] * static_cast<double>(mb.routed[i]);
  balance *= double(E) / (double(K) * rows * rows * double(groups));
  stats_.balance += balance;
  stats_.z += lse_sq / (double(N) * cpn);
  ++stats_.micro_batches;
}

}  // namespace tessera
