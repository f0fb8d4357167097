// moe.cpp: the passes of the Mixture-of-Experts MLP (model/moe.hpp; Megatron-Core's MoE layer,
// docs/model.md).
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
// once per step (reduce_tp_grads).
// Expert parallelism (EP ranks carved out of DP, each holding E/EP experts): between the
// permutation and the experts the token copies travel to their experts' ranks and back, by
// all-to-all (counts first: plan) or with the allgather dispatcher by gathering the EP
// group's tokens and reduce-scattering the outputs (allgather_dispatch); the expert side's
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
#include "model/moe.hpp"
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
void MoeMlp::plan(LayerActivations& la, const std::vector<int64_t>& kept) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  const int E = cfg_.num_experts, EP = shard_.ep_size, El = E / EP;
  const int e0 = shard_.experts_begin(E);
  mb.rows.clear();
  mb.block_expert.clear();
  if (EP == 1) {
    for (int j = 0; j < El; ++j) {
      mb.rows.push_back(kept[static_cast<size_t>(e0 + j)]);
      mb.block_expert.push_back(j);
    }
    return;
  }
  // Every rank's rows per expert (counts first, then tokens): exact integers in doubles.
  std::vector<double> mine(static_cast<size_t>(E)), all(static_cast<size_t>(EP) * E);
  for (int e = 0; e < E; ++e) mine[static_cast<size_t>(e)] = static_cast<double>(kept[size_t(e)]);
  ep_group().all_gather_f64(mine.data(), E, all.data());
  mb.send.assign(static_cast<size_t>(EP), 0);
  mb.recv.assign(static_cast<size_t>(EP), 0);
  for (int p = 0; p < EP; ++p)
    for (int j = 0; j < El; ++j) {
      mb.send[static_cast<size_t>(p)] += kept[static_cast<size_t>(p * El + j)];
      const int64_t rows = static_cast<int64_t>(all[static_cast<size_t>(p) * E + e0 + j]);
      mb.recv[static_cast<size_t>(p)] += rows;
      mb.rows.push_back(rows);  // from rank p, for local expert j
      mb.block_expert.push_back(j);
    }
}

void MoeMlp::allgather_dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la,
                                int64_t group_rows, const MoERouting& routing) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  const int EP = shard_.ep_size, E = cfg_.num_experts, El = E / EP;
  const int e0 = shard_.experts_begin(E);
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  // Every EP rank's tokens and router logits; each rank's routing is recomputed here from its
  // logits (the same deterministic function its owner ran, its capacity included).
  phase("moe-allgather");
  ep_group().all_gather(ms.ag_x, la.ln2);
  ep_group().all_gather(ms.ag_logits, mb.logits);
  phase("moe-permute");
  mb.rows.clear();
  mb.block_expert.clear();
  std::vector<int32_t> rows_host(static_cast<size_t>(N * K));
  int64_t base = 0;
  for (int p = 0; p < EP; ++p) {
    Tensor expert = ms.ag_expert.view(p * N * K, {N, K});
    Tensor weight = mb.ag_weight.view(p * N * K, {N, K});
    Tensor row = mb.ag_row.view(p * N * K, {N, K});
    std::vector<int64_t> routed, kept;
    be().moe_route(expert, weight, row, ms.ag_logits.view(p * N * E, {N, E}), routing, group_rows,
                   routed, kept);
    // This rank's experts hold rows [first, first + mine) of rank p's permutation: re-based to
    // follow the ranks before p on the expert side; the other slots are not ours (-1).
    int64_t first = 0, mine = 0;
    for (int e = 0; e < e0; ++e) first += kept[static_cast<size_t>(e)];
    for (int j = 0; j < El; ++j) {
      mine += kept[static_cast<size_t>(e0 + j)];
      mb.rows.push_back(kept[static_cast<size_t>(e0 + j)]);
      mb.block_expert.push_back(j);
    }
    be().copy_to_host(rows_host.data(), row);
    for (int32_t& r : rows_host)
      r = r >= first && r < first + mine ? static_cast<int32_t>(r - first + base) : -1;
    be().copy_from_host(row, rows_host.data());
    be().moe_permute(mb.xe, ms.ag_x.view(p * N * C, {N, C}), row);
    base += mine;
  }
}

