// activation_slots.cpp: a rank's activation buffers for (B,T) micro-batches, built once for the
// model (GPTModel::make_activation_slots) and counted for the estimate (activation_footprint,
// --dry-run) by the same code: the plumbing's buffers here, each layer's parts' through them.
#include <algorithm>

#include "model/gpt.hpp"
#include "model/recompute.hpp"
#include "model/slots.hpp"

namespace tessera {

SlotBuilder::SlotBuilder(const GPTConfig& config, const ModelShard& model_shard, int batch, int seq,
                         DType dtype, Allocator& alloc, bool for_inference)
    : cfg(config),
      shard(model_shard),
      B(batch),
      T(seq),
      compute(dtype),
      al(alloc),
      inference(for_inference) {
  const std::vector<LayerSpec> all = build_layer_specs(cfg);
  for (int l : shard.layers()) {
    specs.push_back(all[static_cast<size_t>(l)]);
    attention.push_back(make_attention_part(specs.back(), cfg, shard, nullptr));
    mlp.push_back(make_mlp_part(specs.back(), cfg, shard, nullptr));
    fl_max = std::max(fl_max, mlp.back()->dense_width());
  }
}

void SlotBuilder::norm(Tensor& out, Tensor& mean, Tensor& rstd) const {
  out = f({N, C});
  if (!cfg.rmsnorm()) mean = f32({Nl});
  rstd = f32({Nl});
}

namespace {

// Every buffer of layer l, nothing recomputed.
void layer_buffers(const SlotBuilder& sb, int l, LayerActivations& la, bool res2) {
  const AttentionPart& at = sb.attention_of(l);
  const MlpPart& mlp = sb.mlp_of(l);
  sb.norm(la.ln1, la.ln1_mean, la.ln1_rstd);
  sb.norm(la.ln2, la.ln2_mean, la.ln2_rstd);
  mlp.recomputed_buffers(sb, la, mlp.dense_width());
  at.core_buffers(sb, la);
  at.kept_buffers(sb, la);
  la.res1 = sb.res();
  mlp.kept_buffers(sb, la, mlp.dense_width());
  if (res2) la.res2 = sb.res();
}

// The recompute working set every layer shares (one set per position of a chunk with full
// recomputation, one with selective): for the widest layer of every kind on this rank, each
// layer's view of it cut by its MLP part (fit).
void shared_layer_buffers(const SlotBuilder& sb, LayerActivations& la, bool kept, bool res2) {
  sb.norm(la.ln1, la.ln1_mean, la.ln1_rstd);
  sb.norm(la.ln2, la.ln2_mean, la.ln2_rstd);
  for (const auto& m : sb.mlp) m->recomputed_buffers(sb, la, sb.fl_max);
  for (const auto& at : sb.attention) at->core_buffers(sb, la);
  if (!kept) return;
  for (const auto& at : sb.attention) at->kept_buffers(sb, la);
  la.res1 = sb.res();
  for (const auto& m : sb.mlp) m->kept_buffers(sb, la, sb.fl_max);
  if (res2) la.res2 = sb.res();
}

// The scratch of the passes, shared by every slot.
Activations shared_buffers(const SlotBuilder& sb) {
  Activations shared;
  shared.tmp_c = sb.f({sb.N, sb.C});
  shared.dln = sb.f({sb.N, sb.C});
  for (const auto& at : sb.attention) at->shared_buffers(sb, shared);
  for (const auto& m : sb.mlp) m->shared_buffers(sb, shared);
  if (sb.shard.cp_size > 1) {  // context parallelism's ring (model/context_parallel.cpp)
    const int64_t kvl = sb.qkvl - sb.hl;
    for (int i = 0; i < 2; ++i) {
      shared.cp_kv[i] = sb.f({sb.B, sb.T, kvl});
      shared.cp_dkv[i] = sb.f({sb.B, sb.T, kvl});
    }
    shared.cp_dkv_mine = sb.f({sb.B, sb.T, kvl});
    shared.cp_out = sb.f({sb.B, sb.T, sb.hl});
    shared.cp_lse = sb.f32({sb.B, sb.heads_l, sb.T});
    if (sb.cfg.rope()) shared.cp_positions = sb.i32({sb.N});
    if (sb.cfg.learned_positions() && sb.shard.has_embedding) {
      shared.cp_wpe = sb.f({sb.T, sb.C});
      shared.cp_dwpe = sb.f32({sb.T, sb.C});
    }
  }
  return shared;
}

// Multi-token prediction's depths: each layer keeps everything (no recomputation), and its
// embedding, norms, projection, final norm, logits and losses; the scratch once per slot set.
void mtp_buffers(const SlotBuilder& sb, Activations& a, Activations& shared) {
  const ModelShard& shard = sb.shard;
  if (shard.mtp_count == 0) return;
  const int64_t Nl = sb.Nl, N = sb.N, C = sb.C;
  for (int k = 0; k < shard.mtp_count; ++k) {
    const int l = shard.mtp_begin + k;
    LayerActivations la;
    layer_buffers(sb, l, la, true);
    sb.mlp_of(l).fit(sb, la);
    a.layers.push_back(std::move(la));
    MtpActivations m;
    m.ids = sb.i32({sb.B, sb.T});
    m.targets = sb.i32({sb.B, sb.T});
    m.emb = sb.res();
    m.e_n = sb.res();
    m.h_n = sb.res();
    if (!sb.cfg.rmsnorm())
      m.e_mean = sb.f32({Nl}), m.h_mean = sb.f32({Nl}), m.lnf_mean = sb.f32({Nl});
    m.e_rstd = sb.f32({Nl});
    m.h_rstd = sb.f32({Nl});
    m.cat = sb.f({Nl, 2 * C});
    m.x = sb.res();
    m.lnf = sb.f({N, C});
    m.lnf_rstd = sb.f32({Nl});
    m.logits = sb.f({N, sb.vl});
    m.losses = sb.f32({N});
    a.mtp.push_back(std::move(m));
  }
  if (!a.rowmax.defined()) {  // a stage of its own: the cross-entropy's row statistics
    a.rowmax = sb.f32({N});
    a.sumexp = sb.f32({N});
    a.target_logit = sb.f32({N});
  }
  if (!shared.mtp_dmain.defined()) {
    shared.mtp_dmain = sb.res();
    shared.mtp_dh = sb.res();
    shared.mtp_demb = sb.f({N, C});
    shared.mtp_dcat = sb.f({Nl, 2 * C});
    shared.mtp_de = sb.f({Nl, C});
    shared.mtp_dhn = sb.f({Nl, C});
  }
  a.mtp_dmain = shared.mtp_dmain;
  a.mtp_dh = shared.mtp_dh;
  a.mtp_demb = shared.mtp_demb;
  a.mtp_dcat = shared.mtp_dcat;
  a.mtp_de = shared.mtp_de;
  a.mtp_dhn = shared.mtp_dhn;
}

// The head's buffers: the final norm, the logits and the loss statistics.
void head_buffers(const SlotBuilder& sb, Activations& a) {
  a.lnf = sb.f({sb.N, sb.C});
  if (!sb.cfg.rmsnorm()) a.lnf_mean = sb.f32({sb.Nl});
  a.lnf_rstd = sb.f32({sb.Nl});
  a.logits = sb.f({sb.N, sb.vl});
  a.losses = sb.f32({sb.N});
  a.rowmax = sb.f32({sb.N});
  a.sumexp = sb.f32({sb.N});
  a.target_logit = sb.f32({sb.N});
}

std::vector<Activations> build_activation_slots(const GPTConfig& cfg, const ModelShard& shard,
                                                const std::vector<LayerRecompute>& plan, int B,
                                                int T, DType compute, Allocator& al,
                                                const std::vector<int>& counts) {
  const SlotBuilder sb(cfg, shard, B, T, compute, al);
  Activations shared = shared_buffers(sb);
  size_t max_chunk = 0;
  bool selective = false;
  for (const LayerRecompute& p : plan) {
    if (p.kind == RecomputeGranularity::Full)
      max_chunk = std::max(max_chunk, static_cast<size_t>(p.chunk_end - p.chunk_begin));
    selective |= p.kind == RecomputeGranularity::Selective;
  }
  // Full: position j of a chunk uses work[j]; the output of a chunk's last layer is the next
  // chunk's input and is kept per micro-batch, so the last position needs no res2 here.
  std::vector<LayerActivations> work(max_chunk);
  for (size_t j = 0; j < max_chunk; ++j) shared_layer_buffers(sb, work[j], true, j + 1 < max_chunk);
  LayerActivations sel;  // selective: one set, refilled before each layer's backward
  if (selective) shared_layer_buffers(sb, sel, false, false);
  std::vector<Activations> slots;
  TESSERA_CHECK(static_cast<int>(counts.size()) == shard.num_chunks(),
                "activation slots: one count per model chunk");
  for (int c = 0; c < shard.num_chunks(); ++c)
    for (int k = 0; k < counts[c]; ++k) {
      Activations a = shared;
      a.B = B;
      a.T = T;
      a.chunk = c;
      const LayerRange& chunk = shard.chunks[c];
      a.ids = Tensor({B, T}, DType::I32, al);
      a.targets = Tensor({B, T}, DType::I32, al);
      a.input = sb.res();
      a.dres = sb.res();
      for (int l = chunk.begin; l < chunk.end; ++l) {
        const LayerRecompute& p = plan[static_cast<size_t>(shard.local_index(l))];
        const MlpPart& mlp = sb.mlp_of(l);
        LayerActivations la;
        switch (p.kind) {
          case RecomputeGranularity::None:
            layer_buffers(sb, l, la, true);
            break;
          case RecomputeGranularity::Selective:
            la = sel;
            mlp.fit(sb, la);  // cut to this layer before its kept buffers join
            sb.attention_of(l).kept_buffers(sb, la);
            la.res1 = sb.res();
            mlp.kept_buffers(sb, la, mlp.dense_width());
            la.res2 = sb.res();
            break;
          case RecomputeGranularity::Full:
            la = work[static_cast<size_t>(l - p.chunk_begin)];
            if (p.chunk_last(l)) la.res2 = sb.res();
            break;
        }
        mlp.fit(sb, la);
        a.layers.push_back(std::move(la));
      }
      if (c == shard.num_chunks() - 1) {
        if (shard.has_head) head_buffers(sb, a);
        mtp_buffers(sb, a, shared);  // multi-token prediction's layers (kept whole) and tensors
      }
      slots.push_back(std::move(a));
    }
  return slots;
}

// Hands out no memory; counts the bytes asked for.
class CountingAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    bytes_ += static_cast<double>(bytes);
    return &dummy_;
  }
  void deallocate(void*, size_t) override {}
  Device device() const override { return Device::CPU; }
  double bytes() const { return bytes_; }

