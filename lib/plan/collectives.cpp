// collectives.cpp: one rank's collectives of a training step (plan/collectives.hpp). Each piece
// below names the code whose calls it lists; tests/plan/test_collective_sequence.sh holds them to
// what that code issues.
#include "plan/collectives.hpp"

#include <algorithm>
#include <memory>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "run/layout.hpp"
#include "run/muon_plan.hpp"
#include "run/pipeline.hpp"

namespace tessera {

std::string PlannedCall::line() const {
  std::string s = group + " " + op + " " + std::to_string(elements) + " " + std::to_string(bytes);
  if (peer >= 0) s += " " + std::to_string(peer);
  return s;
}

CollectivePlan::CollectivePlan(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                               int ep, int world_rank, bool device)
    : cfg_(cfg), t_(t), layout_(layout), ep_(std::max(1, ep)), device_(device) {
  me_ = layout.coords(world_rank);
  ParallelContext ctx;
  ctx.tp_size = layout.tp;
  ctx.tp_rank = me_.tp;
  ctx.pp_size = layout.pp;
  ctx.pp_rank = me_.pp;
  ctx.dp_size = layout.dp;
  ctx.dp_rank = me_.dp;
  ctx.cp_size = layout.cp;
  ctx.cp_rank = me_.cp;
  ctx.ep_size = ep_;
  ctx.ep_rank = me_.dp % ep_;
  sp_ = t.sequence_parallel && layout.tp > 1;
  shard_ = make_model_shard(cfg, ctx, sp_, t.virtual_pipeline_size);
  specs_ = build_layer_specs(cfg);
  recompute_ = plan_recompute(t.recompute, shard_);
  rows_ = int64_t(t.micro_batch_size) * cfg.seq_length / layout.cp;
  wb_ = static_cast<int>(dtype_size(t.compute_dtype));
}

int CollectivePlan::group_size(const std::string& g) const {
  if (g == "tp") return layout_.tp;
  if (g == "cp") return layout_.cp;
  if (g == "dp") return layout_.dp * layout_.cp;
  if (g == "ep") return ep_;
  if (g == "edp") return layout_.dp / ep_ * layout_.cp;
  const int N = t_.dist_opt_instances;
  if (g == "dp_shard") return layout_.dp * layout_.cp / N;
  if (g == "edp_shard") return layout_.dp / ep_ * layout_.cp / N;
  if (g == "dp_replica" || g == "edp_replica") return N;
  if (g == "pp" || g == "pp_grad") return layout_.pp;
  return 2;  // the embedding and wrap-around groups: the first and last stage
}

std::string CollectivePlan::shard_group(bool expert) const {
  if (t_.dist_opt_instances > 1) return expert ? "edp_shard" : "dp_shard";
  return expert ? "edp" : "dp";
}

int CollectivePlan::shard_rank(bool expert) const {
  const int r = me_.cp + layout_.cp * (expert ? me_.dp / ep_ : me_.dp);  // in dp / edp
  return r % group_size(shard_group(expert));
}

PlannedCall CollectivePlan::call(const std::string& group, const char* op, int64_t elements,
                                 int bytes, int peer) const {
  return PlannedCall{group, op, elements, bytes, peer};
}

int CollectivePlan::world_of_stage(int pp_rank) const {
  return layout_.rank_of(me_.tp, pp_rank, me_.dp, me_.cp);
}

// PartServices::reduce_rows: a row-parallel GEMM's output summed over TP, all of it or (sequence
// parallelism) reduce-scattered to this rank's rows.
void CollectivePlan::hidden_reduce(CallList& out) const {
  if (layout_.tp == 1) return;
  out.push_back(call("tp", sp_ ? "reduce_scatter" : "all_reduce", rows_ * cfg_.hidden_size, wb_));
}

// GPTModel::gather_rows: sequence parallelism's rows gathered before a column-parallel GEMM.
void CollectivePlan::hidden_gather(CallList& out) const {
  if (sp_) out.push_back(call("tp", "all_gather", rows_ * cfg_.hidden_size, wb_));
}

// One step of the context-parallel ring: this rank's key/value block (or the partial gradient
// of one) sent to the next CP rank while the previous one's arrives.
PlannedCall CollectivePlan::ring_step() const {
  const int next = layout_.rank_of(me_.tp, me_.pp, me_.dp, (me_.cp + 1) % layout_.cp);
  const int64_t kv = rows_ * 2 * (cfg_.kv_heads() / layout_.tp) * cfg_.head_dim();
  return call("cp", "send_recv", kv, wb_, next);
}

// GPTModel::ring_attention_forward: CP - 1 steps, each sending this step's key/value block on.
void CollectivePlan::ring_forward(CallList& out) const {
  for (int i = 0; i + 1 < layout_.cp; ++i) out.push_back(ring_step());
}

// GPTModel::ring_attention_backward: the key/value blocks again (CP - 1) and, at every step, the
// partial key/value gradient sent on (CP).
void CollectivePlan::ring_backward(CallList& out) const {
  if (layout_.cp == 1) return;
  for (int i = 0; i < layout_.cp; ++i) {
    if (i + 1 < layout_.cp) out.push_back(ring_step());
    out.push_back(ring_step());
  }
}

// GPTModel's MoE forward (model/moe.cpp) after the gathered LayerNorm output: the router's
// logits gathered over TP (each TP rank routes a share of the rows), then the dispatch of this
// rank's N K token copies and the combine of the copies its experts processed (their number
// depends on the routing: balanced, N K), or with the all-gather dispatcher every EP rank's
// tokens and logits gathered and the outputs reduce-scattered.
void CollectivePlan::moe_forward(CallList& out) const {
  const int64_t N = rows_, C = cfg_.hidden_size, E = cfg_.num_experts, K = cfg_.moe_router_topk;
  if (layout_.tp > 1) out.push_back(call("tp", "all_gather", N * E, 4));
  if (ep_ == 1) return;
  if (cfg_.moe_token_dispatcher_type == "allgather") {
    out.push_back(call("ep", "all_gather", ep_ * N * C, wb_));
    out.push_back(call("ep", "all_gather", ep_ * N * E, 4));
    out.push_back(call("ep", "reduce_scatter", ep_ * N * C, wb_));
    return;
  }
  out.push_back(call("ep", "all_to_all", N * K * C, wb_));
  out.push_back(call("ep", "all_to_all", N * K * C, wb_));
}

// The MoE backward: the routing weights' gradient summed over TP, then the combine's and the
// dispatch's all-to-alls in reverse.
void CollectivePlan::moe_backward(CallList& out) const {
  const int64_t N = rows_, C = cfg_.hidden_size, K = cfg_.moe_router_topk;
  if (layout_.tp > 1) out.push_back(call("tp", "all_reduce", N * K, 4));
  if (ep_ == 1) return;
  if (cfg_.moe_token_dispatcher_type == "allgather") {
    out.push_back(call("ep", "all_gather", ep_ * N * C, wb_));
    out.push_back(call("ep", "reduce_scatter", ep_ * N * K, 4));
    out.push_back(call("ep", "reduce_scatter", ep_ * N * C, wb_));
    return;
  }
  out.push_back(call("ep", "all_to_all", N * K * C, wb_));
  out.push_back(call("ep", "all_to_all", N * K * C, wb_));
}

// GPTModel::reduce_sequence_parallel_grads for a layer, once a step: the parts' TP-partial
// gradients (the router; q/k norms, MLA's latents), then with sequence parallelism the norms'.
void CollectivePlan::tp_grad_sums(int l, CallList& out) const {
  if (layout_.tp == 1) return;
  const LayerSpec& s = specs_[static_cast<size_t>(l)];
  const int64_t C = cfg_.hidden_size;
  const int norm_tensors = cfg_.rmsnorm() ? 1 : 2;
  if (s.mlp == MlpKind::MoE) out.push_back(call("tp", "all_reduce", cfg_.num_experts * C, 4));
  if (s.attention == AttentionKind::MultiLatent) {
    if (cfg_.q_lora_rank > 0) {
      out.push_back(call("tp", "all_reduce", int64_t(cfg_.q_lora_rank) * C, 4));
      if (s.qk_norm)
        for (int i = 0; i < norm_tensors; ++i)
          out.push_back(call("tp", "all_reduce", cfg_.q_lora_rank, 4));
    }
    const int64_t kv_down = int64_t(cfg_.kv_lora_rank) + cfg_.qk_pos_emb_head_dim;
    out.push_back(call("tp", "all_reduce", kv_down * C, 4));
    if (s.qk_norm)
      for (int i = 0; i < norm_tensors; ++i)
        out.push_back(call("tp", "all_reduce", cfg_.kv_lora_rank, 4));
  } else if (s.qk_norm) {
    for (int i = 0; i < 2 * norm_tensors; ++i)  // q's and k's weight (and bias)
      out.push_back(call("tp", "all_reduce", cfg_.head_dim(), 4));
  }
  if (!sp_) return;
  for (int i = 0; i < 2 * norm_tensors; ++i) out.push_back(call("tp", "all_reduce", C, 4));
}

// GPTModel::embed_forward: each TP rank embeds the tokens of its vocabulary shard; the sum.
CallList CollectivePlan::embed_forward() const {
  CallList out;
  hidden_reduce(out);
  return out;
}

// GPTModel::embed_backward: the gradient's rows gathered (sequence parallelism).
CallList CollectivePlan::embed_backward() const {
  CallList out;
  hidden_gather(out);
  return out;
}

// GPTModel::block_forward: attention (gather, ring, row-parallel reduce), then the MLP.
CallList CollectivePlan::layer_forward(int l) const {
  CallList out;
  const LayerSpec& s = specs_[static_cast<size_t>(l)];
  hidden_gather(out);
  ring_forward(out);
  hidden_reduce(out);
  hidden_gather(out);
  if (s.mlp == MlpKind::MoE) moe_forward(out);
  hidden_reduce(out);
  return out;
}

// GPTModel::block_backward after recompute_for_backward: the MLP's branch gradient gathered, its
// input gradient reduced, the same for attention with the ring between.
CallList CollectivePlan::layer_backward(int l, bool last_micro) const {
  CallList out;
  const LayerRecompute r = shard_.is_mtp_layer(l)
                               ? LayerRecompute{}
                               : recompute_[static_cast<size_t>(shard_.local_index(l))];
  if (r.kind == RecomputeGranularity::Full && r.chunk_last(l)) {
    for (int k = r.chunk_begin; k < r.chunk_end; ++k) {
      fsdp_hook(&FsdpLedger::before_forward, k, out);
      const CallList f = layer_forward(k);
      out.insert(out.end(), f.begin(), f.end());
      fsdp_hook(&FsdpLedger::after_forward, k, out);
    }
  } else if (r.kind == RecomputeGranularity::Selective) {
    hidden_gather(out);  // both LayerNorms' outputs
    hidden_gather(out);
    ring_forward(out);  // the attention core again
  }
  const LayerSpec& s = specs_[static_cast<size_t>(l)];
  hidden_gather(out);
  if (s.mlp == MlpKind::MoE) moe_backward(out);
  hidden_reduce(out);
  hidden_gather(out);
  ring_backward(out);
  hidden_reduce(out);
  if (last_micro || t_.fsdp_shards_grads()) tp_grad_sums(l, out);  // FSDP: every micro-batch
  return out;
}

// GPTModel::head_forward: the final norm's rows gathered, then vocabulary-parallel cross-entropy's
// three reductions of a float per token (row maximum, sum of exponentials, target logit).
CallList CollectivePlan::head_forward() const {
  CallList out;
  hidden_gather(out);
  if (layout_.tp > 1)
    for (int i = 0; i < 3; ++i) out.push_back(call("tp", "all_reduce", rows_, 4));
  return out;
}

// GPTModel::head_backward: the output layer's input gradient reduced; once a step the final
// norm's gradients (sequence parallelism).
CallList CollectivePlan::head_backward(bool last_micro) const {
  CallList out;
  hidden_reduce(out);
  if ((last_micro || t_.fsdp_shards_grads()) && sp_)
    for (int i = 0; i < (cfg_.rmsnorm() ? 1 : 2); ++i)
      out.push_back(call("tp", "all_reduce", cfg_.hidden_size, 4));
  return out;
}

// StepExecutor::forward_in / forward_out / backward_in / backward_out: the stage's neighbours,
// the wrap-around groups between the last and first stage with virtual stages.
CallList CollectivePlan::receive_forward(int chunk) const {
  const int P = layout_.pp, V = shard_.num_chunks();
  if (P == 1 || (me_.pp == 0 && chunk == 0)) return {};
  const int64_t n = rows_ * cfg_.hidden_size / (sp_ ? layout_.tp : 1);
  if (me_.pp > 0) return {call("pp", "recv", n, wb_, world_of_stage(me_.pp - 1))};
  return {call(V > 1 ? "pp_wrap" : "pp", "recv", n, wb_, world_of_stage(P - 1))};
}

CallList CollectivePlan::send_forward(int chunk) const {
  const int P = layout_.pp, V = shard_.num_chunks();
  if (P == 1 || (me_.pp == P - 1 && chunk == V - 1)) return {};
  const int64_t n = rows_ * cfg_.hidden_size / (sp_ ? layout_.tp : 1);
  if (me_.pp < P - 1) return {call("pp", "send", n, wb_, world_of_stage(me_.pp + 1))};
  return {call(V > 1 ? "pp_wrap" : "pp", "send", n, wb_, world_of_stage(0))};
}

CallList CollectivePlan::receive_backward(int chunk) const {
  const int P = layout_.pp, V = shard_.num_chunks();
  if (P == 1 || (me_.pp == P - 1 && chunk == V - 1)) return {};
  const int64_t n = rows_ * cfg_.hidden_size / (sp_ ? layout_.tp : 1);
  const char* back = device_ ? "pp_grad" : "pp";
  if (me_.pp < P - 1) return {call(back, "recv", n, wb_, world_of_stage(me_.pp + 1))};
  return {call(V > 1 ? "pp_wrap_grad" : back, "recv", n, wb_, world_of_stage(0))};
}

CallList CollectivePlan::send_backward(int chunk) const {
  const int P = layout_.pp, V = shard_.num_chunks();
  if (P == 1 || (me_.pp == 0 && chunk == 0)) return {};
  const int64_t n = rows_ * cfg_.hidden_size / (sp_ ? layout_.tp : 1);
  const char* back = device_ ? "pp_grad" : "pp";
  if (me_.pp > 0) return {call(back, "send", n, wb_, world_of_stage(me_.pp - 1))};
  return {call(V > 1 ? "pp_wrap_grad" : back, "send", n, wb_, world_of_stage(P - 1))};
}

namespace {
void append(CallList& out, const CallList& more) {
  out.insert(out.end(), more.begin(), more.end());
}
}  // namespace

// The units' collectives as FsdpUnits issues them (train/fsdp.cpp): a unit's gather over its
// blocks' group in the compute dtype, its reduce-scatter in f32.
struct CollectivePlan::FsdpRecorder final : FsdpLedger::Actions {
  FsdpRecorder(const CollectivePlan& p, const std::vector<ParamSpec>& specs,
               const std::vector<FlatBucket>& fb)
      : plan(p),
        buckets(fb),
        ledger(fsdp_units(specs, fb, p.shard_), p.shard_, true, p.t_.fsdp_shards_params(),
               p.t_.compute_dtype, nullptr) {
    ledger.set_actions(this);
  }
  void issue(int unit, const char* op, int bytes) {
    const FlatBucket& b = buckets[static_cast<size_t>(unit)];
    const std::string g = plan.shard_group(b.expert && plan.ep_ > 1);
    if (plan.group_size(g) > 1) out->push_back(plan.call(g, op, b.numel(), bytes));
  }
  void gather(int unit, const Tensor&) override { issue(unit, "all_gather", plan.wb_); }
  void wait_gather(int) override {}
  void release_params(int) override {}
  void bind_grads(int, const Tensor&) override {}
  void start_reduce(int unit) override { issue(unit, "reduce_scatter", 4); }
  void finish_reduce(int) override {}

