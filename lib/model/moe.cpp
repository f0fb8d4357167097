// moe.cpp: the Mixture-of-Experts MLP (Megatron-Core's MoE layer, docs/model.md) of GPTModel.
//
// Forward, per micro-batch of N tokens (ln2 holds every row on every TP rank):
//   each TP rank computes the router logits of its 1/TP of the rows (its sequence-parallel rows
//   with --sequence-parallel) and the logits are all-gathered, so every rank routes the same
//   tokens the same way; the top-k routing (and token dropping) gives each token's k experts and
//   weights; the token copies are permuted into one buffer grouped by expert; each local expert
//   runs its MLP (split over TP like the dense MLP) on its rows; the outputs are combined back
//   into token order, weighted; the shared expert's output is added. The result is a partial sum
//   over TP, reduced with the row-parallel GEMMs' reduction (all-reduce, or reduce-scatter with
//   sequence parallelism).
// Backward: the mirror; the routing weights' gradient sums over TP (each rank holds a part of
// each expert output), and the router's weight gradient (each rank its rows) is summed over TP
// once per step (reduce_sequence_parallel_grads).
// Expert parallelism (EP ranks carved out of DP, each holding E/EP experts): between the
// permutation and the experts the token copies travel to their experts' ranks and back, by
// all-to-all (counts first: moe_plan) or with the allgather dispatcher by gathering the EP
// group's tokens and reduce-scattering the outputs (moe_allgather_dispatch); the expert side's
// rows are blocks by sending rank, then local expert (docs/parallelism.md).
// Context parallelism: each CP rank routes its own tokens (dropless only); the load-balancing
// counts and statistics of a group (the micro-batch, or a sample with seq_aux) are summed over
// the CP ring, so the aux loss and its gradient are those of the whole sequences.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <sstream>

#include "core/phase_timer.hpp"
#include "model/slots.hpp"

namespace tessera {

namespace {
// FP8 layers run every expert block, the empty ones too, under tensorwise scaling with context
// parallelism: each block's amax is reduced over CP, and the other CP ranks make that reduction
// for their share of the block (which may not be empty there).
bool visits_empty_blocks(bool fp8, int cp_size, const Fp8Scaling* scaling) {
  return fp8 && cp_size > 1 && scaling->config().recipe == Fp8Recipe::Tensorwise;
}
}  // namespace

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

void GPTModel::moe_plan(LayerActivations& la, const std::vector<int64_t>& kept) {
  const int E = cfg_.num_experts, EP = shard_.ep_size, El = E / EP;
  const int e0 = shard_.experts_begin(E);
  la.moe_rows.clear();
  la.moe_block_expert.clear();
  if (EP == 1) {
    for (int j = 0; j < El; ++j) {
      la.moe_rows.push_back(kept[static_cast<size_t>(e0 + j)]);
      la.moe_block_expert.push_back(j);
    }
    return;
  }
  // Every rank's rows per expert (counts first, then tokens): exact integers in doubles.
  std::vector<double> all(static_cast<size_t>(EP) * E, 0.0);
  for (int e = 0; e < E; ++e)
    all[static_cast<size_t>(shard_.ep_rank) * E + e] =
        static_cast<double>(kept[static_cast<size_t>(e)]);
  TESSERA_CHECK(ep_, "expert parallelism without its communicator (set_expert_comm)");
  ep_->all_reduce_f64(all.data(), static_cast<int64_t>(all.size()), ReduceOp::Sum);
  la.moe_send.assign(static_cast<size_t>(EP), 0);
  la.moe_recv.assign(static_cast<size_t>(EP), 0);
  for (int p = 0; p < EP; ++p)
    for (int j = 0; j < El; ++j) {
      la.moe_send[static_cast<size_t>(p)] += kept[static_cast<size_t>(p * El + j)];
      const int64_t rows = static_cast<int64_t>(all[static_cast<size_t>(p) * E + e0 + j]);
      la.moe_recv[static_cast<size_t>(p)] += rows;
      la.moe_rows.push_back(rows);  // from rank p, for local expert j
      la.moe_block_expert.push_back(j);
    }
}

void GPTModel::moe_allgather_dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la,
                                      int64_t group_rows, const MoERouting& routing) {
  const int EP = shard_.ep_size, E = cfg_.num_experts, El = E / EP;
  const int e0 = shard_.experts_begin(E);
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  // Every EP rank's tokens and router logits; each rank's routing is recomputed here from its
  // logits (the same deterministic function its owner ran, its capacity included).
  phase("moe-allgather");
  ep_->all_gather(a.moe_ag_x, la.ln2);
  ep_->all_gather(a.moe_ag_logits, la.moe_logits);
  phase("moe-permute");
  la.moe_rows.clear();
  la.moe_block_expert.clear();
  std::vector<int32_t> rows_host(static_cast<size_t>(N * K));
  int64_t base = 0;
  for (int p = 0; p < EP; ++p) {
    Tensor expert = a.moe_ag_expert.view(p * N * K, {N, K});
    Tensor weight = la.moe_ag_weight.view(p * N * K, {N, K});
    Tensor row = la.moe_ag_row.view(p * N * K, {N, K});
    std::vector<int64_t> routed, kept;
    be_.moe_route(expert, weight, row, a.moe_ag_logits.view(p * N * E, {N, E}), routing, group_rows,
                  routed, kept);
    // This rank's experts hold rows [first, first + mine) of rank p's permutation: re-based to
    // follow the ranks before p on the expert side; the other slots are not ours (-1).
    int64_t first = 0, mine = 0;
    for (int e = 0; e < e0; ++e) first += kept[static_cast<size_t>(e)];
    for (int j = 0; j < El; ++j) {
      mine += kept[static_cast<size_t>(e0 + j)];
      la.moe_rows.push_back(kept[static_cast<size_t>(e0 + j)]);
      la.moe_block_expert.push_back(j);
    }
    be_.copy_to_host(rows_host.data(), row);
    for (int32_t& r : rows_host)
      r = r >= first && r < first + mine ? static_cast<int32_t>(r - first + base) : -1;
    be_.copy_from_host(row, rows_host.data());
    be_.moe_permute(la.moe_xe, a.moe_ag_x.view(p * N * C, {N, C}), row);
    base += mine;
  }
}

