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
#include "train/context_parallel.hpp"
#include "train/layout.hpp"
#include "train/pipeline.hpp"

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
  double tp = 0, cp = 0, ep = 0;           // exposed communication, forward + backward
  double recompute_comm = 0;               // the TP/EP communication a full recompute repeats
  double model_flops = 0;                  // forward + backward, without recomputation
};

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

  double gemm_time(double flops, double width) const {
    return flops / (rates.gemm(width, t.fp8.enabled) * 1e12);
  }
  double memory_time(double bytes) const { return bytes / (rates.memory_tbs * 1e12); }

  // The layer's GEMMs, from its parameter specs on this TP rank: 2 N x weight FLOPs forward (a
  // routed expert's K copies of each token: 2 N K x one expert's weight), twice that backward.
  LayerTime layer(const std::vector<const ParamSpec*>& weights, bool moe) const {
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
        memory_time(wb * N * (8.0 * cfg.hidden_size / sp + 2.0 * width / layout.tp));
    l.fwd += elem;
    l.bwd += 2 * elem;
    // Tensor parallelism: two all-reduces of the layer's hidden state forward and two backward
    // (with sequence parallelism an all-gather and a reduce-scatter each instead).
    const double M = wb * N * cfg.hidden_size;
    const int T = layout.tp;
    const double tp_one =
        t.sequence_parallel ? 2 * all_gather(tp_link, T, M) : all_reduce(tp_link, T, M);
    l.tp = 4 * tp_one;
    // Expert parallelism: the dispatch and combine all-to-alls of N K copies, forward and backward.
    if (moe && ep > 1)
      l.ep = 4 * all_gather(ep_link, ep, wb * N * cfg.moe_router_topk * cfg.hidden_size);
    // Context parallelism: the K/V ring beside the attention core; what it takes beyond it.
    if (layout.cp > 1) {
      const RingTraffic ring = cp_ring_traffic(cfg, t, layout.tp, layout.cp);
      const double steps = layout.cp - 1;
      l.cp = std::max(0.0, ring.forward / cp_link.bw + steps * cp_link.lat - attn_fwd) +
             std::max(0.0, ring.backward / cp_link.bw + 2 * steps * cp_link.lat - attn_bwd);
    }
    switch (t.recompute.granularity) {
      case RecomputeGranularity::Full:
        l.recompute = l.fwd;
        l.recompute_comm = (l.tp + l.ep) / 2;
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
  StepPrediction::Stage compute;
  double tp = 0, cp = 0, ep = 0, flops = 0, dp_grad = 0, dp_param = 0;
};

StageCost stage_cost(const Model& m, int s, int micro) {
  const GPTConfig& cfg = m.cfg;
  const TrainConfig& t = m.t;
  const GridLayout& layout = m.layout;
  const int TP = layout.tp, CP = layout.cp, DP = layout.dp, ep = m.ep;
  const int V = std::max(1, t.virtual_pipeline_size);
  StageCost st;
  st.F.assign(size_t(V), 0.0);
  st.B.assign(size_t(V), 0.0);
  ParallelContext ctx;
  ctx.tp_size = TP;
  ctx.pp_size = layout.pp;
  ctx.pp_rank = s;
  ctx.cp_size = CP;
  ctx.ep_size = ep;
  const ModelShard shard = make_model_shard(cfg, ctx, t.sequence_parallel, t.virtual_pipeline_size);
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
  const bool full = t.recompute.granularity == RecomputeGranularity::Full;
  auto add_layer = [&](int l, int chunk) {
    const LayerTime lt = m.layer(by_layer[l], cfg.is_moe_layer(l));
    st.F[size_t(chunk)] += lt.fwd + (lt.tp + lt.ep + lt.cp) / 2;
    st.B[size_t(chunk)] += lt.bwd + lt.recompute + (lt.tp + lt.ep + lt.cp) / 2 + lt.recompute_comm;
    st.compute.forward += micro * lt.fwd;
    st.compute.backward += micro * lt.bwd;
    st.compute.recompute += micro * lt.recompute;
    st.tp += micro * (lt.tp + (full ? lt.tp / 2 : 0));
    st.ep += micro * (lt.ep + (full ? lt.ep / 2 : 0));
    st.cp += micro * lt.cp;
    st.flops += micro * lt.model_flops;
  };
  for (int c = 0; c < shard.num_chunks(); ++c)
    for (int l = shard.chunks[size_t(c)].begin; l < shard.chunks[size_t(c)].end; ++l)
      add_layer(l, c);
  // The first stage's embedding (its TP all-reduce), the last's output layer, cross-entropy and
  // multi-token prediction's layers.
  const double M = m.wb * m.N * cfg.hidden_size;  // one micro-batch's hidden state
  if (shard.has_embedding) {
    const double e = TP > 1 ? all_reduce(m.tp_link, TP, M) : 0;
    st.F[0] += e + m.memory_time(2 * M);
    st.tp += micro * e;
  }
  if (shard.has_head) {
    const int last = shard.num_chunks() - 1;
    const double V_local = double(cfg.padded_vocab_size(TP)) / TP;
    const double heads = 1 + shard.mtp_count;
    const double f = 2.0 * m.N * cfg.hidden_size * V_local;
    // The logits GEMM (twice its FLOPs backward); cross-entropy reads the logits once forward,
    // reads them and writes their gradient backward.
    const double gemm = m.gemm_time(f, cfg.hidden_size), pass = m.memory_time(m.N * V_local * m.wb);
    const double head_fwd = heads * (gemm + pass), head_bwd = heads * (2 * gemm + 2 * pass);
    st.F[size_t(last)] += head_fwd;
    st.B[size_t(last)] += head_bwd;
    st.compute.forward += micro * head_fwd;
    st.compute.backward += micro * head_bwd;
    st.flops += micro * heads * 3 * f;
    for (int l = shard.mtp_begin; l < shard.mtp_begin + shard.mtp_count; ++l) add_layer(l, last);
  }
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
  if (t.use_distributed_optimizer) {
    st.dp_grad = ag(m.grad_link, gn, dense_grad) + ag(m.edp_link, en, expert_grad);
    st.dp_param = ag(m.grad_link, gn, m.wb * dense) + ag(m.edp_link, en, m.wb * experts);
  } else {
    st.dp_grad = ar(m.grad_link, gn, dense_grad) + ar(m.edp_link, en, expert_grad);
  }
  const double owned = t.use_distributed_optimizer ? dense / gn + experts / en : dense + experts;
  // Tessera's passes over the parameters each step: Adam on its shard (the f32 master weight,
  // gradient and two moments read, three written: 28 bytes a parameter), the bf16 copy cast
  // (4 read, 2 written), the gradient norm's read and the gradients' zeroing (4 each).
  st.compute.optimizer = m.memory_time(28 * owned + 14 * (dense + experts));
  return st;
}

// The pipeline: each rank runs its schedule's steps in order; a forward needs the previous
// virtual stage's forward of that micro-batch (and its send, `p2p` seconds), a backward the next
// one's. Each rank's finish time and busy time.
void simulate_pipeline(const std::vector<StageCost>& cost, int V, int micro, double p2p,
                       std::vector<double>& finish, std::vector<double>& busy) {
  const int PP = static_cast<int>(cost.size()), stages = PP * V;
  std::vector<std::vector<PipeStep>> order(static_cast<size_t>(PP));
  for (int s = 0; s < PP; ++s)
    order[size_t(s)] = V > 1 ? schedule_interleaved(PP, s, micro, V) : schedule_1f1b(PP, s, micro);
  std::map<std::tuple<bool, int, int>, double> done;  // (forward, micro, virtual stage)
  std::vector<size_t> next(static_cast<size_t>(PP), 0);
  finish.assign(size_t(PP), 0.0);
  busy.assign(size_t(PP), 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < PP; ++s)
      while (next[size_t(s)] < order[size_t(s)].size()) {
        const PipeStep& st = order[size_t(s)][next[size_t(s)]];
        const int vs = st.chunk * PP + s;
        double ready = 0;
        if (st.forward ? vs > 0 : vs < stages - 1) {
          const auto it = done.find({st.forward, st.micro, st.forward ? vs - 1 : vs + 1});
          if (it == done.end()) break;
          ready = it->second + p2p;
        }
        const double d =
            st.forward ? cost[size_t(s)].F[size_t(st.chunk)] : cost[size_t(s)].B[size_t(st.chunk)];
        finish[size_t(s)] = std::max(finish[size_t(s)], ready) + d;
        busy[size_t(s)] += d;
        done[{st.forward, st.micro, vs}] = finish[size_t(s)];
        ++next[size_t(s)];
        progress = true;
      }
  }
}

}  // namespace

