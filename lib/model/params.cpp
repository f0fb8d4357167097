// params.cpp: building the parameter layout and the counter-based initialization.
#include "model/params.hpp"

#include <algorithm>
#include <cmath>

#include "core/rng.hpp"
#include "core/test_hooks.hpp"

namespace tessera {

namespace {

struct SpecBuilder {
  const ModelShard& shard;
  std::vector<ParamSpec> specs;
  int64_t offset = 0;

  // split_axis -1: replicated. Otherwise the global extent along the axis is split evenly.
  void add(std::string name, Shape global, int split_axis, ParamInit init, double std, bool decay,
           int64_t init_rows = -1) {
    ParamSpec s;
    s.name = std::move(name);
    s.global_shape = global;
    s.split_axis = split_axis;
    s.local_shape = global;
    if (split_axis >= 0) {
      const int64_t extent = global[split_axis];
      TESSERA_CHECK(extent % shard.tp_size == 0, s.name, " axis ", split_axis, " of ",
                    shape_str(global), " does not split over ", shard.tp_size, " ranks");
      s.local_shape[split_axis] = extent / shard.tp_size;
      s.split_offset = s.local_shape[split_axis] * shard.tp_rank;
    }
    s.init = init;
    s.init_std = std;
    s.weight_decay = decay;
    s.init_rows = init_rows;
    s.flat_offset = offset;
    offset += s.numel();
    specs.push_back(std::move(s));
  }
};

}  // namespace

std::vector<int> ModelShard::layers() const {
  std::vector<int> out;
  for (const LayerRange& c : chunks)
    for (int l = c.begin; l < c.end; ++l) out.push_back(l);
  for (int k = 0; k < mtp_count; ++k) out.push_back(mtp_begin + k);
  return out;
}

int ModelShard::num_layers() const {
  int n = mtp_count;
  for (const LayerRange& c : chunks) n += c.size();
  return n;
}

int ModelShard::local_index(int layer) const {
  int offset = 0;
  for (const LayerRange& c : chunks) {
    if (layer >= c.begin && layer < c.end) return offset + layer - c.begin;
    offset += c.size();
  }
  if (is_mtp_layer(layer)) return offset + layer - mtp_begin;
  return -1;
}

int ModelShard::chunk_of(int layer) const {
  for (size_t i = 0; i < chunks.size(); ++i)
    if (layer >= chunks[i].begin && layer < chunks[i].end) return static_cast<int>(i);
  if (is_mtp_layer(layer)) return num_chunks() - 1;  // the last chunk's activations hold them
  return -1;
}

std::string ModelShard::describe_layers() const {
  std::string out;
  for (const LayerRange& c : chunks) {
    if (c.size() == 0) continue;
    if (!out.empty()) out += ", ";
    out += std::to_string(c.begin);
    if (c.size() > 1) out += "-" + std::to_string(c.end - 1);
  }
  return out.empty() ? "none" : out;
}

ModelShard model_shard_for(const GPTConfig& cfg, int tp_size, int tp_rank, int pp_size, int pp_rank,
                           int virtual_stages) {
  TESSERA_CHECK(
      pp_size >= 1 && virtual_stages >= 1 && cfg.num_layers % (pp_size * virtual_stages) == 0,
      "--num-layers=", cfg.num_layers, " is not divisible by the pipeline size ", pp_size,
      " x virtual stages ", virtual_stages);
  ModelShard s;
  s.tp_size = tp_size;
  s.tp_rank = tp_rank;
  const int per_chunk = cfg.num_layers / (pp_size * virtual_stages);
  s.chunks.clear();
  for (int c = 0; c < virtual_stages; ++c) {
    const int begin = (c * pp_size + pp_rank) * per_chunk;
    s.chunks.push_back({begin, begin + per_chunk});
  }
  s.has_embedding = pp_rank == 0;
  s.has_head = pp_rank == pp_size - 1;
  if (s.has_head && cfg.mtp()) {
    s.mtp_begin = cfg.num_layers;
    s.mtp_count = cfg.mtp_num_layers;
  }
  return s;
}

namespace {
// Multi-latent attention's projections (model/mla.cpp): the query latent's down-projection, its
// norm and the up-projection to the heads (or one projection from the hidden state), the key/value
// latent's (its last qk_pos_emb_head_dim features: the keys' shared RoPE part), its norm and the
// up-projection to each head's keys without position and values. The latents are replicated over
// TP (every rank computes them; their gradients are summed over TP), the up-projections split by
// heads.
void mla_attention(SpecBuilder& b, const GPTConfig& cfg, const std::string& p,
                   ParamInit norm_init) {
  const int64_t h = cfg.hidden_size, heads = cfg.num_attention_heads, hd = cfg.head_dim();
  const int64_t qr = cfg.q_lora_rank, kvr = cfg.kv_lora_rank, dr = cfg.qk_pos_emb_head_dim;
  const double std = cfg.init_method_std;
  auto latent_norm = [&](const std::string& name, int64_t width) {
    if (!cfg.qk_layernorm) return;
    b.add(name + ".weight", {width}, -1, norm_init, 0, false);
    if (!cfg.rmsnorm()) b.add(name + ".bias", {width}, -1, ParamInit::Zeros, 0, false);
  };
  if (qr > 0) {
    b.add(p + "attn.q_down.weight", {qr, h}, -1, ParamInit::Normal, std, true);
    latent_norm(p + "attn.q_down_norm", qr);
    b.add(p + "attn.q_up.weight", {heads, hd, qr}, 0, ParamInit::Normal, std, true);
  } else {
    b.add(p + "attn.q_proj.weight", {heads, hd, h}, 0, ParamInit::Normal, std, true);
  }
  b.add(p + "attn.kv_down.weight", {kvr + dr, h}, -1, ParamInit::Normal, std, true);
  latent_norm(p + "attn.kv_down_norm", kvr);
  b.add(p + "attn.kv_up.weight", {heads, cfg.qk_head_dim + cfg.v_head_dim, kvr}, 0,
        ParamInit::Normal, std, true);
}

// The specs of `shard`; with `one_expert`, each MoE layer's first local expert only (every expert
// of a layer has the same shapes), so counting costs the same for 8 experts as for 10^8.
std::vector<ParamSpec> shard_specs(const GPTConfig& cfg, const ModelShard& shard, bool one_expert) {
  const int64_t h = cfg.hidden_size, heads = cfg.num_attention_heads, hd = cfg.head_dim();
  const int64_t groups = cfg.kv_heads();
  const int64_t f = cfg.ffn(), V = cfg.padded_vocab_size(shard.tp_size);
  const double std = cfg.init_method_std;
  const double out_std = std / std::sqrt(2.0 * cfg.num_layers);  // residual output projections
  const bool bias = cfg.add_bias_linear, qkv_bias = cfg.qkv_bias(), ln = !cfg.rmsnorm();
  // --apply-layernorm-1p: the norms apply (1 + w), so w starts at 0 (Megatron's zero-centred
  // gamma).
  const ParamInit norm_init = cfg.apply_layernorm_1p ? ParamInit::Zeros : ParamInit::Ones;
  SpecBuilder b{shard, {}, 0};
  // The tied word embedding lives on the first stage, and a copy on the last (Megatron's scheme);
  // untied, the last stage has an output layer of its own.
  if (shard.has_embedding || (shard.has_head && cfg.embedding_on_last_stage()))
    b.add("wte", {V, h}, 0, ParamInit::Normal, std, true, cfg.vocab_size);
  if (shard.has_embedding && cfg.learned_positions())
    b.add("wpe", {cfg.max_positions(), h}, -1, ParamInit::Normal, std, true);
  auto norm = [&](const std::string& name) {
    b.add(name + ".weight", {h}, -1, norm_init, 0, false);
    if (ln) b.add(name + ".bias", {h}, -1, ParamInit::Zeros, 0, false);
  };
  for (int l : shard.layers()) {
    const std::string p = "layers." + std::to_string(l) + ".";
    norm(p + "ln1");
    if (cfg.mla()) {
      mla_attention(b, cfg, p, norm_init);
    } else if (cfg.group_query_attention) {
      // Query heads and key/value groups split over TP separately; glued so one GEMM reads them
      // as [H/TP query | G/TP key | G/TP value] heads.
      b.add(p + "attn.q.weight", {heads, hd, h}, 0, ParamInit::Normal, std, true);
      b.specs.back().glue_next = true;
      b.add(p + "attn.kv.weight", {2, groups, hd, h}, 1, ParamInit::Normal, std, true);
      if (qkv_bias) {
        b.add(p + "attn.q.bias", {heads, hd}, 0, ParamInit::Zeros, 0, false);
        b.specs.back().glue_next = true;
        b.add(p + "attn.kv.bias", {2, groups, hd}, 1, ParamInit::Zeros, 0, false);
      }
    } else {
      b.add(p + "attn.qkv.weight", {3, heads, hd, h}, 1, ParamInit::Normal, std, true);
      if (qkv_bias) b.add(p + "attn.qkv.bias", {3, heads, hd}, 1, ParamInit::Zeros, 0, false);
    }
    if (cfg.qk_layernorm &&
        !cfg.mla()) {  // one norm of hd features for the query heads, one for keys
      for (const char* qk : {"attn.q_norm", "attn.k_norm"}) {
        b.add(p + qk + ".weight", {hd}, -1, norm_init, 0, false);
        if (ln) b.add(p + qk + ".bias", {hd}, -1, ParamInit::Zeros, 0, false);
      }
    }
    b.add(p + "attn.proj.weight", {h, heads * cfg.value_dim()}, 1, ParamInit::Normal, out_std,
          true);
    if (bias) b.add(p + "attn.proj.bias", {h}, -1, ParamInit::Zeros, 0, false);
    norm(p + "ln2");
    // An MLP of width w at `m` (fc1, fc2): the dense one, each expert, the shared expert.
    auto mlp = [&](const std::string& m, int64_t w) {
      if (cfg.swiglu) {  // [gate; up], each split over TP: a rank holds its gate and up columns
        b.add(m + "fc1.weight", {2, w, h}, 1, ParamInit::Normal, std, true);
        if (bias) b.add(m + "fc1.bias", {2, w}, 1, ParamInit::Zeros, 0, false);
      } else {
        b.add(m + "fc1.weight", {w, h}, 0, ParamInit::Normal, std, true);
        if (bias) b.add(m + "fc1.bias", {w}, 0, ParamInit::Zeros, 0, false);
      }
      b.add(m + "fc2.weight", {h, w}, 1, ParamInit::Normal, out_std, true);
      if (bias) b.add(m + "fc2.bias", {h}, -1, ParamInit::Zeros, 0, false);
    };
    if (!cfg.is_moe_layer(l)) {
      mlp(p + "mlp.", f);
      continue;
    }
    // MoE: the router (replicated; every TP rank routes its own rows), this rank's experts by
    // their global index (layout-free names), and the shared expert.
    b.add(p + "mlp.router.weight", {cfg.num_experts, h}, -1, ParamInit::Normal, std, true);
    const int e0 = shard.experts_begin(cfg.num_experts);
    const int local = shard.experts_local(cfg.num_experts);
    for (int e = e0; e < e0 + (one_expert ? std::min(local, 1) : local); ++e) {
      const size_t first = b.specs.size();
      mlp(p + "mlp.experts." + std::to_string(e) + ".", cfg.moe_ffn());
      for (size_t k = first; k < b.specs.size(); ++k) b.specs[k].expert = true;
    }
    if (cfg.moe_shared_expert_intermediate_size > 0)
      mlp(p + "mlp.shared_expert.", cfg.moe_shared_expert_intermediate_size);
  }
  if (shard.has_head) {
    norm("lnf");
    if (!cfg.tied_head()) b.add("lm_head", {V, h}, 0, ParamInit::Normal, std, true, cfg.vocab_size);
    // Multi-token prediction's depths (their transformer layers are above, after the model's):
    // the embedding's and the hidden state's norms, the projection of the two concatenated
    // (replicated over TP: row-local), the final norm.
    for (int k = 0; k < shard.mtp_count; ++k) {
      const std::string m = "mtp." + std::to_string(k) + ".";
      norm(m + "enorm");
      norm(m + "hnorm");
      b.add(m + "eh_proj.weight", {h, 2 * h}, -1, ParamInit::Normal, std, true);
      norm(m + "final_norm");
    }
  }
  return std::move(b.specs);
}
}  // namespace

std::vector<ParamSpec> build_param_specs(const GPTConfig& cfg, const ModelShard& shard) {
  return shard_specs(cfg, shard, false);
}

ParamCount count_param_specs(const GPTConfig& cfg, const ModelShard& shard) {
  ParamCount c;
  const int64_t local = shard.experts_local(cfg.num_experts);
  for (const ParamSpec& s : shard_specs(cfg, shard, true)) {
    const int64_t n = s.expert ? s.numel() * local : s.numel();
    c.parameters += n;
    if (s.expert) c.expert_parameters += n;
  }
  return c;
}

int64_t global_element_index(const ParamSpec& spec, int64_t local_index) {
  if (spec.split_axis < 0) return local_index;
  const int ax = spec.split_axis;
  int64_t inner = 1;
  for (size_t d = ax + 1; d < spec.global_shape.size(); ++d) inner *= spec.global_shape[d];
  const int64_t local_extent = spec.local_shape[ax], global_extent = spec.global_shape[ax];
  const int64_t i = local_index % inner;
  const int64_t a = (local_index / inner) % local_extent;
  const int64_t o = local_index / (inner * local_extent);
  return (o * global_extent + a + spec.split_offset) * inner + i;
}

void init_param(const ParamSpec& spec, uint64_t seed, float* out) {
  const int64_t n = spec.numel();
  if (spec.init != ParamInit::Normal) {
    const float v = spec.init == ParamInit::Ones ? 1.f : 0.f;
    for (int64_t i = 0; i < n; ++i) out[i] = v;
    return;
  }
  const CounterRng rng(seed, stable_hash(spec.name));
  int64_t row_elems = 1;
  for (size_t d = 1; d < spec.global_shape.size(); ++d) row_elems *= spec.global_shape[d];
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = global_element_index(spec, i);
    if (spec.init_rows >= 0 && g / row_elems >= spec.init_rows)
      out[i] = 0.f;  // padded vocabulary rows: never looked up, never in the loss
    else
      out[i] = static_cast<float>(spec.init_std * rng.normal(static_cast<uint64_t>(g)));
  }
  if (const float p = test_hooks::perturb_init(); p != 0.f)
    for (int64_t i = 0; i < n; ++i) out[i] *= 1.f + p;
}