// The router logits: this rank's rows, then every rank's logits to all.
void GPTModel::moe_router_forward(PhaseSequence& phase, const LayerWeights& w, Activations& a,
                                  LayerActivations& la) {
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, E = cfg_.num_experts;
  const int64_t nl = router_rows(a), rb = nl * shard_.tp_rank;
  phase("moe-router-gemm");
  const Tensor x_mine = la.ln2.view(rb * C, {nl, C});
  Tensor logits_mine = la.moe_logits.view(rb * E, {nl, E});
  if (compute_ == DType::F32) {
    be_.matmul_forward(logits_mine, x_mine, w.router_w, nullptr);
  } else {
    Tensor lc = a.moe_logits_c.view(rb * E, {nl, E});
    be_.matmul_forward(lc, x_mine, w.router_w, nullptr);
    be_.cast(logits_mine, lc);
  }
  if (tp_.size() > 1) {
    phase("moe-logits-all-gather");
    tp_.all_gather_async(la.moe_logits)->wait_device();
  }
  if (!test_logit_bias_.empty()) {  // testing: a constant added to some experts' logits
    std::vector<float> z(static_cast<size_t>(N * E));
    be_.copy_to_host(z.data(), la.moe_logits);
    for (int64_t n = 0; n < N; ++n)
      for (const auto& [e, v] : test_logit_bias_) z[static_cast<size_t>(n * E + e)] += v;
    be_.copy_from_host(la.moe_logits, z.data());
  }
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

// The token copies to the expert side: permuted by expert, and sent to the experts' ranks.
void GPTModel::moe_dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la,
                            int64_t group_rows, const std::vector<int64_t>& kept, bool allgather,
                            const MoERouting& routing) {
  const int64_t C = cfg_.hidden_size;
  const bool ep = shard_.ep_size > 1;
  if (allgather) {
    moe_allgather_dispatch(phase, a, la, group_rows, routing);
  } else {
    // The token copies, grouped by expert; with expert parallelism each rank's share goes to the
    // rank of its experts (all-to-all), and the results come back the same way.
    phase("moe-permute");
    be_.moe_permute(la.moe_x, la.ln2, la.moe_row);
    moe_plan(la, kept);
  }
  if (ep && !allgather) {
    if (fault_wrong_rank_ && shard_.ep_rank == 0 && la.moe_send[0] > 0 && la.moe_send[1] > 0) {
      // testing: the first copy for rank 0 and the first for rank 1 trade places
      std::vector<float> x(static_cast<size_t>(la.moe_x.numel()));
      Tensor xf({la.moe_x.numel()}, DType::F32, be_.allocator());
      be_.cast(xf, la.moe_x.reshape({la.moe_x.numel()}));
      be_.copy_to_host(x.data(), xf);
      std::swap_ranges(x.begin(), x.begin() + C, x.begin() + la.moe_send[0] * C);
      be_.copy_from_host(xf, x.data());
      Tensor flat = la.moe_x.reshape({la.moe_x.numel()});
      be_.cast(flat, xf);
    }
    phase("moe-dispatch-all-to-all");
    ep_->all_to_all(la.moe_x, la.moe_send, la.moe_xe, la.moe_recv, C);
  }
}