// The router logits: this rank's rows, then every rank's logits to all.
void MoeMlp::router_forward(PhaseSequence& phase, Activations& a, LayerActivations& la) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, E = cfg_.num_experts;
  const int64_t nl = router_rows(a), rb = nl * shard_.tp_rank;
  phase("moe-router-gemm");
  const Tensor x_mine = la.ln2.view(rb * C, {nl, C});
  Tensor logits_mine = mb.logits.view(rb * E, {nl, E});
  if (compute() == DType::F32) {
    be().matmul_forward(logits_mine, x_mine, router_w_, nullptr);
  } else {
    Tensor lc = ms.logits_c.view(rb * E, {nl, E});
    be().matmul_forward(lc, x_mine, router_w_, nullptr);
    be().cast(logits_mine, lc);
  }
  if (tp().size() > 1) {
    phase("moe-logits-all-gather");
    tp().all_gather_async(mb.logits)->wait_device();
  }
  if (!test_logit_bias_.empty()) {  // testing: a constant added to some experts' logits
    std::vector<float> z(static_cast<size_t>(N * E));
    be().copy_to_host(z.data(), mb.logits);
    for (int64_t n = 0; n < N; ++n)
      for (const auto& [e, v] : test_logit_bias_) z[static_cast<size_t>(n * E + e)] += v;
    be().copy_from_host(mb.logits, z.data());
  }
}

// The token copies to the expert side: permuted by expert, and sent to the experts' ranks.
void MoeMlp::dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la,
                      int64_t group_rows, const std::vector<int64_t>& kept, bool allgather,
                      const MoERouting& routing) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  const int64_t C = cfg_.hidden_size;
  const bool ep = shard_.ep_size > 1;
  if (allgather) {
    allgather_dispatch(phase, a, la, group_rows, routing);
  } else {
    // The token copies, grouped by expert; with expert parallelism each rank's share goes to the
    // rank of its experts (all-to-all), and the results come back the same way.
    phase("moe-permute");
    be().moe_permute(mb.x, la.ln2, mb.row);
    plan(la, kept);
  }
  if (ep && !allgather) {
    if (fault_wrong_rank_ && shard_.ep_rank == 0 && mb.send[0] > 0 && mb.send[1] > 0) {
      // testing: the first copy for rank 0 and the first for rank 1 trade places
      std::vector<float> x(static_cast<size_t>(mb.x.numel()));
      Tensor xf({mb.x.numel()}, DType::F32, be().allocator());
      be().cast(xf, mb.x.reshape({mb.x.numel()}));
      be().copy_to_host(x.data(), xf);
      std::swap_ranges(x.begin(), x.begin() + C, x.begin() + mb.send[0] * C);
      be().copy_from_host(xf, x.data());
      Tensor flat = mb.x.reshape({mb.x.numel()});
      be().cast(flat, xf);
    }
    phase("moe-dispatch-all-to-all");
    ep_group().all_to_all(mb.x, mb.send, mb.xe, mb.recv, C);
  }
}

