// engine.cpp: the inference forward pass with a KV cache.
#include "inference/engine.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "core/logging.hpp"
#include "model/part_services.hpp"
#include "model/parts.hpp"

namespace tessera {

namespace {
constexpr int kTagHidden = 11;
constexpr size_t kAlign = 256;  // every tensor of a step starts on a 256-byte boundary
size_t aligned(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

// Hands out consecutive pieces of one backend buffer: a step's buffers are built without
// allocating, at the same addresses for the same sizes (a CUDA graph replays them). Without a
// buffer it only counts (the size of the largest step).
class InferenceEngine::Arena final : public Allocator {
 public:
  Arena(Allocator& backing, size_t bytes) : backing_(backing), size_(bytes) {
    if (bytes > 0) base_ = static_cast<char*>(backing.allocate(bytes));
  }
  ~Arena() override {
    if (base_) backing_.deallocate(base_, size_);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  void reset() { used_ = 0; }
  size_t used() const { return used_; }
  void* allocate(size_t bytes) override {
    const size_t at = used_;
    used_ = aligned(at + bytes);
    if (!base_) return &dummy_;  // counting: no memory behind the tensors
    TESSERA_CHECK(used_ <= size_, "generation's buffers: ", used_, " bytes in an arena of ", size_);
    return base_ + at;
  }
  void deallocate(void*, size_t) override {}
  Device device() const override { return backing_.device(); }

 private:
  Allocator& backing_;
  char* base_ = nullptr;
  size_t size_ = 0, used_ = 0;
  char dummy_ = 0;
};

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
  for (int l : sh.layers()) moe_ = moe_ || model.mlp_part(l).router() != nullptr;
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

namespace {
// The context's own buffers of a step with S output rows: the rows, their hidden states and the
// logits in f32, every TP rank's.
void context_buffers(InferenceContext& c, const GPTModel& m, int64_t n, int64_t S, Allocator& al) {
  const int64_t C = m.config().hidden_size, Vl = m.services().vocab_local();
  c.table = Tensor({n, 3}, DType::I32, al);
  if (!m.shard().has_head) return;
  c.out_rows = Tensor({S}, DType::I32, al);
  c.rows_x = Tensor({S, C}, m.compute_dtype(), al);
  if (m.compute_dtype() != DType::F32) c.logits_f32 = Tensor({S, Vl}, DType::F32, al);
  if (m.shard().tp_size > 1) c.gathered = Tensor({m.shard().tp_size * S * Vl}, DType::F32, al);
}
}  // namespace

void InferenceEngine::ensure_rows(int64_t n, int64_t S) {
  if (n <= rows_ && S <= segs_) return;
  release_graphs();  // they point into the arena about to be replaced
  decode_steps_.clear();
  prefill_.reset();
  arena_.reset();
  rows_ = std::max(n, rows_);
  segs_ = std::max(S, segs_);
  Arena count(be_.allocator(), 0);  // the largest step's bytes
  {
    Step probe;
    probe.acts = model_.make_decode_activations(rows_, segs_, count);
    context_buffers(probe.ctx, model_, rows_, segs_, count);
  }
  AllocationLabel label("generation's buffers (activations of up to " + std::to_string(rows_) +
                        " new tokens)");
  arena_ = std::make_unique<Arena>(be_.allocator(), count.used());
}

InferenceEngine::Step& InferenceEngine::step_for(int64_t n, int64_t S, bool decode) {
  if (decode) {
    auto it = decode_steps_.find(n);
    if (it != decode_steps_.end()) return *it->second;
  }
  auto step = std::make_unique<Step>();
  arena_->reset();  // a step's buffers overlay every other step's: one runs at a time
  step->acts = model_.make_decode_activations(n, S, *arena_);
  context_buffers(step->ctx, model_, n, S, *arena_);
  step->acts.inference = &step->ctx;
  step->ctx.k_cache = &k_cache_;
  step->ctx.v_cache = &v_cache_;
  Step& s = *step;
  if (decode)
    decode_steps_[n] = std::move(step);
  else
    prefill_ = std::move(step);
  return s;
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
  Step& st = step_for(n, S, decode);
  InferenceContext& c = st.ctx;
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
  be_.copy_from_host(st.acts.ids, tokens.data());
  be_.copy_from_host(st.acts.doc_positions, host_pos_.data());
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
    be_.copy_from_host(c.out_rows, host_pos_.data());
  }
  if (decode) {
    host_pos_.resize(static_cast<size_t>(3 * n));
    for (int64_t i = 0; i < n; ++i) {
      host_pos_[3 * i] = static_cast<int32_t>(segments[i].slot);
      host_pos_[3 * i + 1] = static_cast<int32_t>(segments[i].pos0);
      host_pos_[3 * i + 2] = static_cast<int32_t>(i);
    }
    be_.copy_from_host(c.table, host_pos_.data());
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
  c.decode = decode;
  c.context = graphs ? max_positions_ : longest;
  c.segments = &kv;
  if (graphs) {
    auto it = graphs_.find(n);
    if (it != graphs_.end()) {
      be_.graph_launch(it->second.handle);
      ++graph_replays_;
      return it->second.logits;
    }
    // MoE routing runs on the host (its expert GEMMs follow the routed counts): no graphs.
    if (warmed_.count(n) && !moe_ && be_.graph_begin()) {
      Graph g;
      std::string why;
      try {
        g.logits = run(st);
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
  return run(st);
}

Tensor InferenceEngine::run(Step& s) {
  // The hidden states from the previous stage; the model's own forward over this stage's layers
  // (the embedding on the first, the head's logits of the output rows on the last); to the next.
  if (!model_.shard().has_embedding) ctx_.pp->recv(s.acts.input, ctx_.pp_rank - 1, kTagHidden);
  model_.forward(s.acts, 0.f);
  if (!model_.shard().has_head) {
    ctx_.pp->send_async(model_.stage_output(s.acts), ctx_.pp_rank + 1, kTagHidden)->wait();
    return Tensor();
  }
  return s.ctx.logits;
}

}  // namespace tessera
