// predict.cpp: the step-time predictor (plan/predict.hpp; docs/planning.md, "The predicted step").
#include "plan/predict.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>

#include "core/dtype.hpp"
#include "model/params.hpp"
#include "plan/collectives.hpp"
#include "run/context_parallel.hpp"
#include "run/layout.hpp"
#include "run/memory_estimate.hpp"
#include "run/muon_plan.hpp"
#include "run/pipeline.hpp"

namespace tessera {

namespace {

// A group of `n` ranks `stride` apart in the rank order (TP fastest, then CP, DP, PP): inside one
// node when it spans at most a node's GPUs; else over the network, whose per-GPU links the
// group's ranks on one node use together (NCCL's rings over every NIC), up to NVLink's rate.
struct Link {
  double bw = 0, lat = 0;  // bytes/s, seconds
};
Link link_of(const ClusterSpec& c, int stride, int n) {
  const int G = c.gpus_per_node;
  if (int64_t(stride) * n <= G)
    return {c.intra_node.bandwidth_gbs * 1e9, c.intra_node.latency_us * 1e-6};
  const int per_node = std::max(1, std::min(n, G / std::max(1, stride)));
  return {std::min(c.intra_node.bandwidth_gbs, per_node * c.inter_node.bandwidth_gbs) * 1e9,
          c.inter_node.latency_us * 1e-6};
}
// Ring collectives (NCCL's Ring/Simple: (n-1) or 2(n-1) steps), `bytes` the whole buffer.
double all_reduce(const Link& l, int n, double bytes) {
  return n <= 1 ? 0 : 2.0 * (n - 1) / n * bytes / l.bw + 2.0 * (n - 1) * l.lat;
}
double all_gather(const Link& l, int n, double bytes) {  // also reduce-scatter and all-to-all
  return n <= 1 ? 0 : double(n - 1) / n * bytes / l.bw + (n - 1) * l.lat;
}

// One micro-batch through one layer on one rank (seconds).
struct LayerTime {
  double fwd = 0, bwd = 0, recompute = 0;  // compute
  // Exposed communication: TP/SP and EP of the forward and of the backward (its recomputation's
  // calls included), the CP ring's beyond the attention it overlaps, forward + backward.
  double tp_fwd = 0, tp_bwd = 0, ep_fwd = 0, ep_bwd = 0, cp = 0;
  double once = 0;         // the TP sums of partial gradients, once a step (last micro-batch)
  double model_flops = 0;  // forward + backward, without recomputation
  double wgrad = 0;        // of bwd, the GEMMs' weight halves (zero-bubble's W pass)
};

// The time of a planned call (plan/collectives.hpp) over `link` in a group of `n`: ring
// all-reduce, or one pass of the buffer for the gathers, reduce-scatters and all-to-alls.
double call_time(const PlannedCall& c, const Link& link, int n) {
  const double bytes = double(c.elements) * c.bytes;
  return c.op == "all_reduce" ? all_reduce(link, n, bytes) : all_gather(link, n, bytes);
}

struct Model {
  const GPTConfig& cfg;
  const TrainConfig& t;
  const GridLayout& layout;
  int ep;
  const ClusterSpec& cluster;
  const GpuRates& rates;
  double wb = 2;  // bytes per activation element
  double N = 0;   // tokens of a micro-batch on a rank (S / CP per sample)
  double S = 0;   // the sequence
  Link tp_link, cp_link, ep_link, pp_link, grad_link, edp_link;

  // The calls of `group` among `calls`, timed; CP's ring as the bytes it moves and its steps.
  double calls_time(const CallList& calls, const std::string& group) const {
    double s = 0;
    for (const PlannedCall& c : calls)
      if (c.group == group)
        s += group == "tp" ? call_time(c, tp_link, layout.tp) : call_time(c, ep_link, ep);
    return s;
  }
  static std::pair<double, int> ring(const CallList& calls) {
    double bytes = 0;
    int steps = 0;
    for (const PlannedCall& c : calls)
      if (c.group == "cp") bytes += double(c.elements) * c.bytes, ++steps;
    return {bytes, steps};
  }

  double gemm_time(double flops, double width) const {
    return flops / (rates.gemm(width, t.fp8.enabled) * 1e12);
  }
  double memory_time(double bytes) const { return bytes / (rates.memory_tbs * 1e12); }
  double elementwise_time(double bytes) const { return bytes / (rates.elementwise_tbs * 1e12); }