StepPrediction predict_step(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                            int ep, const ClusterSpec& cluster, const GpuRates& rates) {
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
  for (int s = 0; s < PP; ++s) cost.push_back(stage_cost(m, s, micro));
  const double M = m.wb * m.N * cfg.hidden_size;
  const double send =
      PP > 1 ? M / (t.sequence_parallel ? TP : 1) / m.pp_link.bw + m.pp_link.lat : 0;
  std::vector<double> finish, busy, finish0, busy0;
  simulate_pipeline(cost, V, micro, send, finish, busy);
  simulate_pipeline(cost, V, micro, 0, finish0, busy0);
  // Each stage's gradient reduce overlaps its last micro-batch's backward (--overlap-grad-reduce)
  // and the parameter gather the next forward (--overlap-param-gather); the rest is exposed.
  double step = 0, makespan = 0, makespan0 = 0;
  for (int s = 0; s < PP; ++s) {
    makespan = std::max(makespan, finish[size_t(s)]);
    makespan0 = std::max(makespan0, finish0[size_t(s)]);
  }
  for (int s = 0; s < PP; ++s) {
    const StageCost& c = cost[size_t(s)];
    const double g = std::max(0.0, c.dp_grad - (t.overlap_grad_reduce ? c.B[0] : 0));
    const double a = std::max(0.0, c.dp_param - (t.overlap_param_gather ? c.F[0] : 0));
    const double end = finish[size_t(s)] + g + a + c.compute.optimizer;
    if (end > step) {
      step = end;
      p.critical_stage = s;
      p.dp_grad = g;
      p.dp_param = a;
    }
  }
  const StageCost& c = cost[size_t(p.critical_stage)];
  p.step = step;
  p.bubble = std::max(0.0, makespan0 - busy0[size_t(p.critical_stage)]);
  p.pp = makespan - makespan0;
  p.tp = c.tp;
  p.cp = c.cp;
  p.ep = c.ep;
  p.exposed_comm = p.tp + p.pp + p.dp_grad + p.dp_param + p.cp + p.ep;
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
  std::snprintf(buf, sizeof buf,
                "  pipeline bubble %.3f s; exposed communication %.3f s: TP/SP %.3f, pipeline "
                "send/recv %.3f, DP gradient reduce %.3f, DP parameter gather %.3f, CP ring %.3f, "
                "EP all-to-all %.3f\n",
                p.bubble, p.exposed_comm, p.tp, p.pp, p.dp_grad, p.dp_param, p.cp, p.ep);
  out += buf;
  std::snprintf(buf, sizeof buf,
                "predicted: step %.4g s | tokens/s %.0f | TFLOP/s/GPU %.1f | MFU %.1f %% | bubble "
                "%.1f %% | exposed comm %.1f %%\n",
                p.step, p.tokens_per_s, p.tflops_per_gpu, 100 * p.mfu, 100 * p.bubble / p.step,
                100 * p.exposed_comm / p.step);
  out += buf;
  return out;
}

}  // namespace tessera