// Each local expert's MLP on its blocks of la.moe_xe, into oute.
void GPTModel::moe_experts_forward(PhaseSequence& phase, int l, const LayerWeights& w,
                                   const Activations& a, LayerActivations& la, Tensor& oute) {
  const int64_t C = cfg_.hidden_size;
  const bool bias_here = shard_.tp_rank == 0;  // row-parallel biases: added once across TP
  const int64_t efc1 = la.moe_fc1.dim(1), efl = la.moe_act.dim(1);
  const bool fp8 = fp8_layer(l);
  if (cfg_.moe_grouped_gemm && !fp8) {
    // One grouped GEMM per projection over the blocks with rows; the activation in one pass over
    // all of them (their rows are contiguous).
    std::deque<Tensor> views;  // stable addresses for the groups' pointers
    std::vector<Backend::GroupedGemm> g1, g2;
    int64_t row = 0;
    for (size_t b = 0; b < la.moe_rows.size(); ++b) {
      const int64_t rows = la.moe_rows[b];
      if (rows == 0) continue;
      const ExpertWeights& ew = w.experts[static_cast<size_t>(la.moe_block_expert[b])];
      Tensor& x = views.emplace_back(la.moe_xe.view(row * C, {rows, C}));
      Tensor& fc1 = views.emplace_back(la.moe_fc1.view(row * efc1, {rows, efc1}));
      Tensor& act = views.emplace_back(la.moe_act.view(row * efl, {rows, efl}));
      Tensor& y = views.emplace_back(oute.view(row * C, {rows, C}));
      g1.push_back({&fc1, nullptr, &x, nullptr, &ew.fc1_w});
      g2.push_back({&y, nullptr, &act, nullptr, &ew.fc2_w});
      row += rows;
    }
    if (row > 0) {
      phase("moe-expert-fc1-gemm-forward");
      be_.grouped_matmul_forward(g1);
      phase("moe-expert-activation-forward");
      Tensor act = la.moe_act.view(0, {row, efl});
      mlp_activation(act, la.moe_fc1.view(0, {row, efc1}));
      phase("moe-expert-fc2-gemm-forward");
      be_.grouped_matmul_forward(g2);
    }
  } else {
    // One block (a sender's tokens for one expert) at a time. In FP8 each block has its own
    // scales (the grouped GEMM has no FP8 form); the empty ones too under tensorwise scaling with
    // context parallelism, whose amax reductions the other CP ranks make for their share.
    const bool empty_too = visits_empty_blocks(fp8, shard_.cp_size, fp8_.get());
    const int e0 = shard_.experts_begin(cfg_.num_experts);
    int64_t row = 0;
    for (size_t b = 0; b < la.moe_rows.size(); ++b) {
      const int64_t rows = la.moe_rows[b];
      if (rows == 0 && !empty_too) continue;  // an expert no token chose (from this sender)
      const int j = la.moe_block_expert[b];
      const ExpertWeights& ew = w.experts[static_cast<size_t>(j)];
      Tensor x = la.moe_xe.view(row * C, {rows, C}),
             fc1 = la.moe_fc1.view(row * efc1, {rows, efc1});
      Tensor act = la.moe_act.view(row * efl, {rows, efl}), y = oute.view(row * C, {rows, C});
      phase("moe-expert-fc1-gemm-forward");
      linear_forward(l, Fp8Gemm::Fc1, fc1, x, ew.fc1_w, opt(ew.fc1_b), a, e0 + j);
      phase("moe-expert-activation-forward");
      if (rows > 0) mlp_activation(act, fc1);
      phase("moe-expert-fc2-gemm-forward");
      linear_forward(l, Fp8Gemm::Fc2, y, act, ew.fc2_w, bias_here ? opt(ew.fc2_b) : nullptr, a,
                     e0 + j);
      row += rows;
    }
  }
}

// The expert outputs back to their tokens' ranks, un-permuted into token order, weighted.
void GPTModel::moe_combine(PhaseSequence& phase, Activations& a, LayerActivations& la, Tensor& oute,
                           Tensor& out, bool allgather) {
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  const bool ep = shard_.ep_size > 1;
  if (allgather) {
    // Each rank's tokens' outputs from this rank's experts (zeros for the others), summed over
    // the EP group into each rank's own rows.
    phase("moe-unpermute");
    const int EP = shard_.ep_size;
    for (int p = 0; p < EP; ++p) {
      Tensor yp = a.moe_ag_y.view(p * N * C, {N, C});
      be_.moe_unpermute(yp, la.moe_oute, la.moe_ag_row.view(p * N * K, {N, K}),
                        la.moe_ag_weight.view(p * N * K, {N, K}));
    }
    phase("moe-reduce-scatter");
    ep_->reduce_scatter(out, a.moe_ag_y);
  } else {
    if (ep) {
      phase("moe-combine-all-to-all");
      ep_->all_to_all(oute, la.moe_recv, la.moe_out, la.moe_send, C);
    }
    phase("moe-unpermute");
    be_.moe_unpermute(out, la.moe_out, la.moe_row, la.moe_weight);
  }
}

