// engine.cpp: the inference forward pass with a KV cache.
#include "inference/engine.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "core/logging.hpp"
#include "model/parts.hpp"

namespace tessera {

namespace {
constexpr int kTagHidden = 11;
}

InferenceEngine::InferenceEngine(GPTModel& model, const ParallelContext& ctx, int max_sequences,
                                 int64_t max_positions)
    : model_(model),
      ctx_(ctx),
      be_(model.backend()),
      max_positions_(max_positions),
      max_sequences_(max_sequences) {
  const GPTConfig& cfg = model.config();
  TESSERA_CHECK(max_positions <= cfg.max_positions(), "context of ", max_positions,
                " exceeds the model's ", cfg.max_positions(), " positions");
  const ModelShard& sh = model.shard();
  for (int n = sh.num_layers() - sh.mtp_count; n > 0; --n) {  // MTP's layers do not generate
    const Shape s{max_sequences, model.services().kv_heads_local(), max_positions, cfg.head_dim()};
    AllocationLabel label("the KV cache");
    // In the compute dtype: a bf16 model's cache holds bf16 keys and values (half the bytes).
    k_cache_.push_back(Tensor(s, model.compute_dtype(), be_.allocator()));
    v_cache_.push_back(Tensor(s, model.compute_dtype(), be_.allocator()));
    be_.zero(k_cache_.back());
    be_.zero(v_cache_.back());
  }
}

InferenceEngine::~InferenceEngine() {
  try {
    release_graphs();
  } catch (const std::exception&) {  // a destructor does not throw; the backend goes soon
  }
}

void InferenceEngine::release_graphs() {
  for (auto& [n, g] : graphs_) be_.graph_release(g.handle);
  graphs_.clear();
  warmed_.clear();
}

void InferenceEngine::ensure_rows(int64_t n, int64_t segs) {
  if (n <= rows_ && segs <= segs_) return;
  release_graphs();  // they hold the buffers about to be replaced
  rows_ = std::max(n, rows_);
  segs_ = std::max(segs, segs_);
  const GPTConfig& cfg = model_.config();
  const int64_t C = cfg.hidden_size, Vl = model_.services().vocab_local();
  Allocator& al = be_.allocator();
  // Activations in the model's compute dtype (as its training forward has them); the norm
  // statistics and the logits handed back in f32.
  const DType dt = model_.compute_dtype();
  auto f = [&](Shape s) { return Tensor(std::move(s), dt, al); };
  auto f32 = [&](Shape s) { return Tensor(std::move(s), DType::F32, al); };
  ids_ = Tensor({rows_}, DType::I32, al);
  pos_ = Tensor({rows_}, DType::I32, al);
  dec_rows_ = Tensor({rows_, 3}, DType::I32, al);
  x_ = f({rows_, C});
  ln_ = f({rows_, C});
  tmp_ = f({rows_, C});
  parts_ = DecodeBuffers{};  // each part of this stage's layers allocates what it uses
  parts_.rows = rows_;
  for (int l : generating_layers()) {
    model_.attention_part(l).decode_buffers(parts_);
    model_.mlp_part(l).decode_buffers(parts_);
  }
  mean_ = f32({rows_});
  rstd_ = f32({rows_});
  last_rows_ = Tensor({segs_}, DType::I32, al);
  last_x_ = f({segs_, C});
  lnf_ = f({segs_, C});
  lnf_mean_ = f32({segs_});
  lnf_rstd_ = f32({segs_});
  logits_ = f({segs_, Vl});
  logits_f32_ = dt == DType::F32 ? logits_ : f32({segs_, Vl});
  gathered_ = f32({model_.shard().tp_size * segs_ * Vl});
}

void InferenceEngine::reserve_reorder() {
  if (!k_spare_.empty() || k_cache_.empty()) return;
  AllocationLabel label("the KV cache (beam search's second copy)");
  for (const Tensor& k : k_cache_) {
    k_spare_.push_back(Tensor(k.shape(), k.dtype(), be_.allocator()));
    v_spare_.push_back(Tensor(k.shape(), k.dtype(), be_.allocator()));
  }
  slot_ids_ = Tensor({max_sequences_}, DType::I32, be_.allocator());
}

void InferenceEngine::reorder_slots(const std::vector<int>& src) {
  const int64_t S = static_cast<int64_t>(src.size());
  TESSERA_CHECK(S <= max_sequences_, "reorder of ", S, " slots in a cache of ", max_sequences_);
  for (int s : src) TESSERA_CHECK(s >= 0 && s < max_sequences_, "slot ", s, " outside the cache");
  if (S == 0 || k_cache_.empty()) return;
  reserve_reorder();
  release_graphs();  // the caches trade places with their spares
  Tensor ids = slot_ids_.view(0, {S});
  be_.copy_from_host(ids, src.data());
  const int64_t row = k_cache_[0].numel() / max_sequences_;
  for (size_t l = 0; l < k_cache_.size(); ++l) {
    // Slot i of the spare gathers row src[i] of the cache (slots past S keep stale data: unused).
    for (auto [cache, spare] : {std::pair<Tensor*, Tensor*>{&k_cache_[l], &k_spare_[l]},
                                std::pair<Tensor*, Tensor*>{&v_cache_[l], &v_spare_[l]}}) {
      Tensor out = spare->view(0, {S, row});
      be_.embedding_forward(out, ids, cache->reshape({max_sequences_, row}), 0);
      std::swap(*cache, *spare);
    }
  }
}

void InferenceEngine::forward(const std::vector<TokenSegment>& segments,
                              const std::vector<int32_t>& tokens, std::vector<float>& logits,
                              bool all_rows) {
  const int64_t S =
      all_rows ? static_cast<int64_t>(tokens.size()) : static_cast<int64_t>(segments.size());
  const Tensor all = forward_logits(segments, tokens, all_rows);
  if (!all.defined()) return;  // not the last stage
  const int tp = model_.shard().tp_size;
  const int64_t Vl = model_.services().vocab_local(), V = model_.config().vocab_size;
  host_logits_.resize(static_cast<size_t>(all.numel()));
  be_.copy_to_host(host_logits_.data(), all);
  logits.assign(static_cast<size_t>(S * V), 0.f);
  for (int r = 0; r < tp; ++r)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t begin = r * Vl, count = std::max<int64_t>(0, std::min(Vl, V - begin));
      if (count > 0)
        std::memcpy(logits.data() + i * V + begin, host_logits_.data() + (r * S + i) * Vl,
                    sizeof(float) * count);
    }
}