  // The layer's GEMMs, from its parameter specs on this TP rank: 2 N x weight FLOPs forward (a
  // routed expert's K copies of each token: 2 N K x one expert's weight), twice that backward.
  // Its communication: the calls the collective plan lists for it (the same the model issues).
  LayerTime layer(int index, const std::vector<const ParamSpec*>& weights, bool moe,
                  const PieceCalls& plan) const {
    LayerTime l;
    double gemm_flops = 0;
    for (const ParamSpec* s : weights) {
      const double numel = double(s->numel());
      const double last = double(s->local_shape.back());
      const double width = std::min(last, numel / last);
      const double rows = s->expert ? N * cfg.moe_router_topk : N;
      const double f = 2.0 * rows * numel;
      gemm_flops += f;
      const double g = s->expert ? f / (rates.grouped_gemm * 1e12) : gemm_time(f, width);
      l.fwd += g;
      l.bwd += 2 * g;
      l.wgrad += g;
    }
    if (moe) {  // routing, and the token copies' permutation and its inverse (read and write)
      const double copies = memory_time(4.0 * wb * N * cfg.moe_router_topk * cfg.hidden_size);
      l.fwd += N * rates.routing_ns * 1e-9 + copies;
      l.bwd += 2 * copies;
    }
    // The attention core: causal, each of this rank's N queries against the sample's keys.
    const double heads = double(cfg.num_attention_heads) / layout.tp;
    const double attn = 2.0 * t.micro_batch_size * (S / layout.cp) * S * heads *
                        (cfg.head_dim() + cfg.value_dim()) / 2;
    const double attn_fwd = attn / (rates.attention_forward * 1e12);
    const double attn_bwd = 2.5 * attn / (rates.attention_backward * 1e12);
    l.fwd += attn_fwd;
    l.bwd += attn_bwd;
    l.model_flops = 3 * gemm_flops + 3.5 * attn;
    // Memory-bound passes, the fewest bytes Tessera's kernels move: forward, the first norm's
    // read and write, the fused residual add + second norm (two reads, two writes), the
    // activation's read and write of the MLP's width; backward twice that.
    const double sp = t.sequence_parallel ? layout.tp : 1;
    const double width = moe ? double(cfg.moe_router_topk) * cfg.moe_ffn() : cfg.ffn();
    const double elem =
        elementwise_time(wb * N * (8.0 * cfg.hidden_size / sp + 2.0 * width / layout.tp));
    l.fwd += elem;
    l.bwd += 2 * elem;
    // Tensor/sequence and expert parallelism: the layer's planned calls, forward and backward
    // (the backward's own recomputation included), and the once-a-step sums.
    const CallList fwd = plan.layer_forward(index), bwd = plan.layer_backward(index, false);
    l.tp_fwd = calls_time(fwd, "tp");
    l.ep_fwd = calls_time(fwd, "ep");
    l.tp_bwd = calls_time(bwd, "tp");
    l.ep_bwd = calls_time(bwd, "ep");
    l.once = calls_time(plan.layer_backward(index, true), "tp") - l.tp_bwd;
    // Context parallelism: the K/V ring beside the attention core; what it takes beyond it.
    if (layout.cp > 1) {
      const auto [f_bytes, f_steps] = ring(fwd);
      const auto [b_bytes, b_steps] = ring(bwd);
      l.cp = std::max(0.0, f_bytes / cp_link.bw + f_steps * cp_link.lat - attn_fwd) +
             std::max(0.0, b_bytes / cp_link.bw + b_steps * cp_link.lat - attn_bwd);
    }
    switch (t.recompute.granularity) {
      case RecomputeGranularity::Full:
        l.recompute = l.fwd;
        break;
      case RecomputeGranularity::Selective:
        l.recompute = attn_fwd;
        break;
      default:
        break;
    }
    return l;
  }
};

// One pipeline stage's rank: its forward and backward step per model chunk (one micro-batch, the
// communication inside them included), its compute over the step, the communication of each kind,
// the model FLOPs and the data-parallel collectives after its last backward.
struct StageCost {
  std::vector<double> F, B;
  // Zero-bubble: of each B, the W pass's share (the GEMMs' weight halves), and the B passes whose
  // W operands the stage holds (run/memory_estimate.hpp's zero_bubble_hold; 0: whole backwards).
  std::vector<double> W;
  int held = 0;
  double copy = 0;  // a B pass's copies of its W operands (read and written once), seconds
  StepPrediction::Stage compute;
  double tp = 0, cp = 0, ep = 0, flops = 0, dp_grad = 0, dp_param = 0;
  double fsdp = 0;  // Megatron-FSDP's units' gathers and reduce-scatters, every micro-batch
  double dp_grad_after = 0, dp_param_after = 0;  // HSDP's sums across the instances
  double once = 0;  // the TP sums of partial gradients after the last backward
};

// The data-parallel collectives of a stage's rank (the gradients' reduction and the weights'
// gather after the step, Megatron-FSDP's units every micro-batch inside the chunks' steps, HSDP's
// sums across the instances) and its optimizer pass over the parameters.
void data_parallel_cost(const Model& m, const ModelShard& shard,
                        const std::vector<ParamSpec>& specs, double dense, double experts,
                        int micro, StageCost& st) {
  const GPTConfig& cfg = m.cfg;
  const TrainConfig& t = m.t;
  const int TP = m.layout.tp, CP = m.layout.cp, DP = m.layout.dp, ep = m.ep;
  const int V = std::max(1, t.virtual_pipeline_size);
  // Data parallelism: the f32 gradients reduced over DP x CP (experts' over their
  // expert-data-parallel group), reduce-scattered with the distributed optimizer, whose updated
  // bf16 weights are then all-gathered. A group with nothing to reduce issues no collective.
  const double dense_grad = 4 * dense, expert_grad = 4 * experts;
  const int gn = DP * CP, en = std::max(1, DP / ep) * CP;
  auto ag = [](const Link& l, int n, double bytes) {
    return bytes > 0 ? all_gather(l, n, bytes) : 0;
  };
  auto ar = [](const Link& l, int n, double bytes) {
    return bytes > 0 ? all_reduce(l, n, bytes) : 0;
  };
  // HSDP (--num-distributed-optimizer-instances N): reduce-scattered and gathered inside one
  // instance of gn / N consecutive ranks, the shard then summed across the N instances
  // (all-reduce; reduce-scatter, and the updated cut gathered back, with outer optimizer
  // sharding).
  const int N = t.use_distributed_optimizer ? t.dist_opt_instances : 1;
  const bool split = N > 1 && t.outer_dp_shards_optim;
  const int gi = gn / N, ei = std::max(1, en / N);
  const Link inner = N > 1 ? link_of(m.cluster, TP, gi) : m.grad_link;
  const Link einner = N > 1 ? link_of(m.cluster, TP * CP * ep, ei) : m.edp_link;
  // Megatron-FSDP's units (step/fsdp.hpp): every micro-batch, each unit of a chunk gathered
  // before its forward and again before its backward (optim_grads_params; full recomputation a
  // third time) in the compute dtype, and reduce-scattered in f32 after its backward
  // (optim_grads and up), over the shard group; what the chunk's compute does not hide is
  // exposed inside the chunk's steps.
  const bool unit_grads = t.fsdp_shards_grads(), unit_params = t.fsdp_shards_params();
  if (unit_grads) {
    std::vector<double> chunk_dense(size_t(V), 0.0), chunk_experts(size_t(V), 0.0);
    for (const ParamSpec& sp : specs) {
      int layer = -1, chunk = shard.num_chunks() - 1;  // the head's units: the last chunk
      if (std::sscanf(sp.name.c_str(), "layers.%d.", &layer) == 1) {
        for (int c = 0; c < shard.num_chunks(); ++c)
          if (layer >= shard.chunks[size_t(c)].begin && layer < shard.chunks[size_t(c)].end)
            chunk = c;
      } else if (sp.name == "wte" || sp.name == "wpe") {
        chunk = 0;
      }
      if (sp.expert)
        chunk_experts[size_t(chunk)] += double(sp.numel()) * shard.experts_local(cfg.num_experts);
      else
        chunk_dense[size_t(chunk)] += double(sp.numel());
    }
    // Each piece's gather starts as the piece before it in the pass starts (FsdpLedger's
    // prefetch) and each reduce-scatter behind the next piece's backward, all in order on the
    // shard group's stream: over a chunk's pass the calls hide under its compute but for the
    // pass's first piece's gather (the chunk's pieces taken as equal). Full recomputation's
    // second gathers are not prefetched.
    const double again = t.recompute.granularity == RecomputeGranularity::Full ? 1 : 0;
    for (int c = 0; c < V; ++c) {
      const LayerRange& r = shard.chunks[size_t(c)];
      const double pieces = std::max(1, r.end - r.begin + (c == 0 && shard.has_embedding) +
                                            (c == V - 1 && shard.head_piece()));
      const double d = chunk_dense[size_t(c)], e = chunk_experts[size_t(c)];
      const double gather = unit_params ? ag(inner, gi, m.wb * d) + ag(einner, ei, m.wb * e) : 0;
      const double reduce = ag(inner, gi, 4 * d) + ag(einner, ei, 4 * e);
      const double first = gather / pieces;
      const double fwd = first + std::max(0.0, gather - first - st.F[size_t(c)]);
      const double bwd =
          first + again * gather + std::max(0.0, gather - first + reduce - st.B[size_t(c)]);
      st.F[size_t(c)] += fwd;
      st.B[size_t(c)] += bwd;
      st.fsdp += micro * (fwd + bwd);
    }
  }
  if (t.use_distributed_optimizer) {
    // The step's reduction and gather, unless FSDP's units do them every micro-batch.
    st.dp_grad = unit_grads ? 0 : ag(inner, gi, dense_grad) + ag(einner, ei, expert_grad);
    st.dp_param = unit_params ? 0 : ag(inner, gi, m.wb * dense) + ag(einner, ei, m.wb * experts);
    if (N > 1) {
      const Link outer = link_of(m.cluster, TP * gi, N);
      const Link eouter = link_of(m.cluster, TP * CP * ep * ei, N);
      const double cut = dense_grad / gi, ecut = expert_grad / ei;
      // After the whole reduction (DistributedAdamW::reduce_replicas) and inside the optimizer
      // step (gather_replicas): not overlapped.
      st.dp_grad_after =
          split ? ag(outer, N, cut) + ag(eouter, N, ecut) : ar(outer, N, cut) + ar(eouter, N, ecut);
      if (split)
        st.dp_param_after = ag(outer, N, m.wb * dense / gi) + ag(eouter, N, m.wb * experts / ei);
    }
  } else {
    st.dp_grad = ar(m.grad_link, gn, dense_grad) + ar(m.edp_link, en, expert_grad);
  }
  const double owned = !t.use_distributed_optimizer ? dense + experts
                       : split                      ? dense / gn + experts / en
                                                    : dense / gi + experts / ei;
  // Tessera's passes over the parameters each step: Adam on its shard (the f32 master weight,
  // gradient and two moments read, three written: 28 bytes a parameter), the bf16 copy cast
  // (4 read, 2 written), the gradient norm's read and the gradients' zeroing (4 each).
  st.compute.optimizer = m.memory_time(28 * owned + 14 * (dense + experts));
}

// The shard of pipeline stage s's first rank in `layout` (EP carved out of its DP).
ModelShard stage_shard(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout, int ep,
                       int s) {
  ParallelContext ctx;
  ctx.tp_size = layout.tp;
  ctx.pp_size = layout.pp;
  ctx.pp_rank = s;
  ctx.cp_size = layout.cp;
  ctx.ep_size = ep;
  return make_model_shard(cfg, ctx, t);
}

StageCost stage_cost(const Model& m, int s, int micro, const PieceCalls& plan) {
  const GPTConfig& cfg = m.cfg;
  const TrainConfig& t = m.t;
  const GridLayout& layout = m.layout;
  const int TP = layout.tp, CP = layout.cp, DP = layout.dp, ep = m.ep;
  const int V = std::max(1, t.virtual_pipeline_size);
  StageCost st;
  st.F.assign(size_t(V), 0.0);
  st.B.assign(size_t(V), 0.0);
  st.W.assign(size_t(V), 0.0);
  const ModelShard shard = stage_shard(cfg, t, layout, ep, s);
  const std::vector<ParamSpec> specs = counted_param_specs(cfg, shard);
  std::map<int, std::vector<const ParamSpec*>> by_layer;
  double dense = 0, experts = 0;
  for (const ParamSpec& sp : specs) {
    if (sp.expert)
      experts += double(sp.numel()) * shard.experts_local(cfg.num_experts);
    else
      dense += double(sp.numel());
    int layer = -1;
    if (std::sscanf(sp.name.c_str(), "layers.%d.", &layer) != 1) continue;
    if (sp.local_shape.size() >= 2 && sp.weight_decay) by_layer[layer].push_back(&sp);
  }
  // The calls of this stage's first rank (plan/collectives.hpp): the same on every rank of the
  // stage but for peers and all-to-all sizes.
  // The calls of a rank at the first position of its groups (plan/collectives.hpp): the same on
  // every rank of the stage but for peers and all-to-all sizes.
  auto add_layer = [&](int l, int chunk) {
    const LayerTime lt = m.layer(l, by_layer[l], cfg.is_moe_layer(l), plan);
    st.F[size_t(chunk)] += lt.fwd + lt.tp_fwd + lt.ep_fwd + lt.cp / 2;
    st.B[size_t(chunk)] += lt.bwd + lt.recompute + lt.tp_bwd + lt.ep_bwd + lt.cp / 2;
    st.W[size_t(chunk)] += lt.wgrad;
    st.compute.weight += micro * lt.wgrad;
    st.compute.forward += micro * lt.fwd;
    st.compute.backward += micro * lt.bwd;
    st.compute.recompute += micro * lt.recompute;
    st.tp += micro * (lt.tp_fwd + lt.tp_bwd) + lt.once;
    st.ep += micro * (lt.ep_fwd + lt.ep_bwd);
    st.cp += micro * lt.cp;
    st.once += lt.once;
    st.flops += micro * lt.model_flops;
  };
  for (int c = 0; c < shard.num_chunks(); ++c)
    for (int l = shard.chunks[size_t(c)].begin; l < shard.chunks[size_t(c)].end; ++l)
      add_layer(l, c);
  // The first stage's embedding (its TP all-reduce), the last's output layer, cross-entropy and
  // multi-token prediction's layers.
  const double M = m.wb * m.N * cfg.hidden_size;  // one micro-batch's hidden state
  if (shard.has_embedding) {
    const double e = m.calls_time(plan.embed_forward(), "tp");
    const double eb = m.calls_time(plan.embed_backward(), "tp");
    st.F[0] += e + m.memory_time(2 * M);
    st.B[0] += eb;
    st.tp += micro * (e + eb);
  }
  if (shard.head_piece()) {  // the loss, multi-token prediction, or both
    const int last = shard.num_chunks() - 1;
    const double V_local = double(cfg.padded_vocab_size(TP)) / TP;
    const double heads = (shard.has_head ? 1 : 0) + shard.mtp_count;
    // The recorded head piece holds the loss and multi-token prediction's depths: a stage with
    // only the latter issues their share of its calls.
    const double share = heads / (1.0 + cfg.mtp_num_layers * (cfg.mtp() ? 1 : 0));
    const double f = 2.0 * m.N * cfg.hidden_size * V_local;
    // The logits GEMM (twice its FLOPs backward); cross-entropy reads the logits once forward,
    // reads them and writes their gradient backward.
    const double gemm = m.gemm_time(f, cfg.hidden_size),
                 pass = m.elementwise_time(m.N * V_local * m.wb);
    const double head_fwd = heads * (gemm + pass), head_bwd = heads * (2 * gemm + 2 * pass);
    // The head piece's calls: multi-token prediction's layers included (theirs are the head's).
    const CallList hf = plan.head_forward(), hb = plan.head_backward(false);
    const double comm_fwd = share * m.calls_time(hf, "tp"),
                 comm_bwd = share * m.calls_time(hb, "tp");
    const double ep_fwd = share * m.calls_time(hf, "ep"), ep_bwd = share * m.calls_time(hb, "ep");
    const double once = share * m.calls_time(plan.head_backward(true), "tp") - comm_bwd;
    st.F[size_t(last)] += head_fwd + comm_fwd + ep_fwd;
    st.B[size_t(last)] += head_bwd + comm_bwd + ep_bwd;
    st.W[size_t(last)] += heads * gemm;
    st.compute.weight += micro * heads * gemm;
    st.tp += micro * (comm_fwd + comm_bwd) + once;
    st.ep += micro * (ep_fwd + ep_bwd);
    st.once += once;
    st.compute.forward += micro * head_fwd;
    st.compute.backward += micro * head_bwd;
    st.flops += micro * heads * 3 * f;
    for (int l = shard.mtp_begin; l < shard.mtp_begin + shard.mtp_count; ++l) add_layer(l, last);
  }
  data_parallel_cost(m, shard, specs, dense, experts, micro, st);
  const int gn = DP * CP,
            gi = gn / std::max(1, t.use_distributed_optimizer ? t.dist_opt_instances : 1);
  if (t.optimizer == "muon") {  // Newton-Schulz's GEMMs (step/muon.hpp) and Muon's TP calls
    double ns = 0;
    for (const MuonMatrix& mm : plan_muon_matrices(specs, TP, t.muon.split_qkv)) {
      const MuonNsShape shape = muon_ns_shape(mm, TP, t.muon.tp_mode);  // what Muon iterates on
      const double g = double(shape.wide ? shape.rows : shape.cols);    // the Gram matrix's side
      const double o = double(shape.wide ? shape.cols : shape.rows);
      const double copies = mm.name.find(".experts.") != std::string::npos
                                ? shard.experts_local(cfg.num_experts)
                                : 1;  // counted specs hold a layer's first expert
      ns += copies * m.gemm_time(t.muon.ns_steps * 2.0 * (2 * g * g * o + g * g * g), g);
      if (shape.gathered)  // the matrix gathered whole over TP (f32)
        ns += copies * all_gather(m.tp_link, TP, 4.0 * double(mm.numel()) * TP);
    }
    // Over the distributed optimizer the matrices are dealt to the DP x CP ranks (of one
    // instance with HSDP), the buckets' direction gathered and updates reduce-scattered (f32).
    const Link shard_link = gi < gn ? link_of(m.cluster, TP, gi) : m.grad_link;
    st.compute.optimizer += t.use_distributed_optimizer && gi > 1
                                ? ns / gi + 2 * all_gather(shard_link, gi, 4 * dense)
                                : ns;
  }
  return st;
}

// The pipeline: each rank runs its schedule's steps in order; a forward needs the previous
// virtual stage's forward of that micro-batch (and its send, `p2p` seconds), a backward the next
// one's; zero-bubble's W pass needs nothing (its B ran before it on the rank), and a stage that
// splits its backwards sends B's gradient before its W. Each rank's finish time and busy time.
void simulate_pipeline(const std::vector<StageCost>& cost, int V, int micro, double p2p,
                       bool zero_bubble, std::vector<double>& finish, std::vector<double>& busy) {
  const int PP = static_cast<int>(cost.size()), stages = PP * V;
  std::vector<std::vector<PipeStep>> order(static_cast<size_t>(PP));
  for (int s = 0; s < PP; ++s)
    order[size_t(s)] = zero_bubble ? schedule_zero_bubble(PP, s, micro, V, cost[size_t(s)].held)
                                   : schedule_interleaved(PP, s, micro, V);
  // When (forward, micro-batch, virtual stage) finished; negative: not yet.
  std::vector<double> done(size_t(2) * size_t(micro) * size_t(stages), -1.0);
  auto at = [&](bool forward, int mb, int vs) -> double& {
    return done[(size_t(forward) * size_t(micro) + size_t(mb)) * size_t(stages) + size_t(vs)];
  };
  std::vector<size_t> next(static_cast<size_t>(PP), 0);
  finish.assign(size_t(PP), 0.0);
  busy.assign(size_t(PP), 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < PP; ++s)
      while (next[size_t(s)] < order[size_t(s)].size()) {
        const PipeStep& st = order[size_t(s)][next[size_t(s)]];
        const StageCost& c = cost[size_t(s)];
        const bool split = zero_bubble && c.held > 0;
        if (st.weight) {  // zero-bubble's W: local work
          const double d = c.W[size_t(st.chunk)];
          finish[size_t(s)] += d;
          busy[size_t(s)] += d;
          ++next[size_t(s)];
          progress = true;
          continue;
        }
        const int vs = st.chunk * PP + s;
        double ready = 0;
        if (st.forward ? vs > 0 : vs < stages - 1) {
          const double prev = at(st.forward, st.micro, st.forward ? vs - 1 : vs + 1);
          if (prev < 0) break;
          ready = prev + p2p;
        }
        const double d = st.forward ? c.F[size_t(st.chunk)]
                         : split    ? c.B[size_t(st.chunk)] - c.W[size_t(st.chunk)] + c.copy
                                    : c.B[size_t(st.chunk)];
        finish[size_t(s)] = std::max(finish[size_t(s)], ready) + d;
        busy[size_t(s)] += d;
        at(st.forward, st.micro, vs) = finish[size_t(s)];
        ++next[size_t(s)];
        progress = true;
      }
  }
}

}  // namespace