void GPTModel::moe_forward(PhaseSequence& phase, int l, Activations& a, Tensor& out) {
  const int li = shard_.local_index(l);
  const LayerWeights& w = weights_[li];
  LayerActivations& la = acts_of(l, a);
  const int64_t N = int64_t(a.B) * a.T;
  const bool bias_here = shard_.tp_rank == 0;  // row-parallel biases: added once across TP
  const bool ep = shard_.ep_size > 1;
  // The router: this rank's rows, then every rank's logits to all.
  moe_router_forward(phase, w, a, la);
  phase("moe-route");
  const bool seq_aux = cfg_.moe_router_load_balancing_type == "seq_aux_loss";
  const int64_t group_rows = seq_aux ? a.T : N;
  std::vector<int64_t> kept;
  const MoERouting routing = routing_of(l);
  be_.moe_route(la.moe_expert, la.moe_weight, la.moe_row, la.moe_logits, routing, group_rows,
                la.moe_routed, kept);
  // Context parallelism: a group's tokens (the micro-batch's, or one sample's with seq_aux) are
  // spread over the CP ranks, so its routed counts are summed over the ring (dropless routing:
  // each token's experts do not depend on the others').
  if (shard_.cp_size > 1) cp_sum(la.moe_routed);
  if (fault_bias_in_weights_ && !routing.expert_bias.empty()) {  // testing: a mutation
    const int64_t K = cfg_.moe_router_topk;
    std::vector<int32_t> ex(static_cast<size_t>(N * K));
    std::vector<float> wt(ex.size());
    be_.copy_to_host(ex.data(), la.moe_expert);
    be_.copy_to_host(wt.data(), la.moe_weight);
    for (size_t i = 0; i < ex.size(); ++i)
      if (ex[i] >= 0) wt[i] += routing.expert_bias[static_cast<size_t>(ex[i])];
    be_.copy_from_host(la.moe_weight, wt.data());
  }
  la.moe_loss_scale = a.moe_loss_scale;
  if (a.dropout.training && !recomputing_) {  // the logged metrics, once per micro-batch
    moe_record_stats(li, a, la, group_rows);
    count_step_tokens(li, la.moe_routed);
  }
  const bool allgather = ep && cfg_.moe_token_dispatcher_type == "allgather";
  moe_dispatch(phase, a, la, group_rows, kept, allgather, routing);
  Tensor oute = allgather ? la.moe_oute : ep ? a.moe_oute : la.moe_out;
  moe_experts_forward(phase, l, w, a, la, oute);
  moe_combine(phase, a, la, oute, out, allgather);
  if (w.fc1_w.defined()) {  // the shared expert: the dense MLP beside the routed ones
    phase("fc1-gemm-forward");
    linear_forward(l, Fp8Gemm::Fc1, la.fc1, la.ln2, w.fc1_w, opt(w.fc1_b), a);
    activation_forward(phase, la);
    phase("fc2-gemm-forward");
    linear_forward(l, Fp8Gemm::Fc2, a.moe_tmp, la.gelu, w.fc2_w, bias_here ? opt(w.fc2_b) : nullptr,
                   a);
    phase("residual-add");
    be_.add(out, out, a.moe_tmp);
  }
}

// The gradients of the expert outputs (into de) and of the routing weights from dy.
void GPTModel::moe_combine_backward(PhaseSequence& phase, Activations& a, LayerActivations& la,
                                    const Tensor& dy, Tensor& de, bool allgather) {
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  const int EP = shard_.ep_size;
  if (allgather) {
    // Every EP rank's output gradients; this rank's experts' slots of them, and their routing
    // weights' gradients, summed over the EP group into each rank's own.
    phase("moe-allgather");
    ep_->all_gather(a.moe_ag_y, dy);
    phase("moe-unpermute-backward");
    for (int p = 0; p < EP; ++p) {
      Tensor dwp = a.moe_ag_dweight.view(p * N * K, {N, K});
      be_.moe_unpermute_backward(de, dwp, a.moe_ag_y.view(p * N * C, {N, C}), la.moe_oute,
                                 la.moe_ag_row.view(p * N * K, {N, K}),
                                 la.moe_ag_weight.view(p * N * K, {N, K}));
    }
    phase("moe-reduce-scatter");
    ep_->reduce_scatter(a.moe_dweight, a.moe_ag_dweight);
  } else {
    phase("moe-unpermute-backward");
    be_.moe_unpermute_backward(a.moe_dout, a.moe_dweight, dy, la.moe_out, la.moe_row,
                               la.moe_weight);
  }
}

