// params.cpp: building the parameter layout and the counter-based initialization.
#include "model/params.hpp"

#include <algorithm>
#include <cmath>

#include "core/rng.hpp"
#include "core/test_hooks.hpp"
#include "model/mtp.hpp"
#include "model/parts.hpp"

namespace tessera {

void ParamSpecBuilder::add(std::string name, Shape global, int split_axis, ParamInit init,
                           double std, bool decay, int64_t init_rows) {
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

void ParamSpecBuilder::norm(const std::string& name, int64_t width) {
  // --apply-layernorm-1p: the norms apply (1 + w), so w starts at 0 (Megatron's zero-centred
  // gamma).
  add(name + ".weight", {width}, -1, cfg.apply_layernorm_1p ? ParamInit::Zeros : ParamInit::Ones, 0,
      false);
  if (!cfg.rmsnorm()) add(name + ".bias", {width}, -1, ParamInit::Zeros, 0, false);
}

double ParamSpecBuilder::out_std() const {
  return cfg.init_method_std / std::sqrt(2.0 * cfg.num_layers);
}

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
                           int virtual_stages, const PipelineSplitOptions& split) {
  const int mtp = cfg.mtp() ? cfg.mtp_num_layers : 0;
  const std::vector<StageSpan> spans =
      split_stages(split, cfg.num_layers, mtp, pp_size, split.layout.empty() ? virtual_stages : 0);
  const int V = static_cast<int>(spans.size()) / pp_size;
  TESSERA_CHECK(pp_rank >= 0 && pp_rank < pp_size, "pipeline rank ", pp_rank, " of ", pp_size);
  ModelShard s;
  s.tp_size = tp_size;
  s.tp_rank = tp_rank;
  s.chunks.clear();
  for (int c = 0; c < V; ++c) {
    const StageSpan& sp = spans[static_cast<size_t>(c * pp_size + pp_rank)];
    s.chunks.push_back({sp.begin, sp.end});
  }
  s.has_embedding = spans[static_cast<size_t>(pp_rank)].embedding;
  const StageSpan& last = spans[static_cast<size_t>((V - 1) * pp_size + pp_rank)];
  s.has_head = last.loss;
  if (last.mtp > 0) {
    s.mtp_begin = cfg.num_layers;
    s.mtp_count = last.mtp;
  }
  return s;
}

namespace {
// The specs of `shard`: the embedding, each layer's norms and its parts' parameters (each part's
// add_params, model/parts.hpp), the head with multi-token prediction's (model/mtp.hpp).
std::vector<ParamSpec> shard_specs(const GPTConfig& cfg, const ModelShard& shard, bool one_expert) {
  const int64_t h = cfg.hidden_size, V = cfg.padded_vocab_size(shard.tp_size);
  const double std = cfg.init_method_std;
  ParamSpecBuilder b{cfg, shard, one_expert, {}, 0};
  // The tied word embedding lives on the first stage, and a copy on the last (Megatron's scheme);
  // untied, the last stage has an output layer of its own.
  // Multi-token prediction on a stage of its own embeds the shifted tokens with a copy too.
  if (shard.has_embedding || (shard.has_head && cfg.embedding_on_last_stage()) ||
      shard.mtp_count > 0)
    b.add("wte", {V, h}, 0, ParamInit::Normal, std, true, cfg.vocab_size);
  if (shard.has_embedding && cfg.learned_positions())
    b.add("wpe", {cfg.max_positions(), h}, -1, ParamInit::Normal, std, true);
  auto norm = [&](const std::string& name) { b.norm(name, h); };
  const std::vector<LayerSpec> specs = build_layer_specs(cfg);
  for (int l : shard.layers()) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const LayerSpec& spec = specs[static_cast<size_t>(l)];
    norm(p + "ln1");
    make_attention_part(spec, cfg, shard, nullptr)->add_params(b, l);
    norm(p + "ln2");
    make_mlp_part(spec, cfg, shard, nullptr)->add_params(b, l);
  }
  if (shard.head_piece()) {
    if (shard.has_head) norm("lnf");
    // The output layer; multi-token prediction on a stage of its own reads a copy.
    if (!cfg.tied_head()) b.add("lm_head", {V, h}, 0, ParamInit::Normal, std, true, cfg.vocab_size);
    MtpHead::add_params(b);  // multi-token prediction's (its layers' are above)
  }
  return std::move(b.specs);
}
}  // namespace

std::vector<ParamSpec> build_param_specs(const GPTConfig& cfg, const ModelShard& shard) {
  return shard_specs(cfg, shard, false);
}

