// config_schema.cpp: the model's options as one table (model/config_schema.hpp). A row is built
// by a small builder (integer, flag, real, text) or, for the few packed or implied attributes of
// earlier checkpoints, by hand.
#include "model/config_schema.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <utility>

#include "core/error.hpp"
#include "model/schema_rows.hpp"

namespace tessera {

namespace {

using namespace schema;  // NOLINT: the row builders

bool rope(const GPTConfig& c) {
  return c.rope();
}
bool yarn(const GPTConfig& c) {
  return c.rope() && c.yarn();
}
bool rope_scaling(const GPTConfig& c) {
  return c.rope() && c.use_rope_scaling;
}
bool mla(const GPTConfig& c) {
  return c.mla();
}
bool moe(const GPTConfig& c) {
  return c.moe();
}
bool moe_groups(const GPTConfig& c) {
  return c.moe() && c.moe_router_num_groups > 0;
}
int64_t experts(const GPTConfig& c) {
  return c.num_experts;
}

using C = GPTConfig;

// The shapes every checkpoint has, the norm, the Llama family's options.
void shape_fields(std::vector<ModelField>& t) {
  // The shapes: every checkpoint has them.
  t.push_back(Int("num-layers", "num_layers", &C::num_layers).range(1, 1 << 16).required());
  t.push_back(Int("hidden-size", "hidden_size", &C::hidden_size).range(1, 1 << 20).required());
  t.push_back(Int("num-attention-heads", "num_attention_heads", &C::num_attention_heads)
                  .range(1, 1 << 16)
                  .required());
  t.push_back(Int("ffn-hidden-size", "ffn_hidden_size", &C::ffn_hidden_size)
                  .range(1, 1 << 22)
                  .required()
                  .written_as([](const C& c) { return int64_t(c.ffn()); }));
  t.push_back(
      Int("seq-length", "seq_length", &C::seq_length).range(1, 1 << 24).required().not_compared());
  t.push_back(Int("max-position-embeddings", "max_position_embeddings", &C::max_position_embeddings)
                  .range(1, 1 << 24)
                  .required()
                  .written_as([](const C& c) { return int64_t(c.max_positions()); }));
  t.push_back(Int("vocab-size", "vocab_size", &C::vocab_size).range(1, 1 << 30).required());
  t.push_back(Int("make-vocab-size-divisible-by", "make_vocab_size_divisible_by",
                  &C::make_vocab_size_divisible_by)
                  .range(1, 1 << 16)
                  .required()
                  .not_compared());
  {  // the norm's epsilon, as an integer of 1e-9 units (compared so; said as the values)
    ModelField f;
    f.option = "norm-epsilon";
    f.attributes = {"layernorm_epsilon_x1e9"};
    f.write = [](const C& c, AttributeSink& out) {
      out.put("layernorm_epsilon_x1e9", int64_t(std::llround(c.layernorm_epsilon * 1e9)));
    };
    f.read = [](AttributeSource& in, C& m, const std::string& file) {
      int64_t x = 0;
      if (!in.get("layernorm_epsilon_x1e9", x))
        throw ConfigError(lacks(file, "layernorm_epsilon_x1e9"));
      m.layernorm_epsilon = static_cast<double>(x) * 1e-9;
    };
    f.mismatch = [](const C& m, const C& c, const std::string& path) {
      if (std::llround(m.layernorm_epsilon * 1e9) == std::llround(c.layernorm_epsilon * 1e9))
        return std::string();
      return differ(path, "norm-epsilon", m.layernorm_epsilon, c.layernorm_epsilon);
    };
    t.push_back(f);
  }
  // The Llama family's options (absent in checkpoints before it: GPT-2's values).
  t.push_back(
      Text("position-embedding-type", "position_embedding_type", &C::position_embedding_type));
  t.push_back(Real("rotary-base", "rotary_base", &C::rotary_base).compared_when(rope));
  t.push_back(Real("rotary-percent", "rotary_percent", &C::rotary_percent).compared_when(rope));
  t.push_back(Text("normalization", "normalization", &C::normalization));
  t.push_back(packed(
      "rope_scaling", [](const C& c) { return c.use_rope_scaling; },
      {&C::rope_scaling_factor, &C::rope_scaling_low_freq_factor, &C::rope_scaling_high_freq_factor,
       &C::rope_scaling_original_max_positions},
      nullptr, [](C& m) { m.use_rope_scaling = true; }));
  t.push_back(Flag("use-rope-scaling", "", &C::use_rope_scaling, "Llama 3's frequency scaling",
                   "no frequency scaling")
                  .when(rope));
  t.push_back(
      compared_only(Real("rope-scaling-factor", "", &C::rope_scaling_factor).when(rope_scaling)));
  t.push_back(
      compared_only(Real("rope-scaling-low-freq-factor", "", &C::rope_scaling_low_freq_factor)
                        .when(rope_scaling)));
  t.push_back(
      compared_only(Real("rope-scaling-high-freq-factor", "", &C::rope_scaling_high_freq_factor)
                        .when(rope_scaling)));
  t.push_back(compared_only(Real("rope-scaling-original-max-position-embeddings", "",
                                 &C::rope_scaling_original_max_positions)
                                .when(rope_scaling)));
}

// The MLP, attention and bias options of the Llama family, Qwen2/3 and Megatron.
void layer_fields(std::vector<ModelField>& t) {
  t.push_back(Flag("swiglu", "swiglu", &C::swiglu, "gate and up weights in mlp.fc1",
                   "no gate weights in mlp.fc1"));
  {  // grouped-query attention: the groups, or 0 without
    ModelField f;
    f.attributes = {"num_query_groups"};
    f.write = [](const C& c, AttributeSink& out) {
      out.put("num_query_groups", int64_t(c.group_query_attention ? c.num_query_groups : 0));
    };
    f.read = [](AttributeSource& in, C& m, const std::string& file) {
      int64_t x = 0;
      if (!in.get("num_query_groups", x) || x == 0) return;
      if (x < 0 || x > (1 << 16))
        throw ConfigError(out_of_range(file, "num_query_groups", x, 1, 1 << 16));
      m.group_query_attention = true;
      m.num_query_groups = static_cast<int>(x);
    };
    t.push_back(f);
  }
  t.push_back(Flag("untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights",
                   &C::untie_embeddings_and_output_weights, "an lm_head of its own",
                   "the output layer tied to wte"));
  t.push_back(Flag("disable-bias-linear", "add_bias_linear", &C::add_bias_linear,
                   "no biases in its linear layers", "biases in its linear layers")
                  .compared_as([](const C& c) { return !c.add_bias_linear; }));
  t.push_back(Flag("group-query-attention", "", &C::group_query_attention,
                   "attn.q and attn.kv weights", "a fused attn.qkv weight"));
  t.push_back(Int("num-query-groups", "", &C::num_query_groups).compared_as([](const C& c) {
    return int64_t(c.kv_heads());
  }));
  t.back().attributes.clear();  // recorded by num_query_groups above
  t.back().write = nullptr;
  t.back().read = nullptr;
  // Qwen2's and Megatron's smaller options (absent in older checkpoints: off).
  t.push_back(Flag("add-qkv-bias", "add_qkv_bias", &C::add_qkv_bias,
                   "biases on the QKV projection alone", "no QKV-only biases")
                  .compared_as([](const C& c) { return c.qkv_bias() && !c.add_bias_linear; }));
  t.push_back(Int("kv-channels", "kv_channels", &C::kv_channels)
                  .range(0, 1 << 16)
                  .compared_as([](const C& c) { return int64_t(c.head_dim()); }));
  t.push_back(Flag("apply-layernorm-1p", "apply_layernorm_1p", &C::apply_layernorm_1p,
                   "norm weights applied as 1 + w", "norm weights applied as w"));
  t.push_back(Flag("rotary-interleaved", "rotary_interleaved", &C::rotary_interleaved,
                   "rotary pairs (2i, 2i+1)", "rotary pairs (i, i + d/2)"));
  t.back().compared = rope;
  t.push_back(Flag("squared-relu", "squared_relu", &C::squared_relu, "a squared-ReLU MLP",
                   "no squared-ReLU MLP"));
  {  // Qwen3's q/k norms, or multi-latent attention's latent norms
    ModelField f = Flag("qk-layernorm", "qk_layernorm", &C::qk_layernorm, "", "no query/key norms");
    f.mismatch = [](const C& m, const C& c, const std::string& path) {
      if (m.qk_layernorm == c.qk_layernorm) return std::string();
      const char* with = m.mla() ? "latent norms (attn.q_down_norm, attn.kv_down_norm)"
                                 : "attn.q_norm and attn.k_norm weights";
      return detail::concat("checkpoint '", path, "' was trained ",
                            m.qk_layernorm ? "with " : "without ", "--qk-layernorm (",
                            m.qk_layernorm ? with : "no query/key norms", ") but this run ",
                            c.qk_layernorm ? "gives it" : "does not", kReload);
    };
    t.push_back(f);
  }
}

// Multi-token prediction, multi-latent attention and YaRN.
void deepseek_fields(std::vector<ModelField>& t) {
  // Multi-token prediction (absent: none).
  t.push_back(Int("mtp-num-layers", "mtp_num_layers", &C::mtp_num_layers)
                  .range(0, 64)
                  .key()
                  .when([](const C& c) { return c.mtp(); }));
  t.back().compared = always;
  // Multi-latent attention and YaRN (absent: standard attention). kv_lora_rank says it is there.
  t.push_back(Flag("multi-latent-attention", "", &C::multi_latent_attention,
                   "multi-latent attention", "standard attention"));
  {
    ModelField f =
        Int("kv-lora-rank", "kv_lora_rank", &C::kv_lora_rank).range(1, 1 << 20).when(mla);
    f.read = [](AttributeSource& in, C& m, const std::string& file) {
      int64_t x = 0;
      if (!in.get("kv_lora_rank", x)) return;
      if (x < 1 || x > (1 << 20))
        throw ConfigError(out_of_range(file, "kv_lora_rank", x, 1, 1 << 20));
      m.multi_latent_attention = true;
      m.kv_lora_rank = static_cast<int>(x);
    };
    t.push_back(f);
  }
  t.push_back(
      Int("q-lora-rank", "q_lora_rank", &C::q_lora_rank).range(0, 1 << 20).required().when(mla));
  t.push_back(
      Int("qk-head-dim", "qk_head_dim", &C::qk_head_dim).range(1, 1 << 20).required().when(mla));
  t.push_back(Int("qk-pos-emb-head-dim", "qk_pos_emb_head_dim", &C::qk_pos_emb_head_dim)
                  .range(2, 1 << 20)
                  .required()
                  .when(mla));
  t.push_back(
      Int("v-head-dim", "v_head_dim", &C::v_head_dim).range(1, 1 << 20).required().when(mla));
  t.push_back(Text("rope-type", "rope_type", &C::rope_type).when(mla).compared_when(rope));
  t.push_back(packed(
      "yarn", mla,
      {&C::rotary_scaling_factor, &C::mscale, &C::mscale_all_dim, &C::beta_fast, &C::beta_slow},
      &C::original_max_position_embeddings, [](C&) {}));
  t.push_back(
      compared_only(Real("rotary-scaling-factor", "", &C::rotary_scaling_factor).when(yarn)));
  t.push_back(compared_only(Real("mscale-all-dim", "", &C::mscale_all_dim).when(yarn)));
  t.push_back(compared_only(Real("beta-fast", "", &C::beta_fast).when(yarn)));
  t.push_back(compared_only(Real("beta-slow", "", &C::beta_slow).when(yarn)));
  t.push_back(
      Int("original-max-position-embeddings", "", &C::original_max_position_embeddings).when(yarn));
  t.back().attributes.clear();  // recorded in yarn above
  t.back().write = nullptr;
  t.back().read = nullptr;
}

// The Mixture of Experts and its router.
void moe_fields(std::vector<ModelField>& t) {
  // Mixture of Experts (absent: a dense model). num_experts says it is there.
  {
    ModelField f =
        Int("num-experts", "num_experts", &C::num_experts).range(1, 1 << 16).key().when(moe);
    f.compared = always;
    t.push_back(f);
  }
  t.push_back(Int("moe-router-topk", "moe_router_topk", &C::moe_router_topk)
                  .range(1, experts)
                  .required()
                  .when(moe));
  t.push_back(Int("moe-ffn-hidden-size", "moe_ffn_hidden_size", &C::moe_ffn_hidden_size)
                  .range(1, 1 << 24)
                  .required()
                  .when(moe)
                  .written_as([](const C& c) { return int64_t(c.moe_ffn()); }));
  t.push_back(Text("moe-layer-freq", "moe_layer_freq", &C::moe_layer_freq).when(moe));
  t.push_back(
      Text("moe-router-score-function", "moe_router_score_function", &C::moe_router_score_function)
          .when(moe));
  {
    ModelField f =
        Flag("moe-router-pre-softmax", "moe_router_pre_softmax", &C::moe_router_pre_softmax,
             "the top-k of the softmax over all experts", "a softmax over the top-k logits")
            .when(moe);
    f.read = [](AttributeSource& in, C& m, const std::string& file) {
      if (!m.moe()) return;
      int64_t x = 0;
      if (!in.get("moe_router_pre_softmax", x))
        throw ConfigError(lacks(file, "moe_router_pre_softmax"));
      if (x < 0 || x > 1) throw ConfigError(out_of_range(file, "moe_router_pre_softmax", x, 0, 1));
      m.moe_router_pre_softmax = x != 0;
    };
    t.push_back(f);
  }
  t.push_back(Real("moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor",
                   &C::moe_router_topk_scaling_factor)
                  .when(moe));
  t.push_back(Int("moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size",
                  &C::moe_shared_expert_intermediate_size)
                  .range(0, 1 << 24)
                  .required()
                  .when(moe));
  // DeepSeek-V3's router (absent in older checkpoints: off).
  t.push_back(Flag("moe-router-enable-expert-bias", "moe_router_enable_expert_bias",
                   &C::moe_router_enable_expert_bias, "an aux-loss-free expert bias in its routers",
                   "no expert bias")
                  .when(moe));
  {  // group-limited routing: the three together
    ModelField f = Int("moe-router-num-groups", "moe_router_num_groups", &C::moe_router_num_groups)
                       .range(0, experts)
                       .when(moe);
    f.attributes = {"moe_router_num_groups", "moe_router_group_topk",
                    "moe_router_group_score_experts"};
    f.write = [](const C& c, AttributeSink& out) {
      out.put("moe_router_num_groups", int64_t(c.moe_router_num_groups));
      out.put("moe_router_group_topk", int64_t(c.moe_router_group_topk));
      out.put("moe_router_group_score_experts", int64_t(c.moe_router_group_score_experts));
    };
    f.read = [](AttributeSource& in, C& m, const std::string& file) {
      int64_t x = 0;
      if (!m.moe() || !in.get("moe_router_num_groups", x)) return;
      for (auto [name, field] :
           {std::pair<const char*, int C::*>{"moe_router_num_groups", &C::moe_router_num_groups},
            {"moe_router_group_topk", &C::moe_router_group_topk},
            {"moe_router_group_score_experts", &C::moe_router_group_score_experts}}) {
        if (!in.get(name, x)) throw ConfigError(lacks(file, name));
        if (x < 0 || x > m.num_experts)
          throw ConfigError(out_of_range(file, name, x, 0, m.num_experts));
        m.*field = static_cast<int>(x);
      }
    };
    t.push_back(f);
  }
  t.push_back(Int("moe-router-group-topk", "", &C::moe_router_group_topk).when(moe_groups));
  t.push_back(Int("moe-router-group-score-experts", "", &C::moe_router_group_score_experts)
                  .when(moe_groups)
                  .compared_as([](const C& c) { return int64_t(c.moe_group_score_experts()); }));
  for (size_t i = t.size() - 2; i < t.size(); ++i) {  // recorded with the number of groups
    t[i].attributes.clear();
    t[i].write = nullptr;
    t[i].read = nullptr;
  }
}

std::vector<ModelField> build_fields() {
  std::vector<ModelField> t;
  shape_fields(t);
  layer_fields(t);
  deepseek_fields(t);
  moe_fields(t);
  return t;
}

}  // namespace

const std::vector<ModelField>& model_fields() {
  static const std::vector<ModelField> fields = build_fields();
  return fields;
}

void write_model_attributes(const GPTConfig& cfg, AttributeSink& out) {
  for (const ModelField& f : model_fields())
    if (f.write && (!f.recorded || f.recorded(cfg))) f.write(cfg, out);
}

void read_model_attributes(AttributeSource& in, GPTConfig& m, const std::string& file) {
  for (const ModelField& f : model_fields())
    if (f.read) f.read(in, m, file);
}

void check_same_model(const GPTConfig& m, const GPTConfig& c, const std::string& path) {
  for (const ModelField& f : model_fields()) {
    if (!f.mismatch || (f.compared && !f.compared(m))) continue;
    const std::string why = f.mismatch(m, c, path);
    if (!why.empty()) throw ConfigError(why);
  }
}

std::vector<std::string> model_attribute_names() {
  std::vector<std::string> names;
  for (const ModelField& f : model_fields())
    for (const std::string& a : f.attributes) names.push_back(a);
  return names;
}

}  // namespace tessera