// Each local expert's MLP backward: its weights' gradients, and its input gradients into de.
void GPTModel::moe_experts_backward(PhaseSequence& phase, int l, const LayerWeights& w,
                                    LayerWeights& g, Activations& a, LayerActivations& la,
                                    Tensor& de) {
  const int64_t C = cfg_.hidden_size;
  const int64_t efc1 = la.moe_fc1.dim(1), efl = la.moe_act.dim(1);
  const bool fp8 = fp8_layer(l);
  if (cfg_.moe_grouped_gemm && !fp8) {
    // fc2's backward for every block, the activation's over all rows, then fc1's (which
    // overwrites the output gradients fc2's backward has read).
    std::deque<Tensor> views;
    std::vector<Backend::GroupedGemm> g2, g1;
    std::vector<std::pair<int64_t, int64_t>> spans;  // (first row, rows) of each block with rows
    int64_t row = 0;
    for (size_t b = 0; b < la.moe_rows.size(); ++b) {
      const int64_t rows = la.moe_rows[b];
      if (rows == 0) continue;
      const size_t j = static_cast<size_t>(la.moe_block_expert[b]);
      Tensor& dout = views.emplace_back(de.view(row * C, {rows, C}));
      Tensor& dact = views.emplace_back(a.moe_dact.view(row * efl, {rows, efl}));
      Tensor& act = views.emplace_back(la.moe_act.view(row * efl, {rows, efl}));
      g2.push_back({&dact, &g.experts[j].fc2_w, &act, &dout, &w.experts[j].fc2_w});
      spans.emplace_back(row, rows);
      row += rows;
    }
    if (row > 0) {
      phase("moe-expert-fc2-gemm-backward");
      be_.grouped_matmul_backward(g2);
      Tensor dact = a.moe_dact.view(0, {row, efl});
      Tensor dfc1 = swiglu_ ? a.moe_dfc1.view(0, {row, efc1}) : Tensor();
      const Tensor& d1 = activation_backward(phase, dact, dfc1, la.moe_fc1.view(0, {row, efc1}));
      const int64_t d1c = d1.dim(1);
      size_t k = 0;
      for (size_t b = 0; b < la.moe_rows.size(); ++b) {
        if (la.moe_rows[b] == 0) continue;
        const size_t j = static_cast<size_t>(la.moe_block_expert[b]);
        const auto [r0, rows] = spans[k++];
        Tensor& dx = views.emplace_back(de.view(r0 * C, {rows, C}));
        Tensor& d1b = views.emplace_back(d1.view(r0 * d1c, {rows, d1c}));
        Tensor& x = views.emplace_back(la.moe_xe.view(r0 * C, {rows, C}));
        g1.push_back({&dx, &g.experts[j].fc1_w, &x, &d1b, &w.experts[j].fc1_w});
      }
      phase("moe-expert-fc1-gemm-backward");
      be_.grouped_matmul_backward(g1);
    }
  }
  if (cfg_.moe_grouped_gemm && !fp8) return;
  // One block at a time (FP8: each with its scales, the empty ones as in the forward).
  const bool empty_too = visits_empty_blocks(fp8, shard_.cp_size, fp8_.get());
  const int e0 = shard_.experts_begin(cfg_.num_experts);
  int64_t row = 0;
  for (size_t b = 0; b < la.moe_rows.size(); ++b) {
    const int64_t rows = la.moe_rows[b];
    if (rows == 0 && !empty_too) continue;  // no token: no gradient (the weights' stay as they are)
    const int j = la.moe_block_expert[b];
    const ExpertWeights& ew = w.experts[static_cast<size_t>(j)];
    ExpertWeights& eg = g.experts[static_cast<size_t>(j)];  // gradients
    Tensor dout = de.view(row * C, {rows, C});
    Tensor dact = a.moe_dact.view(row * efl, {rows, efl});
    Tensor dfc1 = swiglu_ ? a.moe_dfc1.view(row * efc1, {rows, efc1}) : Tensor();
    const Tensor x = la.moe_xe.view(row * C, {rows, C});
    const Tensor fc1 = la.moe_fc1.view(row * efc1, {rows, efc1});
    const Tensor act = la.moe_act.view(row * efl, {rows, efl});
    phase("moe-expert-fc2-gemm-backward");
    linear_backward(l, Fp8Gemm::Fc2, &dact, eg.fc2_w, opt(eg.fc2_b), dout, act, ew.fc2_w, e0 + j);
    const Tensor& d1 = rows > 0  ? activation_backward(phase, dact, dfc1, fc1)
                       : swiglu_ ? dfc1
                                 : dact;
    phase("moe-expert-fc1-gemm-backward");
    linear_backward(l, Fp8Gemm::Fc1, &dout, eg.fc1_w, opt(eg.fc1_b), d1, x, ew.fc1_w, e0 + j);
    row += rows;
  }
}

// The expert inputs' gradients (de) back to their tokens' ranks and into token order (a.dln).
void GPTModel::moe_dispatch_backward(PhaseSequence& phase, Activations& a, LayerActivations& la,
                                     Tensor& de, bool allgather) {
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  const bool ep = shard_.ep_size > 1;
  const int EP = shard_.ep_size;
  if (allgather) {
    // Each rank's tokens' input gradients from this rank's experts, summed over the EP group.
    phase("moe-permute-backward");
    for (int p = 0; p < EP; ++p) {
      Tensor dxp = a.moe_ag_y.view(p * N * C, {N, C});
      be_.moe_permute_backward(dxp, de, la.moe_ag_row.view(p * N * K, {N, K}));
    }
    phase("moe-reduce-scatter");
    ep_->reduce_scatter(a.dln, a.moe_ag_y);
  } else {
    if (ep) {
      phase("moe-combine-all-to-all");
      ep_->all_to_all(de, la.moe_recv, a.moe_dout, la.moe_send, C);
    }
    phase("moe-permute-backward");
    be_.moe_permute_backward(a.dln, a.moe_dout, la.moe_row);
  }
}

// The router's gradients: through the routing weights, the load-balancing loss and the z-loss.
void GPTModel::moe_router_grad(PhaseSequence& phase, const LayerWeights& w, LayerWeights& g,
                               Activations& a, LayerActivations& la) {
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, E = cfg_.num_experts;
  const int64_t K = cfg_.moe_router_topk;
  const int64_t nl = router_rows(a), rb = nl * shard_.tp_rank;
  phase("moe-router-backward");
  const bool seq_aux = cfg_.moe_router_load_balancing_type == "seq_aux_loss";
  const int64_t group_rows = seq_aux ? a.T : N, groups = N / group_rows;
  // With context parallelism a group's tokens span the ring (moe_routed holds its global counts).
  const double rows = double(group_rows) * shard_.cp_size;
  std::vector<double> aux_grad;
  if (cfg_.moe_router_load_balancing_type != "none" && cfg_.moe_aux_loss_coeff > 0) {
    // d (scale * coeff * mean over groups of E/(K T^2) sum_i P_i count_i) / d score(x, i)
    const double c = la.moe_loss_scale * cfg_.moe_aux_loss_coeff * double(E) /
                     (double(K) * rows * rows * double(groups));
    aux_grad.resize(la.moe_routed.size());
    for (size_t i = 0; i < aux_grad.size(); ++i)
      aux_grad[i] = c * static_cast<double>(la.moe_routed[i]);
  }
  const double z_grad = la.moe_loss_scale * cfg_.moe_z_loss_coeff / (double(N) * shard_.cp_size);
  be_.moe_router_backward(a.moe_dlogits, la.moe_logits, la.moe_expert, la.moe_weight, a.moe_dweight,
                          routing_, group_rows, aux_grad, z_grad);
  // This rank's rows: the router weight's gradient and their input gradient.
  Tensor dlogits = a.moe_dlogits.view(rb * E, {nl, E});
  if (compute_ != DType::F32) {
    Tensor lc = a.moe_logits_c.view(rb * E, {nl, E});
    be_.cast(lc, dlogits);
    dlogits = lc;
  }
  const Tensor x_mine = la.ln2.view(rb * C, {nl, C});
  Tensor dx_mine = a.moe_dx.view(rb * C, {nl, C}), dln_mine = a.dln.view(rb * C, {nl, C});
  be_.matmul_backward(&dx_mine, g.router_w, nullptr, dlogits, x_mine, w.router_w);
  be_.add(dln_mine, dln_mine, dx_mine);
}