std::vector<ParamSpec> counted_param_specs(const GPTConfig& cfg, const ModelShard& shard) {
  return shard_specs(cfg, shard, true);
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

namespace {
// The model's parameters as Hugging Face counts them: every parameter spec of the whole model (one
// rank, one stage) with `experts_counted` of each MoE layer's experts, the vocabulary unpadded,
// and the routers' expert biases (state here, a buffer there).
int64_t count_parameters(const GPTConfig& c, int64_t experts_counted) {
  const ModelShard whole = model_shard_for(c, 1, 0, 1, 0);
  const int64_t padding = c.padded_vocab_size(1) - c.vocab_size;
  int64_t n = 0;
  for (const ParamSpec& s : shard_specs(c, whole, true)) {
    n += s.expert ? s.numel() * experts_counted : s.numel();
    if (s.name == "wte" || s.name == "lm_head") n -= padding * c.hidden_size;
  }
  if (c.moe_router_enable_expert_bias)
    for (const LayerSpec& l : build_layer_specs(c))
      if (l.mlp == MlpKind::MoE) n += c.num_experts;
  return n;
}
}  // namespace

int64_t GPTConfig::num_parameters() const {
  return count_parameters(*this, num_experts);
}

int64_t GPTConfig::num_active_parameters() const {
  return count_parameters(*this, moe_router_topk);
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
  TESSERA_CHECK(l.shards >= 1 && l.shard_split >= 1 && l.bucket_elems >= 0, "bad flat layout");
  const int n = static_cast<int>(specs.size());
  // Group whole parameters into buckets from the last one backwards.
  std::vector<FlatBucket> buckets;
  auto alone = [&](int k) {
    return (l.embedding_alone && specs[k].name == "wte") ||
           (l.head_alone && specs[k].name == "lm_head");
  };
  auto same_unit = [&](int a, int b) {
    return !l.fsdp_units || fsdp_unit_of(specs[a].name) == fsdp_unit_of(specs[b].name);
  };
  for (int i = n - 1; i >= 0;) {
    FlatBucket b;
    b.end_param = i + 1;
    b.expert = l.experts_apart && specs[i].expert;
    if (alone(i)) {
      --i;
    } else {
      int64_t size = 0;
      const int last = i;
      while (i >= 0 && !alone(i) && (!l.experts_apart || specs[i].expert == b.expert) &&
             (l.fsdp_units ? same_unit(i, last)
                           : size == 0 || l.bucket_elems == 0 || size < l.bucket_elems ||
                                 specs[i].glue_next)) {
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
    const int64_t pad = int64_t(l.shards) * l.shard_split;
    offset = (offset - it->begin + pad - 1) / pad * pad + it->begin;
    it->end = offset;
  }
  return buckets;
}

ParamStore::ParamStore(std::vector<ParamSpec> specs, Allocator& alloc, DType compute,
                       const FlatLayout& layout)
    : specs_(std::move(specs)), layout_(layout), compute_(compute) {
  TESSERA_CHECK(compute == DType::F32 || compute == DType::BF16 || compute == DType::F16,
                "compute dtype must be f32, bf16 or f16");
  TESSERA_CHECK(layout_.master || compute != DType::F32 || layout_.units_only_compute,
                "f32 training keeps its f32 parameters: they are the compute weights");
  TESSERA_CHECK(!(layout_.units_only_grads || layout_.units_only_compute) || layout_.fsdp_units,
                "unit-only buffers need the FSDP unit layout");
  TESSERA_CHECK(!layout_.units_only_compute || !layout_.master,
                "sharded parameters keep no full f32 master buffer");
  buckets_ = layout_flat_buffer(specs_, layout_);
  int64_t total = 0;
  for (const FlatBucket& b : buckets_) total = std::max(total, b.end);
  numel_ = total;
  for (size_t i = 0; i < specs_.size(); ++i) index_[specs_[i].name] = i;
  bucket_of_.assign(specs_.size(), -1);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (int p = buckets_[b].first_param; p < buckets_[b].end_param; ++p)
      bucket_of_[static_cast<size_t>(p)] = static_cast<int>(b);
  if (layout_.master) flat_params_ = Tensor({total}, DType::F32, alloc);
  if (layout_.units_only_grads) {
    for (const FlatBucket& b : buckets_)
      unit_grads_.push_back(Tensor::unbound({b.numel()}, DType::F32, alloc));
  } else {
    flat_grads_ = Tensor({total}, DType::F32, alloc);
  }
  if (layout_.units_only_compute) {
    for (const FlatBucket& b : buckets_)
      unit_compute_.push_back(Tensor::unbound({b.numel()}, compute, alloc));
  } else {
    flat_compute_ = compute == DType::F32 ? flat_params_ : Tensor({total}, compute, alloc);
  }
}

std::string fsdp_unit_of(const std::string& name) {
  if (name.rfind("layers.", 0) == 0) return name.substr(0, name.find('.', 7));
  if (name == "wte" || name == "wpe") return "embedding";
  return "head";
}

void ParamStore::check_flat(const Tensor& t, const char* what) {
  TESSERA_CHECK(t.defined(), "this rank's ", what,
                " have no flat buffer: FSDP holds them unit by unit (step/fsdp.hpp)");
}

Tensor ParamStore::bucket_grads(int b) const {
  if (layout_.units_only_grads) return unit_grads_[static_cast<size_t>(b)];
  const FlatBucket& fb = buckets_[static_cast<size_t>(b)];
  return flat_grads_.view(fb.begin, {fb.numel()});
}

Tensor ParamStore::bucket_compute(int b) const {
  if (layout_.units_only_compute) return unit_compute_[static_cast<size_t>(b)];
  const FlatBucket& fb = buckets_[static_cast<size_t>(b)];
  return flat_compute_.view(fb.begin, {fb.numel()});
}

Tensor ParamStore::flat_view(bool grads, const ParamSpec& s, Shape shape) const {
  const bool units = grads ? layout_.units_only_grads : layout_.units_only_compute;
  if (!units) return (grads ? flat_grads_ : flat_compute_).view(s.flat_offset, std::move(shape));
  const int b = bucket_of_[index_.at(s.name)];
  const Tensor& unit = (grads ? unit_grads_ : unit_compute_)[static_cast<size_t>(b)];
  return unit.view(s.flat_offset - buckets_[static_cast<size_t>(b)].begin, std::move(shape));
}

void ParamStore::check_master() const {
  TESSERA_CHECK(layout_.master,
                "this rank keeps no full f32 master weights: the distributed optimizer holds "
                "those of its blocks");
}

namespace {
Shape fused_shape(const ParamSpec& a, const ParamSpec& b) {
  TESSERA_CHECK(a.glue_next && a.flat_offset + a.numel() == b.flat_offset, a.name, " and ", b.name,
                " are not glued in the flat buffers");
  const int64_t cols = a.local_shape.back();
  TESSERA_CHECK(b.local_shape.back() == cols, a.name, " and ", b.name, " differ in columns");
  return {(a.numel() + b.numel()) / cols, cols};
}
}  // namespace

Tensor ParamStore::compute_fused(const std::string& first, const std::string& second) const {
  const ParamSpec &a = spec(first), &b = spec(second);
  return flat_view(false, a, fused_shape(a, b));
}

Tensor ParamStore::grad_fused(const std::string& first, const std::string& second) const {
  const ParamSpec &a = spec(first), &b = spec(second);
  return flat_view(true, a, fused_shape(a, b));
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

int piece_slot(int piece, const ModelShard& shard) {
  if (piece == kEmbedPiece) return 0;
  if (piece == kHeadPiece) return 1;
  return 2 + shard.local_index(piece);
}

int num_piece_slots(const ModelShard& shard) {
  return 2 + shard.num_layers();
}

std::vector<std::vector<int>> buckets_of_pieces(const std::vector<ParamSpec>& specs,
                                                const std::vector<FlatBucket>& buckets,
                                                const ModelShard& shard) {
  const auto pieces = param_pieces(specs, shard);
  std::vector<std::vector<int>> out(static_cast<size_t>(num_piece_slots(shard)));
  for (size_t b = 0; b < buckets.size(); ++b)
    for (int p = buckets[b].first_param; p < buckets[b].end_param; ++p)
      for (int piece : pieces[static_cast<size_t>(p)]) {
        auto& list = out[static_cast<size_t>(piece_slot(piece, shard))];
        if (list.empty() || list.back() != static_cast<int>(b)) list.push_back(static_cast<int>(b));
      }
  return out;
}

std::vector<std::vector<int>> param_pieces(const std::vector<ParamSpec>& specs,
                                           const ModelShard& shard) {
  std::vector<std::vector<int>> out;
  for (const ParamSpec& s : specs) {
    std::vector<int> pieces;
    if (s.name == "wte") {
      if (shard.head_piece()) pieces.push_back(kHeadPiece);
      if (shard.has_embedding) pieces.push_back(kEmbedPiece);
    } else if (s.name == "wpe") {
      pieces.push_back(kEmbedPiece);
    } else if (s.name.rfind("lnf.", 0) == 0 || s.name == "lm_head" ||
               s.name.rfind("mtp.", 0) == 0) {
      pieces.push_back(kHeadPiece);
    } else {  // "layers.<l>.…" (multi-token prediction's layers run in the head piece)
      const int l = std::stoi(s.name.substr(7, s.name.find('.', 7) - 7));
      pieces.push_back(shard.is_mtp_layer(l) ? kHeadPiece : l);
    }
    out.push_back(std::move(pieces));
  }
  return out;
}

}  // namespace tessera