 private:
  double bytes_ = 0;
  char dummy_ = 0;
};

}  // namespace

double activation_bytes(const GPTConfig& cfg, const ModelShard& shard, const RecomputeConfig& rc,
                        int B, int T, DType compute, const std::vector<int>& counts) {
  CountingAllocator al;
  build_activation_slots(cfg, shard, plan_recompute(rc, shard), B, T, compute, al, counts);
  return al.bytes();
}

double weight_pass_bytes(const GPTConfig& cfg, const ModelShard& shard, int B, int T, DType compute,
                         int chunk) {
  CountingAllocator al;
  const SlotBuilder sb(cfg, shard, B, T, compute, al);
  int64_t n = 0;
  auto layer = [&](int l) {
    n += sb.attention_of(l).deferred_elements(sb) + sb.mlp_of(l).deferred_elements(sb);
  };
  // A tied output layer's table also takes the embedding's scatters in W: their gradient and ids.
  int64_t ids = 0;
  auto embedding = [&] {
    if (!cfg.tied_head()) return;
    n += sb.N * sb.C;
    ids += sb.N;
  };
  const LayerRange& c = shard.chunks[static_cast<size_t>(chunk)];
  if (chunk == 0 && shard.has_embedding) embedding();
  for (int l = c.begin; l < c.end; ++l) layer(l);
  if (chunk == shard.num_chunks() - 1) {
    if (shard.has_head) n += sb.N * (sb.C + sb.vl);  // the output layer
    for (int k = 0; k < shard.mtp_count; ++k) {      // each depth's output layer, projection, layer
      n += sb.N * (sb.C + sb.vl) + sb.N * (2 * sb.C + sb.C);
      layer(shard.mtp_begin + k);
      embedding();
    }
  }
  return static_cast<double>(n) * dtype_size(compute) + 4.0 * static_cast<double>(ids);
}