void GPTModel::moe_backward(PhaseSequence& phase, int l, Activations& a, const Tensor& dy) {
  const int li = shard_.local_index(l);
  const LayerWeights& w = weights_[li];
  LayerWeights& g = grads_[li];
  LayerActivations& la = acts_of(l, a);
  const int64_t C = cfg_.hidden_size;
  const bool shared = w.fc1_w.defined(), ep = shard_.ep_size > 1;
  if (shared) {  // its input gradient waits in moe_dx
    Tensor dfc = a.dfc.view(0, la.gelu.shape());
    Tensor dfc1 = swiglu_ ? a.dfc1.view(0, la.fc1.shape()) : Tensor();
    phase("fc2-gemm-backward");
    linear_backward(l, Fp8Gemm::Fc2, &dfc, g.fc2_w, opt(g.fc2_b), dy, la.gelu, w.fc2_w);
    const Tensor& d1 = activation_backward(phase, dfc, dfc1, la.fc1);
    phase("fc1-gemm-backward");
    linear_backward(l, Fp8Gemm::Fc1, &a.moe_dx, g.fc1_w, opt(g.fc1_b), d1, la.ln2, w.fc1_w);
  }
  const bool allgather = ep && cfg_.moe_token_dispatcher_type == "allgather";
  Tensor de = ep ? a.moe_doute : a.moe_dout;  // the expert side's output gradients
  moe_combine_backward(phase, a, la, dy, de, allgather);
  tp_reduce(phase, a.moe_dweight);  // each rank's expert outputs are partial sums over TP
  // The expert side's output gradients (sent to the experts' ranks with expert parallelism);
  // each block's rows become its input gradients once fc2's backward has read them.
  if (ep && !allgather) {
    phase("moe-dispatch-all-to-all");
    ep_->all_to_all(a.moe_dout, la.moe_send, de, la.moe_recv, C);
  }
  moe_experts_backward(phase, l, w, g, a, la, de);
  moe_dispatch_backward(phase, a, la, de, allgather);
  if (shared) be_.add(a.dln, a.dln, a.moe_dx);
  moe_router_grad(phase, w, g, a, la);
}

GPTModel::MoEScratch GPTModel::make_moe_scratch(int64_t rows) const {
  MoEScratch s;
  AllocationLabel label("the MoE buffers of generation");
  Allocator& al = be_.allocator();
  const int64_t C = cfg_.hidden_size, E = cfg_.num_experts, K = cfg_.moe_router_topk;
  const int64_t efl = cfg_.moe_ffn() / shard_.tp_size, glu = swiglu_ ? 2 : 1;
  const int64_t sfl = cfg_.moe_shared_expert_intermediate_size / shard_.tp_size;
  auto f = [&](Shape sh) { return Tensor(std::move(sh), compute_, al); };
  s.rows = rows;
  s.logits = Tensor({rows, E}, DType::F32, al);
  s.logits_c = compute_ == DType::F32 ? s.logits : f({rows, E});
  s.expert = Tensor({rows, K}, DType::I32, al);
  s.row = Tensor({rows, K}, DType::I32, al);
  s.weight = Tensor({rows, K}, DType::F32, al);
  s.x = f({rows * K, C});
  s.fc1 = f({rows * K, glu * efl});
  s.act = f({rows * K, efl});
  s.out = f({rows * K, C});
  if (sfl > 0) {
    s.sfc1 = f({rows, glu * sfl});
    s.sact = f({rows, sfl});
    s.tmp = f({rows, C});
  }
  return s;
}