std::vector<int> InferenceEngine::generating_layers() const {
  std::vector<int> layers = model_.shard().layers();
  layers.resize(layers.size() - static_cast<size_t>(model_.shard().mtp_count));  // MTP's last
  return layers;
}

std::vector<int32_t> InferenceEngine::forward_sample(const std::vector<TokenSegment>& segments,
                                                     const std::vector<int32_t>& tokens,
                                                     const std::vector<TokenSampling>& how) {
  TESSERA_CHECK(how.size() == segments.size(), "one sampling rule per segment");
  const Tensor all = forward_logits(segments, tokens, false);
  if (!all.defined()) return {};
  return be_.sample_tokens(all, model_.shard().tp_size, static_cast<int64_t>(segments.size()),
                           model_.config().vocab_size, how);
}

Tensor InferenceEngine::forward_logits(const std::vector<TokenSegment>& segments,
                                       const std::vector<int32_t>& tokens, bool all_rows) {
  int64_t n = 0;
  bool decode = !all_rows && !segments.empty();  // one new token per sequence
  int64_t longest = 0;
  for (const TokenSegment& s : segments) {
    TESSERA_CHECK(s.slot >= 0 && s.slot < max_sequences_ && s.pos0 >= 0 && s.count >= 0,
                  "segment of slot ", s.slot, " at position ", s.pos0, " (", s.count,
                  " tokens) outside a cache of ", max_sequences_, " sequences");
    TESSERA_CHECK(s.pos0 + s.count <= max_positions_, "sequence of ", s.pos0 + s.count,
                  " tokens exceeds the context of ", max_positions_);
    n += s.count;
    longest = std::max(longest, s.pos0 + s.count);
    decode = decode && s.count == 1;
  }
  TESSERA_CHECK(static_cast<int64_t>(tokens.size()) == n, "tokens do not match the segments");
  // Output rows: the last token of each segment, or every token.
  const int64_t S = all_rows ? n : static_cast<int64_t>(segments.size());
  ensure_rows(n, S);
  // The step's inputs, on the device before any of its work: token ids, positions, the output
  // rows (the last of each segment, or every row), and a decode step's row table.
  std::vector<Backend::KvSegment> kv;
  int64_t row = 0;
  host_pos_.resize(static_cast<size_t>(n));
  for (const TokenSegment& s : segments) {
    kv.push_back({s.slot, s.pos0, s.count, row});
    for (int64_t t = 0; t < s.count; ++t) host_pos_[row + t] = static_cast<int32_t>(s.pos0 + t);
    row += s.count;
  }
  Tensor ids = ids_.view(0, {n}), pos = pos_.view(0, {n});
  be_.copy_from_host(ids, tokens.data());
  be_.copy_from_host(pos, host_pos_.data());
  const ModelShard& sh = model_.shard();
  if (sh.has_head) {
    host_pos_.resize(static_cast<size_t>(S));
    if (all_rows) {
      for (int64_t i = 0; i < S; ++i) host_pos_[i] = static_cast<int32_t>(i);
    } else {
      row = 0;
      for (int64_t i = 0; i < S; ++i) {
        row += segments[i].count;
        host_pos_[i] = static_cast<int32_t>(row - 1);
      }
    }
    Tensor last_rows = last_rows_.view(0, {S});
    be_.copy_from_host(last_rows, host_pos_.data());
  }
  if (decode) {
    host_pos_.resize(static_cast<size_t>(3 * n));
    for (int64_t i = 0; i < n; ++i) {
      host_pos_[3 * i] = static_cast<int32_t>(segments[i].slot);
      host_pos_[3 * i + 1] = static_cast<int32_t>(segments[i].pos0);
      host_pos_[3 * i + 2] = static_cast<int32_t>(i);
    }
    Tensor table = dec_rows_.view(0, {n, 3});
    be_.copy_from_host(table, host_pos_.data());
  }
  // A decode step at one rank may run as a CUDA graph: captured at its second step of this many
  // rows (the first allocated whatever scratch the ops need), replayed after. Inputs live in the
  // tensors written above; everything else a replay reads is fixed for this row count.
  static const bool env_off = [] {
    const char* v = std::getenv("TESSERA_CUDA_GRAPHS");
    return v && std::string(v) == "0";
  }();
  const bool graphs = decode && graphs_wanted_ && !graphs_failed_ && !env_off && sh.tp_size == 1 &&
                      ctx_.pp_size == 1 && sh.has_head && sh.has_embedding;
  // A graph's attention is planned for the whole cache (its launch may not depend on the step);
  // so is the op-by-op step that warms it up (same scratch sizes). Otherwise the step's context.
  const int64_t context = graphs ? max_positions_ : longest;
  if (graphs) {
    auto it = graphs_.find(n);
    if (it != graphs_.end()) {
      be_.graph_launch(it->second.handle);
      ++graph_replays_;
      return it->second.logits;
    }
    // MoE routing runs on the host (its expert GEMMs follow the routed counts): no graphs.
    if (warmed_.count(n) && !parts_.moe.rows && be_.graph_begin()) {
      Graph g;
      std::string why;
      try {
        g.logits = run_layers(n, S, kv, true, context);
        g.handle = be_.graph_end();
        if (g.handle < 0) why = "the backend could not capture the step";
      } catch (const std::exception& e) {
        be_.graph_abort();
        why = e.what();
      }
      if (g.handle >= 0) {
        graphs_[n] = g;
        be_.graph_launch(g.handle);
        ++graph_replays_;
        return g.logits;
      }
      graphs_failed_ = true;
      TLOG(warning) << "generation: CUDA graphs off, decode steps run op by op (" << why << ")";
    }
    warmed_.insert(n);
  }
  return run_layers(n, S, kv, decode, context);
}