// Each local expert's MLP on its blocks of mb.xe, into oute.
void MoeMlp::experts_forward(PhaseSequence& phase, int l, const Activations& a,
                             LayerActivations& la, Tensor& oute) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  const int64_t C = cfg_.hidden_size;
  const bool bias_here = shard_.tp_rank == 0;  // row-parallel biases: added once across TP
  const int64_t efc1 = mb.fc1.dim(1), efl = mb.act.dim(1);
  const bool fp8 = s().fp8_layer(l);
  if (cfg_.moe_grouped_gemm && !fp8) {
    // One grouped GEMM per projection over the blocks with rows; the activation in one pass over
    // all of them (their rows are contiguous).
    std::deque<Tensor> views;  // stable addresses for the groups' pointers
    std::vector<Backend::GroupedGemm> g1, g2;
    int64_t row = 0;
    for (size_t b = 0; b < mb.rows.size(); ++b) {
      const int64_t rows = mb.rows[b];
      if (rows == 0) continue;
      const MlpWeights& ew = experts_w_[static_cast<size_t>(mb.block_expert[b])];
      Tensor& x = views.emplace_back(mb.xe.view(row * C, {rows, C}));
      Tensor& fc1 = views.emplace_back(mb.fc1.view(row * efc1, {rows, efc1}));
      Tensor& act = views.emplace_back(mb.act.view(row * efl, {rows, efl}));
      Tensor& y = views.emplace_back(oute.view(row * C, {rows, C}));
      g1.push_back({&fc1, nullptr, &x, nullptr, &ew.fc1_w});
      g2.push_back({&y, nullptr, &act, nullptr, &ew.fc2_w});
      row += rows;
    }
    if (row > 0) {
      phase("moe-expert-fc1-gemm-forward");
      be().grouped_matmul_forward(g1);
      phase("moe-expert-activation-forward");
      Tensor act = mb.act.view(0, {row, efl});
      activation(act, mb.fc1.view(0, {row, efc1}));
      phase("moe-expert-fc2-gemm-forward");
      be().grouped_matmul_forward(g2);
    }
  } else {
    // One block (a sender's tokens for one expert) at a time. In FP8 each block has its own
    // scales (the grouped GEMM has no FP8 form); the empty ones too under tensorwise scaling with
    // context parallelism, whose amax reductions the other CP ranks make for their share.
    const bool empty_too = visits_empty_blocks(fp8, shard_.cp_size, s().fp8());
    const int e0 = shard_.experts_begin(cfg_.num_experts);
    int64_t row = 0;
    for (size_t b = 0; b < mb.rows.size(); ++b) {
      const int64_t rows = mb.rows[b];
      if (rows == 0 && !empty_too) continue;  // an expert no token chose (from this sender)
      const int j = mb.block_expert[b];
      const MlpWeights& ew = experts_w_[static_cast<size_t>(j)];
      Tensor x = mb.xe.view(row * C, {rows, C}), fc1 = mb.fc1.view(row * efc1, {rows, efc1});
      Tensor act = mb.act.view(row * efl, {rows, efl}), y = oute.view(row * C, {rows, C});
      phase("moe-expert-fc1-gemm-forward");
      s().linear_forward(l, Fp8Gemm::Fc1, fc1, x, ew.fc1_w, opt(ew.fc1_b), a, e0 + j);
      phase("moe-expert-activation-forward");
      if (rows > 0) activation(act, fc1);
      phase("moe-expert-fc2-gemm-forward");
      s().linear_forward(l, Fp8Gemm::Fc2, y, act, ew.fc2_w, bias_here ? opt(ew.fc2_b) : nullptr, a,
                         e0 + j);
      row += rows;
    }
  }
}

// The expert outputs back to their tokens' ranks, un-permuted into token order, weighted.
void MoeMlp::combine(PhaseSequence& phase, Activations& a, LayerActivations& la, Tensor& oute,
                     Tensor& out, bool allgather) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  const bool ep = shard_.ep_size > 1;
  if (allgather) {
    // Each rank's tokens' outputs from this rank's experts (zeros for the others), summed over
    // the EP group into each rank's own rows.
    phase("moe-unpermute");
    const int EP = shard_.ep_size;
    for (int p = 0; p < EP; ++p) {
      Tensor yp = ms.ag_y.view(p * N * C, {N, C});
      be().moe_unpermute(yp, mb.oute, mb.ag_row.view(p * N * K, {N, K}),
                         mb.ag_weight.view(p * N * K, {N, K}));
    }
    phase("moe-reduce-scatter");
    ep_group().reduce_scatter(out, ms.ag_y);
  } else {
    if (ep) {
      phase("moe-combine-all-to-all");
      ep_group().all_to_all(oute, mb.recv, mb.out, mb.send, C);
    }
    phase("moe-unpermute");
    be().moe_unpermute(out, mb.out, mb.row, mb.weight);
  }
}

