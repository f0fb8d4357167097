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

using C = GPTConfig;
using detail::concat;

std::string position_words(const C& c) {
  if (!c.rope())
    return c.learned_positions() ? "learned absolute positions"
           : c.alibi()           ? "ALiBi"
                                 : "no position embedding";
  return concat(
      "RoPE (base ", c.rotary_base, ", ", c.rotary_dim(), " of ", c.head_dim(), " features",
      c.use_rope_scaling ? concat(", Llama 3 scaling x", c.rope_scaling_factor) : "", ")");
}

std::string attention_words(const C& c) {
  if (!c.group_query_attention) return ", multi-head attention";
  if (c.num_query_groups == 1)
    return concat(", multi-query attention (1 key/value head for ", c.num_attention_heads, ")");
  return concat(", grouped-query attention (", c.num_query_groups, " key/value heads for ",
                c.num_attention_heads, ")");
}

// The shapes every checkpoint has, the norm, the Llama family's options.
void shape_fields(std::vector<ModelField>& t) {
  const std::string G = kModel;
  // The shapes: every checkpoint has them.
  t.push_back(Int("num-layers", "num_layers", &C::num_layers)
                  .range(1, 1 << 16)
                  .required()
                  .help(G, "transformer layers"));
  t.push_back(Int("hidden-size", "hidden_size", &C::hidden_size)
                  .range(1, 1 << 20)
                  .required()
                  .help(G, "hidden width"));
  t.push_back(
      Int("num-attention-heads", "num_attention_heads", &C::num_attention_heads)
          .range(1, 1 << 16)
          .required()
          .help(G, "attention heads (must divide hidden-size, unless --kv-channels is given)"));
  t.push_back(Int("ffn-hidden-size", "ffn_hidden_size", &C::ffn_hidden_size)
                  .range(1, 1 << 22)
                  .required()
                  .written_as([](const C& c) { return int64_t(c.ffn()); })
                  .help(G, "MLP width (0: 4 * hidden-size)"));
  t.push_back(Int("seq-length", "seq_length", &C::seq_length)
                  .range(1, 1 << 24)
                  .required()
                  .not_compared()
                  .help(G, "tokens per sample"));
  t.push_back(Int("max-position-embeddings", "max_position_embeddings", &C::max_position_embeddings)
                  .range(1, 1 << 24)
                  .required()
                  .written_as([](const C& c) { return int64_t(c.max_positions()); })
                  .help(G, "positions of the model (0: seq-length)"));
  {  // the vocabulary: given, or the data's (the mismatch names both origins)
    ModelField f = Int("vocab-size", "vocab_size", &C::vocab_size)
                       .range(1, 1 << 30)
                       .required()
                       .help(G, "vocabulary size (0: from the data's shards; 512 for mock data)");
    f.mismatch = [](const C& m, const C& c, const std::string& path) {
      if (m.vocab_size == c.vocab_size) return std::string();
      return concat("checkpoint '", path, "' has a vocabulary of ", m.vocab_size,
                    " tokens but this run's has ", c.vocab_size,
                    " (--vocab-size, or the tokenizer of the data's shards when it is left out): "
                    "train on data preprocessed with the checkpoint's tokenizer");
    };
    t.push_back(f);
  }
  t.push_back(Int("make-vocab-size-divisible-by", "make_vocab_size_divisible_by",
                  &C::make_vocab_size_divisible_by)
                  .range(1, 1 << 16)
                  .required()
                  .not_compared()
                  .help(G,
                        "pad the vocabulary to a multiple of this times TP (padding is masked out "
                        "of the loss)"));
  {  // the norm's epsilon, as an integer of 1e-9 units (compared so; said as the values)
    ModelField f;
    f.option = "norm-epsilon";  // declared as --layernorm-epsilon, --norm-epsilon its alternative
    f.group = G;
    f.declare = [](OptionDeclarer& d, C& c) {
      d.real("layernorm-epsilon", &c.layernorm_epsilon, "LayerNorm epsilon");
    };
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
  // Initialization and dropout: not part of a checkpoint's model.
  t.push_back(option_only(Real("init-method-std", "", &C::init_method_std)
                              .help(G,
                                    "std of the normal init (residual projections use "
                                    "std/sqrt(2*layers))")));
  t.push_back(
      option_only(Real("attention-dropout", "", &C::attention_dropout)
                      .help(G, "dropout on the attention probabilities in training (GPT-2: 0.1)")));
  t.push_back(option_only(Real("hidden-dropout", "", &C::hidden_dropout)
                              .help(G,
                                    "dropout on the embedding output and on each attention and "
                                    "MLP output before the residual add, in training (GPT-2: "
                                    "0.1)")));
  // The Llama family's options (absent in checkpoints before it: GPT-2's values).
  t.push_back(
      Text("position-embedding-type", "position_embedding_type", &C::position_embedding_type)
          .help(G,
                "learned_absolute (GPT-2) | rope (rotary, Llama) | alibi (linear distance penalty "
                "per head) | none (causal attention alone)")
          .says(position_words));
  t.push_back(Real("rotary-base", "rotary_base", &C::rotary_base)
                  .compared_when(rope)
                  .help(G, "RoPE base (theta; Llama 3: 500000)"));
  t.push_back(Real("rotary-percent", "rotary_percent", &C::rotary_percent)
                  .compared_when(rope)
                  .help(G, "share of each head's features that RoPE rotates, 0 < p <= 1"));
  t.push_back(Text("normalization", "normalization", &C::normalization)
                  .help(G, "LayerNorm (GPT-2) | RMSNorm (Llama)")
                  .says([](const C& c) {
                    return std::string(c.rmsnorm() ? ", RMSNorm" : ", LayerNorm") +
                           (c.apply_layernorm_1p ? " (1 + w)" : "");
                  }));
  t.push_back(packed(
      "rope_scaling", [](const C& c) { return c.use_rope_scaling; },
      {&C::rope_scaling_factor, &C::rope_scaling_low_freq_factor, &C::rope_scaling_high_freq_factor,
       &C::rope_scaling_original_max_positions},
      nullptr, [](C& m) { m.use_rope_scaling = true; }));
  t.push_back(Flag("use-rope-scaling", "", &C::use_rope_scaling, "Llama 3's frequency scaling",
                   "no frequency scaling")
                  .when(rope)
                  .help(G,
                        "Llama 3.1's RoPE frequency scaling (low/high frequency factors 1/4, "
                        "original context 8192)"));
  t.push_back(compared_only(
      Real("rope-scaling-factor", "", &C::rope_scaling_factor)
          .when(rope_scaling)
          .help(G,
                "with --use-rope-scaling: how much the long wavelengths are slowed (Llama 3.1: 8, "
                "3.2: 32)")));
  t.push_back(compared_only(
      Real("rope-scaling-low-freq-factor", "", &C::rope_scaling_low_freq_factor)
          .when(rope_scaling)
          .help(G,
                "with --use-rope-scaling: wavelengths above original / this are slowed (Llama "
                "3: 1)")));
  t.push_back(compared_only(
      Real("rope-scaling-high-freq-factor", "", &C::rope_scaling_high_freq_factor)
          .when(rope_scaling)
          .help(G,
                "with --use-rope-scaling: wavelengths below original / this are kept (Llama "
                "3: 4)")));
  t.push_back(compared_only(Real("rope-scaling-original-max-position-embeddings", "",
                                 &C::rope_scaling_original_max_positions)
                                .when(rope_scaling)
                                .help(G,
                                      "with --use-rope-scaling: the context the frequencies were "
                                      "trained for (Llama 3: 8192)")));
}

// The MLP, attention and bias options of the Llama family, Qwen2/3 and Megatron.
void layer_fields(std::vector<ModelField>& t) {
  const std::string G = kModel;
  t.push_back(Flag("swiglu", "swiglu", &C::swiglu, "gate and up weights in mlp.fc1",
                   "no gate weights in mlp.fc1")
                  .help(G,
                        "SwiGLU MLP (gate and up projections, silu(gate) * up) instead of GELU; "
                        "Llama uses --ffn-hidden-size 8/3 h rounded")
                  .says([](const C& c) {
                    return c.swiglu ? ", SwiGLU" : c.squared_relu ? ", squared ReLU" : ", GELU";
                  }));
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
    f.says = attention_words;
    t.push_back(f);
  }
  t.push_back(Flag("untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights",
                   &C::untie_embeddings_and_output_weights, "an lm_head of its own",
                   "the output layer tied to wte")
                  .help(G,
                        "an output layer (lm_head) of its own instead of the word embedding's "
                        "transpose")
                  .says([](const C& c) {
                    return c.tied_head() ? ", output layer tied to the embedding"
                                         : ", untied output layer";
                  }));
  t.push_back(Flag("disable-bias-linear", "add_bias_linear", &C::add_bias_linear,
                   "no biases in its linear layers", "biases in its linear layers")
                  .compared_as([](const C& c) { return !c.add_bias_linear; })
                  .negated()
                  .help(G, "no biases in the QKV, projection and MLP layers (Llama)")
                  .says([](const C& c) {
                    return c.add_bias_linear ? ""
                           : c.add_qkv_bias  ? ", QKV biases only"
                                             : ", no linear biases";
                  }));
  t.push_back(Flag("group-query-attention", "", &C::group_query_attention,
                   "attn.q and attn.kv weights", "a fused attn.qkv weight")
                  .help(G,
                        "grouped-query attention: --num-query-groups key/value heads shared by "
                        "the query heads"));
  t.push_back(recorded_elsewhere(  // in num_query_groups above
      Int("num-query-groups", "", &C::num_query_groups)
          .compared_as([](const C& c) { return int64_t(c.kv_heads()); })
          .help(G,
                "key/value heads with --group-query-attention (1: multi-query attention); must "
                "divide the heads and be divisible by TP")));
  // Qwen2's and Megatron's smaller options (absent in older checkpoints: off).
  t.push_back(Flag("add-qkv-bias", "add_qkv_bias", &C::add_qkv_bias,
                   "biases on the QKV projection alone", "no QKV-only biases")
                  .compared_as([](const C& c) { return c.qkv_bias() && !c.add_bias_linear; })
                  .help(G, "biases on the QKV projection even with --disable-bias-linear (Qwen2)"));
  t.push_back(Int("kv-channels", "kv_channels", &C::kv_channels)
                  .range(0, 1 << 16)
                  .compared_as([](const C& c) { return int64_t(c.head_dim()); })
                  .help(G, "features per attention head (0: hidden-size / num-attention-heads)")
                  .says([](const C& c) {
                    return c.kv_channels > 0 ? concat(", ", c.kv_channels, " channels per head")
                                             : std::string();
                  }));
  t.push_back(Flag("apply-layernorm-1p", "apply_layernorm_1p", &C::apply_layernorm_1p,
                   "norm weights applied as 1 + w", "norm weights applied as w")
                  .help(G, "norm weights stored as w and applied as (1 + w), initialized to 0"));
  t.push_back(
      Flag("rotary-interleaved", "rotary_interleaved", &C::rotary_interleaved,
           "rotary pairs (2i, 2i+1)", "rotary pairs (i, i + d/2)")
          .help(G, "RoPE rotates adjacent feature pairs (2i, 2i+1) instead of the two halves")
          .says([](const C& c) {
            return c.rope() && c.rotary_interleaved ? ", interleaved rotary pairs" : "";
          }));
  t.back().compared = rope;
  t.push_back(Flag("squared-relu", "squared_relu", &C::squared_relu, "a squared-ReLU MLP",
                   "no squared-ReLU MLP")
                  .help(G, "MLP activation relu(x)^2 instead of GELU"));
  {  // Qwen3's q/k norms, or multi-latent attention's latent norms
    ModelField f =
        Flag("qk-layernorm", "qk_layernorm", &C::qk_layernorm, "", "no query/key norms")
            .help(G,
                  "normalize each query and key head (--normalization's norm over its "
                  "--kv-channels features, weights shared by the heads) before RoPE (Qwen3); with "
                  "--multi-latent-attention, the query and key/value latents")
            .says([](const C& c) {
              return c.qk_layernorm && !c.mla() ? ", query/key norm per head" : "";
            });
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

void declare_model_options(const std::string& group, OptionDeclarer& d, GPTConfig& m) {
  for (const ModelField& f : model_fields())
    if (f.group == group && f.declare) f.declare(d, m);
}

std::string describe_model(const GPTConfig& c) {
  std::string out;
  for (const ModelField& f : model_fields())
    if (f.says) out += f.says(c);
  return out;
}

std::vector<std::string> model_attribute_names() {
  std::vector<std::string> names;
  for (const ModelField& f : model_fields())
    for (const std::string& a : f.attributes) names.push_back(a);
  return names;
}

}  // namespace tessera