ActivationFootprint activation_footprint(const GPTConfig& cfg, const ModelShard& shard,
                                         const RecomputeConfig& rc, int B, int T, DType compute) {
  const int V = shard.num_chunks();
  const double one = activation_bytes(cfg, shard, rc, B, T, compute, std::vector<int>(V, 1));
  const double two = activation_bytes(cfg, shard, rc, B, T, compute, std::vector<int>(V, 2));
  ActivationFootprint fp;
  fp.per_micro_batch = two - one;
  fp.shared = one - fp.per_micro_batch;
  return fp;
}

std::vector<Activations> GPTModel::make_activation_slots(int B, int T, int count) const {
  return make_activation_slots(B, T, std::vector<int>(shard_.num_chunks(), count));
}

std::vector<Activations> GPTModel::make_activation_slots(int B, int T,
                                                         const std::vector<int>& counts) const {
  TESSERA_CHECK(T <= cfg_.max_positions(), "sequence of ", T, " tokens exceeds the ",
                cfg_.max_positions(), " positions of the model");
  int count = 0;
  for (int c : counts) count += c;
  AllocationLabel label(
      count == 1 ? detail::concat("the activations of one micro-batch (", B, " x ", T, " tokens)")
                 : detail::concat("the activations of ", count, " micro-batches in flight (", B,
                                  " x ", T, " tokens each)"));
  std::vector<Activations> slots =
      build_activation_slots(cfg_, shard_, plan_, B, T, compute_, be_.allocator(), counts);
  if (!slots.empty() && slots[0].cp_positions.defined()) {  // shared by every slot
    TESSERA_CHECK(T % 2 == 0, "context parallelism: ", T, " tokens per rank is odd");
    std::vector<int32_t> pos(static_cast<size_t>(B) * T);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        pos[static_cast<size_t>(b) * T + t] =
            static_cast<int32_t>(cp_position(shard_.cp_rank, shard_.cp_size, T / 2, t));
    be_.copy_from_host(slots[0].cp_positions, pos.data());
  }
  return slots;
}