void MoeMlp::forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                     Tensor& out) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  if (a.inference) {
    infer(a, la, out);
    return;
  }
  const int64_t N = int64_t(a.B) * a.T;
  const bool ep = shard_.ep_size > 1;
  // The router: this rank's rows, then every rank's logits to all.
  router_forward(phase, a, la);
  phase("moe-route");
  const bool seq_aux = cfg_.moe_router_load_balancing_type == "seq_aux_loss";
  const int64_t group_rows = seq_aux ? a.T : N;
  std::vector<int64_t> kept;
  const MoERouting routing = current_routing();
  be().moe_route(mb.expert, mb.weight, mb.row, mb.logits, routing, group_rows, mb.routed, kept);
  // Context parallelism: a group's tokens (the micro-batch's, or one sample's with seq_aux) are
  // spread over the CP ranks, so its routed counts are summed over the ring (dropless routing:
  // each token's experts do not depend on the others').
  if (shard_.cp_size > 1) s().cp_sum(mb.routed);
  if (fault_bias_in_weights_ && !routing.expert_bias.empty()) {  // testing: a mutation
    const int64_t K = cfg_.moe_router_topk;
    std::vector<int32_t> ex(static_cast<size_t>(N * K));
    std::vector<float> wt(ex.size());
    be().copy_to_host(ex.data(), mb.expert);
    be().copy_to_host(wt.data(), mb.weight);
    for (size_t i = 0; i < ex.size(); ++i)
      if (ex[i] >= 0) wt[i] += routing.expert_bias[static_cast<size_t>(ex[i])];
    be().copy_from_host(mb.weight, wt.data());
  }
  mb.loss_scale = a.moe_loss_scale;
  if (a.dropout.training && !s().recomputing()) {  // the logged metrics, once per micro-batch
    record_stats(a, la, group_rows);
    count_step_tokens(mb.routed);
  }
  const bool allgather = ep && cfg_.moe_token_dispatcher_type == "allgather";
  dispatch(phase, a, la, group_rows, kept, allgather, routing);
  Tensor oute = allgather ? mb.oute : ep ? ms.oute : mb.out;
  experts_forward(phase, l, a, la, oute);
  combine(phase, a, la, oute, out, allgather);
  if (shared_) {  // the shared expert: the dense MLP beside the routed ones
    shared_->forward(phase, l, a, la, ms.tmp);
    phase("residual-add");
    be().add(out, out, ms.tmp);
  }
}

// The gradients of the expert outputs (into de) and of the routing weights from dy.
void MoeMlp::combine_backward(PhaseSequence& phase, Activations& a, LayerActivations& la,
                              const Tensor& dy, Tensor& de, bool allgather) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  const int EP = shard_.ep_size;
  if (allgather) {
    // Every EP rank's output gradients; this rank's experts' slots of them, and their routing
    // weights' gradients, summed over the EP group into each rank's own.
    phase("moe-allgather");
    ep_group().all_gather(ms.ag_y, dy);
    phase("moe-unpermute-backward");
    for (int p = 0; p < EP; ++p) {
      Tensor dwp = ms.ag_dweight.view(p * N * K, {N, K});
      be().moe_unpermute_backward(de, dwp, ms.ag_y.view(p * N * C, {N, C}), mb.oute,
                                  mb.ag_row.view(p * N * K, {N, K}),
                                  mb.ag_weight.view(p * N * K, {N, K}));
    }
    phase("moe-reduce-scatter");
    ep_group().reduce_scatter(ms.dweight, ms.ag_dweight);
  } else {
    phase("moe-unpermute-backward");
    be().moe_unpermute_backward(ms.dout, ms.dweight, dy, mb.out, mb.row, mb.weight);
  }
}