std::vector<FlatBucket> layout_flat_buffer(std::vector<ParamSpec>& specs, const FlatLayout& l) {
  TESSERA_CHECK(l.shards >= 1 && l.bucket_elems >= 0, "bad flat layout");
  const int n = static_cast<int>(specs.size());
  // Group whole parameters into buckets from the last one backwards.
  std::vector<FlatBucket> buckets;
  auto alone = [&](int k) { return l.embedding_alone && specs[k].name == "wte"; };
  for (int i = n - 1; i >= 0;) {
    FlatBucket b;
    b.end_param = i + 1;
    b.expert = l.experts_apart && specs[i].expert;
    if (alone(i)) {
      --i;
    } else {
      int64_t size = 0;
      while (i >= 0 && !alone(i) && (!l.experts_apart || specs[i].expert == b.expert) &&
             (size == 0 || l.bucket_elems == 0 || size < l.bucket_elems || specs[i].glue_next)) {
        size += specs[i].numel();
        --i;
      }
    }
    b.first_param = i + 1;
    buckets.push_back(b);
  }
  // Offsets from the start of the buffer; each bucket padded to a multiple of the shards.
  int64_t offset = 0;
  for (auto it = buckets.rbegin(); it != buckets.rend(); ++it) {
    it->begin = offset;
    for (int p = it->first_param; p < it->end_param; ++p) {
      specs[p].flat_offset = offset;
      offset += specs[p].numel();
    }
    offset = (offset - it->begin + l.shards - 1) / l.shards * l.shards + it->begin;
    it->end = offset;
  }
  return buckets;
}