Activations GPTModel::make_decode_activations(int64_t n, int64_t S, Allocator& al) const {
  TESSERA_CHECK(!services_->sequence_parallel() && shard_.num_chunks() == 1,
                "generation runs without sequence parallelism and virtual pipeline stages");
  const SlotBuilder sb(cfg_, shard_, 1, static_cast<int>(n), compute_, al, true);
  Activations a;
  a.B = 1;
  a.T = static_cast<int>(n);
  a.ids = sb.i32({1, n});
  a.doc_positions = sb.i32({n});  // each row's position: RoPE and the learned positions read it
  a.tmp_c = sb.f({n, sb.C});
  for (const auto& at : sb.attention) at->shared_buffers(sb, a);  // the forward's scratch
  for (const auto& m : sb.mlp) m->shared_buffers(sb, a);
  LayerActivations la;  // every part's forward buffers, for the widest of each kind
  shared_layer_buffers(sb, la, true, true);
  a.input = la.res2;  // the hidden state runs through the layers in place
  if (cfg_.learned_positions() && shard_.has_embedding) a.doc_wpe = sb.f({n, sb.C});
  const LayerRange& chunk = shard_.chunks[0];
  for (int l = chunk.begin; l < chunk.end; ++l) {
    LayerActivations layer = la;
    sb.mlp_of(l).fit(sb, layer);
    a.layers.push_back(std::move(layer));
  }
  if (shard_.has_head) {  // the output rows' final norm and logits
    a.lnf = sb.f({S, sb.C});
    if (!cfg_.rmsnorm()) a.lnf_mean = sb.f32({S});
    a.lnf_rstd = sb.f32({S});
    a.logits = sb.f({S, sb.vl});
  }
  return a;
}

}  // namespace tessera