// Each local expert's MLP backward: its weights' gradients, and its input gradients into de.
void MoeMlp::experts_backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                              Tensor& de) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  const int64_t C = cfg_.hidden_size;
  const int64_t efc1 = mb.fc1.dim(1), efl = mb.act.dim(1);
  const bool fp8 = s().fp8_layer(l);
  if (cfg_.moe_grouped_gemm && !fp8) {
    // fc2's backward for every block, the activation's over all rows, then fc1's (which
    // overwrites the output gradients fc2's backward has read).
    std::deque<Tensor> views;
    std::vector<Backend::GroupedGemm> g2, g1;
    std::vector<std::pair<int64_t, int64_t>> spans;  // (first row, rows) of each block with rows
    int64_t row = 0;
    for (size_t b = 0; b < mb.rows.size(); ++b) {
      const int64_t rows = mb.rows[b];
      if (rows == 0) continue;
      const size_t j = static_cast<size_t>(mb.block_expert[b]);
      Tensor& dout = views.emplace_back(de.view(row * C, {rows, C}));
      Tensor& dact = views.emplace_back(ms.dact.view(row * efl, {rows, efl}));
      Tensor& act = views.emplace_back(mb.act.view(row * efl, {rows, efl}));
      g2.push_back({&dact, &experts_g_[j].fc2_w, &act, &dout, &experts_w_[j].fc2_w});
      spans.emplace_back(row, rows);
      row += rows;
    }
    if (row > 0) {
      phase("moe-expert-fc2-gemm-backward");
      s().grouped_gemm_backward(g2);
      Tensor dact = ms.dact.view(0, {row, efl});
      Tensor dfc1 =
          spec_.activation == MlpActivation::SwiGLU ? ms.dfc1.view(0, {row, efc1}) : Tensor();
      const Tensor& d1 = activation_backward(phase, dact, dfc1, mb.fc1.view(0, {row, efc1}));
      const int64_t d1c = d1.dim(1);
      size_t k = 0;
      for (size_t b = 0; b < mb.rows.size(); ++b) {
        if (mb.rows[b] == 0) continue;
        const size_t j = static_cast<size_t>(mb.block_expert[b]);
        const auto [r0, rows] = spans[k++];
        Tensor& dx = views.emplace_back(de.view(r0 * C, {rows, C}));
        Tensor& d1b = views.emplace_back(d1.view(r0 * d1c, {rows, d1c}));
        Tensor& x = views.emplace_back(mb.xe.view(r0 * C, {rows, C}));
        g1.push_back({&dx, &experts_g_[j].fc1_w, &x, &d1b, &experts_w_[j].fc1_w});
      }
      phase("moe-expert-fc1-gemm-backward");
      s().grouped_gemm_backward(g1);
    }
  }
  if (cfg_.moe_grouped_gemm && !fp8) return;
  // One block at a time (FP8: each with its scales, the empty ones as in the forward).
  const bool empty_too = visits_empty_blocks(fp8, shard_.cp_size, s().fp8());
  const int e0 = shard_.experts_begin(cfg_.num_experts);
  int64_t row = 0;
  for (size_t b = 0; b < mb.rows.size(); ++b) {
    const int64_t rows = mb.rows[b];
    if (rows == 0 && !empty_too) continue;  // no token: no gradient (the weights' stay as they are)
    const int j = mb.block_expert[b];
    const MlpWeights& ew = experts_w_[static_cast<size_t>(j)];
    MlpWeights& eg = experts_g_[static_cast<size_t>(j)];  // gradients
    Tensor dout = de.view(row * C, {rows, C});
    Tensor dact = ms.dact.view(row * efl, {rows, efl});
    Tensor dfc1 = spec_.activation == MlpActivation::SwiGLU ? ms.dfc1.view(row * efc1, {rows, efc1})
                                                            : Tensor();
    const Tensor x = mb.xe.view(row * C, {rows, C});
    const Tensor fc1 = mb.fc1.view(row * efc1, {rows, efc1});
    const Tensor act = mb.act.view(row * efl, {rows, efl});
    phase("moe-expert-fc2-gemm-backward");
    s().linear_backward(l, Fp8Gemm::Fc2, &dact, eg.fc2_w, opt(eg.fc2_b), dout, act, ew.fc2_w,
                        e0 + j);
    const Tensor& d1 = rows > 0 ? activation_backward(phase, dact, dfc1, fc1)
                       : spec_.activation == MlpActivation::SwiGLU ? dfc1
                                                                   : dact;
    phase("moe-expert-fc1-gemm-backward");
    s().linear_backward(l, Fp8Gemm::Fc1, &dout, eg.fc1_w, opt(eg.fc1_b), d1, x, ew.fc1_w, e0 + j);
    row += rows;
  }
}