Tensor InferenceEngine::run_layers(int64_t n, int64_t S, const std::vector<Backend::KvSegment>& kv,
                                   bool decode, int64_t context) {
  const GPTConfig& cfg = model_.config();
  const ModelShard& sh = model_.shard();
  const int64_t C = cfg.hidden_size;
  // Views of exactly n rows.
  Tensor x = x_.view(0, {n, C}), ln = ln_.view(0, {n, C}), tmp = tmp_.view(0, {n, C});
  Tensor mean = mean_.view(0, {n}), rstd = rstd_.view(0, {n});
  Tensor ids = ids_.view(0, {n}), pos = pos_.view(0, {n});
  if (sh.has_embedding) {
    be_.embedding_forward(x, ids, model_.params().compute_param("wte"),
                          model_.services().vocab_begin());
    model_.tp_comm().all_reduce(x, ReduceOp::Sum);
    if (cfg.learned_positions()) {
      be_.embedding_forward(tmp, pos, model_.params().compute_param("wpe"), 0);
      be_.add(x, x, tmp);
    }
  } else {
    ctx_.pp->recv(x, ctx_.pp_rank - 1, kTagHidden);
  }
  DecodeStep step;
  step.n = n;
  step.positions = &pos;
  step.decode = decode;
  if (decode) step.table = dec_rows_.view(0, {n, 3});
  step.context = context;
  step.segments = &kv;
  // The same parts as training's forward (model/parts.hpp), each layer's attention with its KV
  // cache. The residual adds are fused with the norm after them (the attention branch's with ln2,
  // the MLP branch's with the next layer's ln1: one kernel instead of two, the same values).
  const std::vector<int> layers = generating_layers();
  bool ln1_done = false;  // ln holds this layer's first norm already
  for (size_t k = 0; k < layers.size(); ++k) {
    const int l = layers[k];
    const LayerWeights& w = model_.layer_weights(l);
    if (!ln1_done) model_.services().norm_forward(ln, mean, rstd, x, w.ln1_w, w.ln1_b);
    step.k_cache = &k_cache_[sh.local_index(l)];
    step.v_cache = &v_cache_[sh.local_index(l)];
    model_.attention_part(l).decode(l, step, ln, tmp, parts_);
    model_.tp_comm().all_reduce(tmp, ReduceOp::Sum);
    model_.services().add_norm_forward(x, ln, mean, rstd, x, tmp, w.ln2_w, w.ln2_b);
    model_.mlp_part(l).decode(l, ln, tmp, parts_);
    model_.tp_comm().all_reduce(tmp, ReduceOp::Sum);
    ln1_done = k + 1 < layers.size();
    if (ln1_done) {
      const LayerWeights& next = model_.layer_weights(layers[k + 1]);
      model_.services().add_norm_forward(x, ln, mean, rstd, x, tmp, next.ln1_w, next.ln1_b);
    } else {
      be_.add(x, x, tmp);
    }
  }
  if (!sh.has_head) {
    ctx_.pp->send_async(x, ctx_.pp_rank + 1, kTagHidden)->wait();
    return Tensor();
  }
  // The output rows (last_rows_, written by forward_logits), their final LayerNorm and
  // vocabulary-parallel logits.
  Tensor last_rows = last_rows_.view(0, {S});
  Tensor lx = last_x_.view(0, {S, C}), lnf = lnf_.view(0, {S, C});
  Tensor lm = lnf_mean_.view(0, {S}), lr = lnf_rstd_.view(0, {S});
  be_.embedding_forward(lx, last_rows, x, 0);  // gathers rows of x
  model_.services().norm_forward(
      lnf, lm, lr, lx, model_.params().compute_param("lnf.weight"),
      cfg.rmsnorm() ? Tensor() : model_.params().compute_param("lnf.bias"));
  const int64_t Vl = model_.services().vocab_local();
  Tensor lg = logits_.view(0, {S, Vl});
  be_.matmul_forward(lg, lnf, model_.params().compute_param(model_.output_weight_name()), nullptr);
  if (lg.dtype() != DType::F32) {
    Tensor lf = logits_f32_.view(0, {S, Vl});
    be_.cast(lf, lg);
    lg = lf;
  }
  const int tp = sh.tp_size;
  Tensor all = gathered_.view(0, {tp * S * Vl});
  if (tp == 1)
    all = lg.reshape({S * Vl});
  else
    model_.tp_comm().all_gather(all, lg.reshape({S * Vl}));
  return all;
}

}  // namespace tessera