void GPTModel::moe_mlp(int layer, const Tensor& ln, Tensor& out, MoEScratch& s) {
  const LayerWeights& w = weights_[shard_.local_index(layer)];
  const int64_t n = ln.dim(0), C = cfg_.hidden_size, E = cfg_.num_experts;
  const int64_t K = cfg_.moe_router_topk;
  TESSERA_CHECK(n <= s.rows, "moe_mlp: ", n, " rows for a scratch of ", s.rows);
  const bool bias_here = shard_.tp_rank == 0;
  Tensor lc = s.logits_c.view(0, {n, E}), logits = s.logits.view(0, {n, E});
  be_.matmul_forward(lc, ln, w.router_w, nullptr);
  if (compute_ != DType::F32) be_.cast(logits, lc);
  tp_.broadcast(logits, 0);  // every TP rank routes as rank 0 does
  Tensor expert = s.expert.view(0, {n, K}), weight = s.weight.view(0, {n, K});
  Tensor row = s.row.view(0, {n, K});
  MoERouting r = routing_of(layer);
  r.capacity_factor = 0;
  std::vector<int64_t> routed, kept;
  be_.moe_route(expert, weight, row, logits, r, n, routed, kept);
  Tensor x = s.x.view(0, {n * K, C});
  be_.moe_permute(x, ln, row);
  const int64_t efc1 = s.fc1.dim(1), efl = s.act.dim(1);
  const int e0 = shard_.experts_begin(cfg_.num_experts);
  int64_t at = 0;
  for (size_t j = 0; j < w.experts.size(); ++j) {
    const int64_t rows = kept[static_cast<size_t>(e0) + j];
    if (rows == 0) continue;
    const ExpertWeights& ew = w.experts[j];
    Tensor xe = x.view(at * C, {rows, C}), fc1 = s.fc1.view(at * efc1, {rows, efc1});
    Tensor act = s.act.view(at * efl, {rows, efl}), y = s.out.view(at * C, {rows, C});
    be_.matmul_forward(fc1, xe, ew.fc1_w, opt(ew.fc1_b));
    mlp_activation(act, fc1);
    be_.matmul_forward(y, act, ew.fc2_w, bias_here ? opt(ew.fc2_b) : nullptr);
    at += rows;
  }
  be_.moe_unpermute(out, s.out.view(0, {n * K, C}), row, weight);
  if (w.fc1_w.defined()) {  // the shared expert
    Tensor sfc1 = s.sfc1.view(0, {n, s.sfc1.dim(1)}), sact = s.sact.view(0, {n, s.sact.dim(1)});
    Tensor tmp = s.tmp.view(0, {n, C});
    be_.matmul_forward(sfc1, ln, w.fc1_w, opt(w.fc1_b));
    mlp_activation(sact, sfc1);
    be_.matmul_forward(tmp, sact, w.fc2_w, bias_here ? opt(w.fc2_b) : nullptr);
    be_.add(out, out, tmp);
  }
}

void GPTModel::moe_recompute(PhaseSequence& phase, LayerActivations& la) {
  if (shard_.ep_size == 1) {  // the experts' inputs from the kept routing (else kept whole)
    phase("moe-permute");
    be_.moe_permute(la.moe_x, la.ln2, la.moe_row);
  }
  const int64_t R = la.moe_act.dim(0), efl = la.moe_act.dim(1);
  int64_t row = 0;
  for (int64_t rows : la.moe_rows) {
    if (rows > 0) {
      Tensor act = la.moe_act.view(row * efl, {rows, efl});
      mlp_activation(act, la.moe_fc1.view(row * la.moe_fc1.dim(1), {rows, la.moe_fc1.dim(1)}));
    }
    row += rows;
  }
  TESSERA_CHECK(row <= R, "MoE rows");
}

namespace {

// The MoE layer as a part (model/parts.hpp): the router, the routed experts (this rank's, with
// expert parallelism), the dispatch and combine, and the shared expert (a dense MLP in the dense
// MLP's slots). Its passes are GPTModel's moe_* functions above.
class MoeMlp final : public MlpPart {
 public:
  using MlpPart::MlpPart;

  // The router (replicated; every TP rank routes its own rows), this rank's experts by their
  // global index (layout-free names), and the shared expert.
  void add_params(ParamSpecBuilder& b, int l) const override {
    const std::string p = "layers." + std::to_string(l) + ".mlp.";
    b.add(p + "router.weight", {cfg_.num_experts, cfg_.hidden_size}, -1, ParamInit::Normal,
          cfg_.init_method_std, true);
    const int e0 = shard_.experts_begin(cfg_.num_experts);
    const int local = shard_.experts_local(cfg_.num_experts);
    for (int e = e0; e < e0 + (b.one_expert ? std::min(local, 1) : local); ++e) {
      const size_t first = b.specs.size();
      dense_mlp_params(b, p + "experts." + std::to_string(e) + ".", cfg_.moe_ffn(),
                       spec_.activation);
      for (size_t k = first; k < b.specs.size(); ++k) b.specs[k].expert = true;
    }
    if (spec_.dense_width > 0)
      dense_mlp_params(b, p + "shared_expert.", spec_.dense_width, spec_.activation);
  }

  void bind(const ParamStore& ps, int l, bool grads, LayerWeights& w) const override {
    w.router_w = param(ps, l, "mlp.router.weight", grads);
    dense_mlp_bind(ps, l, grads, "mlp.shared_expert.", w);  // the dense MLP's slots
    const int e0 = shard_.experts_begin(cfg_.num_experts);
    for (int e = e0; e < e0 + shard_.experts_local(cfg_.num_experts); ++e) {
      const std::string x = "mlp.experts." + std::to_string(e) + ".";
      w.experts.push_back(
          {param(ps, l, x + "fc1.weight", grads), param(ps, l, x + "fc1.bias", grads),
           param(ps, l, x + "fc2.weight", grads), param(ps, l, x + "fc2.bias", grads)});
    }
  }
  int64_t dense_width() const override { return spec_.dense_width / shard_.tp_size; }