// The expert inputs' gradients (de) back to their tokens' ranks and into token order (a.dln).
void MoeMlp::dispatch_backward(PhaseSequence& phase, Activations& a, LayerActivations& la,
                               Tensor& de, bool allgather) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  const int64_t N = int64_t(a.B) * a.T, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  const bool ep = shard_.ep_size > 1;
  const int EP = shard_.ep_size;
  if (allgather) {
    // Each rank's tokens' input gradients from this rank's experts, summed over the EP group.
    phase("moe-permute-backward");
    for (int p = 0; p < EP; ++p) {
      Tensor dxp = ms.ag_y.view(p * N * C, {N, C});
      be().moe_permute_backward(dxp, de, mb.ag_row.view(p * N * K, {N, K}));
    }
    phase("moe-reduce-scatter");
    ep_group().reduce_scatter(a.dln, ms.ag_y);
  } else {
    if (ep) {
      phase("moe-combine-all-to-all");
      ep_group().all_to_all(de, mb.recv, ms.dout, mb.send, C);
    }
    phase("moe-permute-backward");
    be().moe_permute_backward(a.dln, ms.dout, mb.row);
  }
}

// The router's gradients: through the routing weights, the load-balancing loss and the z-loss.
void MoeMlp::router_grad(PhaseSequence& phase, Activations& a, LayerActivations& la) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
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
    const double c = mb.loss_scale * cfg_.moe_aux_loss_coeff * double(E) /
                     (double(K) * rows * rows * double(groups));
    aux_grad.resize(mb.routed.size());
    for (size_t i = 0; i < aux_grad.size(); ++i)
      aux_grad[i] = c * static_cast<double>(mb.routed[i]);
  }
  const double z_grad = mb.loss_scale * cfg_.moe_z_loss_coeff / (double(N) * shard_.cp_size);
  be().moe_router_backward(ms.dlogits, mb.logits, mb.expert, mb.weight, ms.dweight, routing_,
                           group_rows, aux_grad, z_grad);
  // This rank's rows: the router weight's gradient and their input gradient.
  Tensor dlogits = ms.dlogits.view(rb * E, {nl, E});
  if (compute() != DType::F32) {
    Tensor lc = ms.logits_c.view(rb * E, {nl, E});
    be().cast(lc, dlogits);
    dlogits = lc;
  }
  const Tensor x_mine = la.ln2.view(rb * C, {nl, C});
  Tensor dx_mine = ms.dx.view(rb * C, {nl, C}), dln_mine = a.dln.view(rb * C, {nl, C});
  s().gemm_backward(&dx_mine, router_g_, nullptr, dlogits, x_mine, router_w_);
  be().add(dln_mine, dln_mine, dx_mine);
}

void MoeMlp::backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                      const Tensor& dy) {
  MoeBuffers& mb = la.parts.get<MoeBuffers>();
  MoeScratch& ms = a.part_scratch.get<MoeScratch>();
  const int64_t C = cfg_.hidden_size;
  const bool shared = shared_ != nullptr, ep = shard_.ep_size > 1;
  if (shared) shared_->backward_into(phase, l, a, la, dy, ms.dx);  // the input gradient waits
  const bool allgather = ep && cfg_.moe_token_dispatcher_type == "allgather";
  Tensor de = ep ? ms.doute : ms.dout;  // the expert side's output gradients
  combine_backward(phase, a, la, dy, de, allgather);
  s().tp_reduce(phase, ms.dweight);  // each rank's expert outputs are partial sums over TP
  // The expert side's output gradients (sent to the experts' ranks with expert parallelism);
  // each block's rows become its input gradients once fc2's backward has read them.
  if (ep && !allgather) {
    phase("moe-dispatch-all-to-all");
    ep_group().all_to_all(ms.dout, mb.send, de, mb.recv, C);
  }
  experts_backward(phase, l, a, la, de);
  dispatch_backward(phase, a, la, de, allgather);
  if (shared) be().add(a.dln, a.dln, ms.dx);
  router_grad(phase, a, la);
}

}  // namespace tessera