ParamStore::ParamStore(std::vector<ParamSpec> specs, Allocator& alloc, DType compute,
                       const FlatLayout& layout)
    : specs_(std::move(specs)), layout_(layout) {
  TESSERA_CHECK(compute == DType::F32 || compute == DType::BF16 || compute == DType::F16,
                "compute dtype must be f32, bf16 or f16");
  TESSERA_CHECK(layout_.master || compute != DType::F32,
                "f32 training keeps its f32 parameters: they are the compute weights");
  buckets_ = layout_flat_buffer(specs_, layout_);
  int64_t total = 0;
  for (const FlatBucket& b : buckets_) total = std::max(total, b.end);
  for (size_t i = 0; i < specs_.size(); ++i) index_[specs_[i].name] = i;
  if (layout_.master) flat_params_ = Tensor({total}, DType::F32, alloc);
  flat_grads_ = Tensor({total}, DType::F32, alloc);
  flat_compute_ = compute == DType::F32 ? flat_params_ : Tensor({total}, compute, alloc);
}

void ParamStore::check_master() const {
  TESSERA_CHECK(layout_.master,
                "this rank keeps no full f32 master weights: the distributed optimizer holds "
                "those of its blocks");
}

namespace {
Tensor fused_view(const Tensor& flat, const ParamSpec& a, const ParamSpec& b) {
  TESSERA_CHECK(a.glue_next && a.flat_offset + a.numel() == b.flat_offset, a.name, " and ", b.name,
                " are not glued in the flat buffers");
  const int64_t cols = a.local_shape.back();
  TESSERA_CHECK(b.local_shape.back() == cols, a.name, " and ", b.name, " differ in columns");
  return flat.view(a.flat_offset, {(a.numel() + b.numel()) / cols, cols});
}
}  // namespace

Tensor ParamStore::compute_fused(const std::string& first, const std::string& second) const {
  return fused_view(flat_compute_, spec(first), spec(second));
}

Tensor ParamStore::grad_fused(const std::string& first, const std::string& second) const {
  return fused_view(flat_grads_, spec(first), spec(second));
}

Tensor ParamStore::compute_param(const std::string& name) const {
  return compute_param(spec(name));
}

const ParamSpec& ParamStore::spec(const std::string& name) const {
  auto it = index_.find(name);
  TESSERA_CHECK(it != index_.end(), "no parameter named ", name, " on this rank");
  return specs_[it->second];
}
Tensor ParamStore::param(const std::string& name) const {
  return param(spec(name));
}
Tensor ParamStore::grad(const std::string& name) const {
  return grad(spec(name));
}

std::vector<ParamSpec> global_param_specs(const GPTConfig& cfg) {
  return build_param_specs(cfg, model_shard_for(cfg, 1, 0, 1, 0));
}

}  // namespace tessera