  // N*K token copies leave a rank; its experts receive R rows: the same ones without expert
  // parallelism, else at most N*min(K, local experts) from each of the EP ranks.
  struct Dims {
    int64_t E, K, NK, R, efl, glu;
    int ep;
    bool allgather;
  };
  Dims dims(const SlotBuilder& sb) const {
    Dims d;
    d.E = cfg_.num_experts;
    d.K = cfg_.moe_router_topk;
    d.NK = sb.N * d.K;
    d.ep = shard_.ep_size;
    d.R = d.ep > 1 ? d.ep * sb.N * std::min<int64_t>(d.K, d.E / d.ep) : d.NK;
    d.allgather = d.ep > 1 && cfg_.moe_token_dispatcher_type == "allgather";
    d.efl = cfg_.moe_ffn() / shard_.tp_size;
    d.glu = spec_.activation == MlpActivation::SwiGLU ? 2 : 1;
    return d;
  }

  void recomputed_buffers(const SlotBuilder& sb, LayerActivations& la,
                          int64_t width) const override {
    dense_mlp_buffers(sb, la, width, spec_.activation, false);
    if (la.moe_x.defined()) return;
    const Dims d = dims(sb);
    la.moe_x = sb.f({d.NK, sb.C});
    la.moe_act = sb.f({d.R, d.efl});
  }

  void kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const override {
    dense_mlp_buffers(sb, la, width, spec_.activation, true);
    if (la.moe_logits.defined()) return;
    const Dims d = dims(sb);
    const int64_t N = sb.N;
    la.moe_logits = sb.f32({N, d.E});
    la.moe_expert = sb.i32({N, d.K});
    la.moe_row = sb.i32({N, d.K});
    la.moe_weight = sb.f32({N, d.K});
    la.moe_fc1 = sb.f({d.R, d.glu * d.efl});
    la.moe_out = sb.f({d.NK, sb.C});
    if (d.ep > 1) la.moe_xe = sb.f({d.R, sb.C});
    if (d.allgather) {
      la.moe_ag_weight = sb.f32({d.ep * N, d.K});
      la.moe_ag_row = sb.i32({d.ep * N, d.K});
      la.moe_oute = sb.f({d.R, sb.C});
    }
  }

  void shared_buffers(const SlotBuilder& sb, Activations& shared) const override {
    dense_mlp_shared(sb, shared, spec_.activation);
    if (shared.moe_dout.defined()) return;
    const Dims d = dims(sb);
    const int64_t N = sb.N, C = sb.C;
    shared.moe_dout = sb.f({d.NK, C});
    if (d.ep > 1) {
      if (!d.allgather) shared.moe_oute = sb.f({d.R, C});
      shared.moe_doute = sb.f({d.R, C});
    }
    if (d.allgather) {
      shared.moe_ag_x = sb.f({d.ep * N, C});
      shared.moe_ag_y = sb.f({d.ep * N, C});
      shared.moe_ag_logits = sb.f32({d.ep * N, d.E});
      shared.moe_ag_expert = sb.i32({d.ep * N, d.K});
      shared.moe_ag_dweight = sb.f32({d.ep * N, d.K});
    }
    shared.moe_dact = sb.f({d.R, d.efl});
    if (d.glu == 2) shared.moe_dfc1 = sb.f({d.R, d.glu * d.efl});
    shared.moe_dweight = sb.f32({N, d.K});
    shared.moe_dlogits = sb.f32({N, d.E});
    shared.moe_dx = sb.f({N, C});
    shared.moe_tmp = sb.f({N, C});
    if (sb.compute != DType::F32) shared.moe_logits_c = sb.f({N, d.E});
  }

  void fit(const SlotBuilder& sb, LayerActivations& la) const override {
    dense_mlp_fit(sb, la, dense_width(), spec_.activation);
    if (shard_.ep_size == 1 && la.moe_x.defined()) la.moe_xe = la.moe_x;  // the expert side
  }

  void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations&,
               Tensor& out) override {
    moe_forward(phase, l, a, out);
  }

  void recompute(PhaseSequence& phase, int, Activations&, LayerActivations& la) override {
    if (la.gelu.defined()) {  // the shared expert
      phase(mlp_activation_phase(spec_.activation, false));
      mlp_activation_forward(be(), spec_.activation, la.gelu, la.fc1);
    }
    moe_recompute(phase, la);
  }

  void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations&,
                const Tensor& dout) override {
    moe_backward(phase, l, a, dout);
  }

  void reduce_tp_grads(int l) override {
    if (tp().size() == 1) return;
    // Each TP rank routed its share of the tokens: the router's gradient is a partial sum.
    TESSERA_PHASE("moe-router-grad-all-reduce");
    tp().all_reduce(grads(l).router_w, ReduceOp::Sum);
  }

  void decode_buffers(DecodeBuffers& d) const override {
    if (d.moe.rows == 0) d.moe = m().make_moe_scratch(d.rows);
  }

  void decode(int l, const Tensor& ln, Tensor& out, DecodeBuffers& d) override {
    m().moe_mlp(l, ln, out, d.moe);
  }
};

}  // namespace

std::unique_ptr<MlpPart> make_moe_mlp(const LayerSpec& spec, const GPTConfig& cfg,
                                      const ModelShard& shard, GPTModel* model) {
  return std::make_unique<MoeMlp>(cfg, shard, spec, model);
}

}  // namespace tessera