StepPrediction predict_step(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                            int ep, const ClusterSpec& cluster, const GpuRates& rates,
                            PieceCallsCache* cache) {
  Model m{cfg, t, layout, ep, cluster, rates};
  m.wb = dtype_size(t.compute_dtype);
  m.S = cfg.seq_length;
  m.N = double(t.micro_batch_size) * cfg.seq_length / layout.cp;
  const int TP = layout.tp, CP = layout.cp, DP = layout.dp, PP = layout.pp;
  m.tp_link = link_of(cluster, 1, TP);
  m.cp_link = link_of(cluster, TP, CP);
  m.ep_link = link_of(cluster, TP * CP, ep);
  m.pp_link = link_of(cluster, TP * CP * DP, PP);
  m.grad_link = link_of(cluster, TP, CP * DP);
  m.edp_link = link_of(cluster, TP * CP * ep, std::max(1, DP / ep) * CP);
  const int V = std::max(1, t.virtual_pipeline_size);
  const int micro = t.num_micro_batches(DP);
  StepPrediction p;
  p.micro_batches = micro;
  std::vector<StageCost> cost;
  PieceCallsCache own;
  const PieceCalls& calls = (cache ? *cache : own).get(cfg, t, layout, ep);
  std::map<std::string, StageCost> by_shape;
  // Zero-bubble: by shape and slots, the W passes held and one pass's bytes.
  std::map<std::pair<std::string, int>, ZeroBubbleHold> held;
  for (int s = 0; s < PP; ++s) {
    const std::string key = pipeline_stage_shape(cfg, t, layout, ep, s);
    auto it = by_shape.find(key);
    if (it == by_shape.end()) it = by_shape.emplace(key, stage_cost(m, s, micro, calls)).first;
    cost.push_back(it->second);
    if (t.zero_bubble && PP > 1) {  // the W operands it may hold: its shape and position's
      const int slots = V > 1 ? 0 : pipeline_slots(PP, s, micro);
      auto h = held.find({key, V > 1 ? s : slots});
      if (h == held.end())
        h = held.emplace(std::make_pair(key, V > 1 ? s : slots),
                         zero_bubble_hold(cfg, stage_shard(cfg, t, layout, ep, s), t, PP, s, micro,
                                          cfg.seq_length / CP))
                .first;
      cost.back().held = h->second.passes;
      cost.back().copy = h->second.passes > 0 ? m.memory_time(2 * h->second.mean_pass_bytes) : 0;
    }
  }
  const double M = m.wb * m.N * cfg.hidden_size;
  const double send =
      PP > 1 ? M / (t.sequence_parallel ? TP : 1) / m.pp_link.bw + m.pp_link.lat : 0;
  std::vector<double> finish, busy, finish0, busy0;
  simulate_pipeline(cost, V, micro, send, t.zero_bubble, finish, busy);
  simulate_pipeline(cost, V, micro, 0, t.zero_bubble, finish0, busy0);
  // Each stage's gradient reduce overlaps its last micro-batch's backward (--overlap-grad-reduce)
  // and the parameter gather the next forward (--overlap-param-gather); the rest is exposed.
  double step = 0, makespan = 0, makespan0 = 0;
  for (int s = 0; s < PP; ++s) {
    makespan = std::max(makespan, finish[size_t(s)]);
    makespan0 = std::max(makespan0, finish0[size_t(s)]);
  }
  for (int s = 0; s < PP; ++s) {
    const StageCost& c = cost[size_t(s)];
    // Split backwards complete the gradients in the last W pass, which the reduction overlaps.
    const double last_backward = t.zero_bubble && c.held > 0 ? c.W[0] : c.B[0];
    const double g =
        std::max(0.0, c.dp_grad - (t.overlap_grad_reduce ? last_backward : 0)) + c.dp_grad_after;
    const double a =
        std::max(0.0, c.dp_param - (t.overlap_param_gather ? c.F[0] : 0)) + c.dp_param_after;
    const double end = finish[size_t(s)] + c.once + g + a + c.compute.optimizer;
    if (end > step) {
      step = end;
      p.critical_stage = s;
      p.dp_grad = g;
      p.dp_param = a;
    }
  }
  if (PP > 1) {
    p.schedule = t.zero_bubble ? "zero-bubble (ZB-H1), W operands held per stage:"
                 : V > 1       ? "interleaved 1F1B, " + std::to_string(V) + " model chunks per rank"
                               : "1F1B";
    if (t.zero_bubble)
      for (const StageCost& sc : cost) p.schedule += " " + std::to_string(sc.held);
  }
  const StageCost& c = cost[size_t(p.critical_stage)];
  p.step = step;
  p.bubble = std::max(0.0, makespan0 - busy0[size_t(p.critical_stage)]);
  p.pp = makespan - makespan0;
  p.tp = c.tp;
  p.cp = c.cp;
  p.ep = c.ep;
  p.fsdp = c.fsdp;
  p.exposed_comm = p.tp + p.pp + p.dp_grad + p.dp_param + p.cp + p.ep + p.fsdp;
  double model_flops = 0;
  for (const StageCost& sc : cost) {
    model_flops += sc.flops;
    p.stages.push_back(sc.compute);
  }
  p.tflops_per_gpu = model_flops / PP / step / 1e12;
  p.mfu = p.tflops_per_gpu / cluster.bf16_tflops;
  p.tokens_per_s = double(t.global_batch(DP)) * cfg.seq_length / step;
  return p;
}