  const CollectivePlan& plan;
  const std::vector<FlatBucket>& buckets;
  FsdpLedger ledger;
  CallList* out = nullptr;
};

void CollectivePlan::fsdp_hook(void (FsdpLedger::*hook)(int), int piece, CallList& out) const {
  if (!fsdp_) return;
  fsdp_->out = &out;
  (fsdp_->ledger.*hook)(piece);
}

// Muon::step (train/muon.hpp): TP-cut matrices gathered whole (duplicated) or their Gram
// matrices summed at every Newton-Schulz step (distributed), batch by batch; over the distributed
// optimizer, per bucket holding matrices, the direction gathered, this rank's dealt matrices in
// batches, the update reduce-scattered.
void CollectivePlan::muon_calls(const std::vector<ParamSpec>& specs,
                                const std::vector<FlatBucket>& fb, CallList& out) const {
  const std::vector<MuonMatrix> matrices = plan_muon_matrices(specs, layout_.tp, t_.muon.split_qkv);
  // A batch of same-shaped matrices (muon_batches), as Muon::orthogonal runs it: row-cut ones
  // gathered one by one, column-cut ones in one call; distributed, the batch's Gram matrices
  // summed at each step in one call.
  auto orthogonalize = [&](const std::vector<const MuonMatrix*>& batch) {
    const MuonMatrix& m = *batch[0];
    const int64_t L = static_cast<int64_t>(batch.size());
    if (m.split == MuonMatrix::Split::None || layout_.tp == 1) return;
    if (t_.muon.tp_mode == "duplicated") {
      if (m.split == MuonMatrix::Split::Rows)
        for (int64_t i = 0; i < L; ++i)
          out.push_back(call("tp", "all_gather", layout_.tp * m.numel(), 4));
      else
        out.push_back(call("tp", "all_gather", layout_.tp * L * m.numel(), 4));
    } else if (t_.muon.tp_mode == "distributed") {
      const int64_t g = m.split == MuonMatrix::Split::Cols ? m.rows : m.cols;
      for (int k = 0; k < t_.muon.ns_steps; ++k)
        out.push_back(call("tp", "all_reduce", L * g * g, 4));
    }
  };
  auto batches = [&](const std::vector<const MuonMatrix*>& ms) {
    for (const auto& batch : muon_batches(ms, layout_.tp, t_.muon.tp_mode)) orthogonalize(batch);
  };
  if (!t_.use_distributed_optimizer) {
    std::vector<const MuonMatrix*> all;
    for (const MuonMatrix& m : matrices) all.push_back(&m);
    batches(all);
    return;
  }
  for (const FlatBucket& b : fb) {
    std::vector<const MuonMatrix*> in;
    for (const MuonMatrix& m : matrices)
      if (m.offset >= b.begin && m.offset < b.end) in.push_back(&m);
    if (in.empty()) continue;
    const bool expert = b.expert && ep_ > 1;
    const std::string g = shard_group(expert);
    const int n = group_size(g);
    const int me = shard_rank(expert);
    if (n > 1) out.push_back(call(g, "all_gather", b.numel(), 4));
    std::vector<const MuonMatrix*> own;
    for (size_t i = 0; i < in.size(); ++i)
      if (static_cast<int>(i % size_t(n)) == me) own.push_back(in[i]);
    batches(own);
    if (n > 1) out.push_back(call(g, "reduce_scatter", b.numel(), 4));
  }
}

// StepExecutor::run over the schedule; in each chunk's last backward the trainer's
// on_grads_ready (the TP sums, then GradReducer::piece_ready); OptimizerSet::finish_reduction
// (the buckets not started, the embedding group's sum) and the distributed optimizer's gathers.
CallList CollectivePlan::step() const {
  if (cfg_.mtp())
    throw ConfigError(
        "--collective-plan: multi-token prediction's calls are not in the plan yet (the "
        "predicted step counts them); plan without --mtp-num-layers");
  const int P = layout_.pp, V = shard_.num_chunks(), micro = t_.num_micro_batches(layout_.dp);
  // The data-parallel buckets of this rank's flat buffer, as the trainer lays it out.
  ParallelContext ctx;
  ctx.dp_size = layout_.dp;
  ctx.cp_size = layout_.cp;
  ctx.ep_size = ep_;
  std::vector<ParamSpec> specs = build_param_specs(cfg_, shard_);
  const FlatLayout flat = training_flat_layout(t_, cfg_, ctx);
  const std::vector<FlatBucket> fb = layout_flat_buffer(specs, flat);
  const std::vector<std::vector<int>> pieces = param_pieces(specs, shard_);
  const bool dist = t_.use_distributed_optimizer;
  std::vector<Bucket> buckets(fb.size());
  std::vector<int> bucket_of(specs.size(), -1), remaining(specs.size());
  for (size_t b = 0; b < fb.size(); ++b) {
    buckets[b].elements = fb[b].numel();
    buckets[b].expert = fb[b].expert && ep_ > 1;
    buckets[b].pending = fb[b].end_param - fb[b].first_param;
    for (int p = fb[b].first_param; p < fb[b].end_param; ++p) bucket_of[size_t(p)] = int(b);
  }
  for (size_t p = 0; p < specs.size(); ++p) remaining[p] = static_cast<int>(pieces[p].size());
  CallList out;
  // Megatron-FSDP's sharded units replace the buckets' reduction (and, sharding parameters, the
  // optimizer's gathers) with their own calls at the model's hooks.
  const bool units = t_.fsdp_shards_grads();
  std::unique_ptr<FsdpRecorder> recorder;
  if (units) recorder = std::make_unique<FsdpRecorder>(*this, specs, fb);
  fsdp_ = recorder.get();
  struct Reset {
    const CollectivePlan* p;
    ~Reset() { p->fsdp_ = nullptr; }
  } reset{this};
  auto hook = [&](void (FsdpLedger::*h)(int), int piece) { fsdp_hook(h, piece, out); };
  auto reduce = [&](Bucket& b) {
    b.started = true;
    const std::string g = dist ? shard_group(b.expert) : b.expert ? "edp" : "dp";
    if (group_size(g) > 1)
      out.push_back(call(g, dist ? "reduce_scatter" : "all_reduce", b.elements, 4));
  };
  auto ready = [&](int piece) {  // GradReducer::piece_ready
    if (!t_.overlap_grad_reduce || units) return;
    for (size_t p = 0; p < specs.size(); ++p) {
      if (std::find(pieces[p].begin(), pieces[p].end(), piece) == pieces[p].end()) continue;
      if (--remaining[p] > 0) continue;
      Bucket& b = buckets[size_t(bucket_of[p])];
      if (--b.pending == 0) reduce(b);
    }
  };
  const std::vector<PipeStep> order =
      V > 1 ? schedule_interleaved(P, me_.pp, micro, V) : schedule_1f1b(P, me_.pp, micro);
  for (const PipeStep& st : order) {
    const LayerRange& range = shard_.chunks[size_t(st.chunk)];
    const bool embeds = st.chunk == 0 && shard_.has_embedding;
    const bool head = st.chunk == V - 1 && shard_.has_head;
    auto forward = [&](int piece, const CallList& calls) {
      hook(&FsdpLedger::before_forward, piece);
      append(out, calls);
      hook(&FsdpLedger::after_forward, piece);
    };
    if (st.forward) {
      append(out, receive_forward(st.chunk));
      if (embeds) forward(kEmbedPiece, embed_forward());
      for (int l = range.begin; l < range.end; ++l) forward(l, layer_forward(l));
      if (head) forward(kHeadPiece, head_forward());
      append(out, send_forward(st.chunk));
      continue;
    }
    const bool last = st.micro == micro - 1;
    auto backward = [&](int piece, auto&& calls) {  // GPTModel::backward's hooks around a piece
      hook(&FsdpLedger::before_backward, piece);
      append(out, calls());
      if (last) ready(piece);
      hook(&FsdpLedger::grads_ready, piece);
      hook(&FsdpLedger::after_backward, piece);
    };
    append(out, receive_backward(st.chunk));
    if (head) backward(kHeadPiece, [&] { return head_backward(last); });
    for (int l = range.end - 1; l >= range.begin; --l)
      backward(l, [&] { return layer_backward(l, last); });
    if (embeds) backward(kEmbedPiece, [&] { return embed_backward(); });
    append(out, send_backward(st.chunk));
  }
  if (recorder) recorder->ledger.finish();
  for (Bucket& b : buckets)  // GradReducer::finish: in bucket order
    if (!b.started && !units) reduce(b);
  // DistributedAdamW::reduce_replicas (HSDP): each block summed across the instances, or with
  // outer optimizer sharding its cut reduce-scattered over them.
  const int N = t_.dist_opt_instances;
  const bool split = t_.outer_dp_shards_optim && N > 1;
  auto cut_of = [&](const Bucket& b) { return b.elements / group_size(shard_group(b.expert)); };
  if (dist && N > 1)
    for (const Bucket& b : buckets)
      out.push_back(call(b.expert ? "edp_replica" : "dp_replica",
                         split ? "reduce_scatter" : "all_reduce", cut_of(b), 4));
  if (P > 1 && (shard_.has_embedding || shard_.has_head) && cfg_.embedding_on_last_stage()) {
    int64_t n = 0;  // wte's gradient, or the block of its bucket this rank owns
    for (size_t p = 0; p < specs.size(); ++p)
      if (specs[p].name == "wte")
        n = dist ? cut_of(buckets[size_t(bucket_of[p])]) / (split ? N : 1) : specs[p].numel();
    out.push_back(call("embedding", "all_reduce", n, 4));
  }
  if (t_.optimizer == "muon") muon_calls(specs, fb, out);
  if (split)  // DistributedAdamW::gather_replicas: each cut whole again, in the compute dtype
    for (const Bucket& b : buckets)
      out.push_back(call(b.expert ? "edp_replica" : "dp_replica", "all_gather", cut_of(b), wb_));
  if (dist && !t_.fsdp_shards_params())  // DistributedAdamW::step: the updated blocks gathered
    for (size_t b = buckets.size(); b-- > 0;) {
      const std::string g = shard_group(buckets[b].expert);
      if (group_size(g) > 1)
        out.push_back(call(g, "all_gather", buckets[b].elements, wb_));  // the compute copy
    }
  return out;
}

}  // namespace tessera