std::string prediction_report(const StepPrediction& p, const ClusterSpec& cluster,
                              const GpuRates& rates) {
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "predicted step on %s, from Tessera's rates (%s, %s): %d micro-batches per step\n",
                cluster.name.c_str(), rates.gpu.c_str(), rates.file.c_str(), p.micro_batches);
  out += buf;
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const auto& st = p.stages[s];
    std::snprintf(
        buf, sizeof buf,
        "  stage %zu compute per step: forward %.3f s, backward %.3f s, recompute %.3f s, "
        "optimizer %.3f s%s\n",
        s, st.forward, st.backward, st.recompute, st.optimizer,
        int(s) == p.critical_stage ? " (the stage that finishes last)" : "");
    out += buf;
  }
  if (!p.schedule.empty()) out += "  pipeline schedule: " + p.schedule + "\n";
  std::snprintf(buf, sizeof buf,
                "  pipeline bubble %.3f s; exposed communication %.3f s: TP/SP %.3f, pipeline "
                "send/recv %.3f, DP gradient reduce %.3f, DP parameter gather %.3f, CP ring %.3f, "
                "EP all-to-all %.3f, FSDP units %.3f\n",
                p.bubble, p.exposed_comm, p.tp, p.pp, p.dp_grad, p.dp_param, p.cp, p.ep, p.fsdp);
  out += buf;
  std::snprintf(buf, sizeof buf,
                "predicted: step %.4g s | tokens/s %.0f | TFLOP/s/GPU %.1f | MFU %.1f %% | bubble "
                "%.1f %% | exposed comm %.1f %%\n",
                p.step, p.tokens_per_s, p.tflops_per_gpu, 100 * p.mfu, 100 * p.bubble / p.step,
                100 * p.exposed_comm / p.step);
  out += buf;
  return out;
}

std::string pipeline_stage_shape(const GPTConfig& cfg, const TrainConfig& t,
                                 const GridLayout& layout, int ep, int s) {
  const ModelShard shard = stage_shard(cfg, t, layout, ep, s);
  std::string key;
  for (const LayerRange& r : shard.chunks) {
    key += '[';
    for (int l = r.begin; l < r.end; ++l)
      key += char('a' + 2 * cfg.is_moe_layer(l) +
                  (t.fp8.enabled && t.fp8.layer_in_fp8(l, cfg.num_layers)));
    key += ']';
  }
  key += shard.has_embedding ? "E" : "";
  key += shard.has_head ? "L" : "";
  key += std::to_string(shard.mtp_count);
  return key;
}

}  // namespace tessera
