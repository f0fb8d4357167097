// schema_mla_moe.cpp: the rows of the model's option table (model/config_schema.hpp) for
// multi-token prediction, multi-latent attention with YaRN, and the Mixture of Experts with its
// router.
#include <utility>

#include "core/error.hpp"
#include "model/schema_rows.hpp"

namespace tessera::schema {

namespace {

using C = GPTConfig;
using detail::concat;

std::string moe_words(const C& c) {
  if (!c.moe()) return "";
  std::string out =
      concat(", MoE in ", c.num_moe_layers(), " of ", c.num_layers, " layers (", c.num_experts,
             " experts of width ", c.moe_ffn(), ", top-", c.moe_router_topk, " ",
             c.moe_router_score_function, c.moe_router_pre_softmax ? " before the top-k" : "");
  if (c.moe_router_num_groups > 0)
    out += concat(" within the best ", c.moe_router_group_topk, " of ", c.moe_router_num_groups,
                  " groups (a group's score: its top ", c.moe_group_score_experts(), ")");
  if (c.moe_router_enable_expert_bias) out += ", expert bias (aux-loss-free)";
  if (c.moe_shared_expert_intermediate_size > 0)
    out += concat(", a shared expert of width ", c.moe_shared_expert_intermediate_size);
  return out + (c.moe_dropless() ? ", dropless)"
                                 : concat(", capacity factor ", c.moe_expert_capacity_factor, ")"));
}

}  // namespace

// Multi-token prediction, multi-latent attention and YaRN.
void deepseek_fields(std::vector<ModelField>& t) {
  const std::string G = kMla;
  // Multi-token prediction (absent: none).
  t.push_back(Int("mtp-num-layers", "mtp_num_layers", &C::mtp_num_layers)
                  .range(0, 64)
                  .key()
                  .when([](const C& c) { return c.mtp(); })
                  .help(G,
                        "multi-token prediction's depths (DeepSeek-V3: 1): each predicts one token "
                        "further through a transformer layer of its own on the last pipeline "
                        "stage"));
  t.back().compared = always;
  t.push_back(option_only(
      Real("mtp-loss-scaling-factor", "", &C::mtp_loss_scaling_factor)
          .help(G, "the weight of multi-token prediction's loss (divided over the depths)")));
  // Multi-latent attention and YaRN (absent: standard attention). kv_lora_rank says it is there.
  t.push_back(Flag("multi-latent-attention", "", &C::multi_latent_attention,
                   "multi-latent attention", "standard attention")
                  .help(G,
                        "DeepSeek-V2/V3's attention: queries and keys/values from compressed "
                        "latents, a RoPE part of the keys shared by the heads")
                  .says([](const C& c) {
                    if (!c.mla()) return std::string();
                    return concat(
                        ", multi-latent attention (",
                        c.q_lora_rank > 0 ? concat("query rank ", c.q_lora_rank, ", ") : "",
                        "key/value rank ", c.kv_lora_rank, ", heads of ", c.qk_head_dim, " + ",
                        c.qk_pos_emb_head_dim, " RoPE features, values of ", c.v_head_dim,
                        c.qk_layernorm ? ", latent norms" : "", ")");
                  }));
  {
    ModelField f = Int("kv-lora-rank", "kv_lora_rank", &C::kv_lora_rank)
                       .range(1, 1 << 20)
                       .when(mla)
                       .help(G, "the key/value latent's width (required with MLA)");
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
  t.push_back(Int("q-lora-rank", "q_lora_rank", &C::q_lora_rank)
                  .range(0, 1 << 20)
                  .required()
                  .when(mla)
                  .help(G, "the query latent's width (0: queries straight from the hidden state)"));
  t.push_back(Int("qk-head-dim", "qk_head_dim", &C::qk_head_dim)
                  .range(1, 1 << 20)
                  .required()
                  .when(mla)
                  .help(G, "query/key features per head without position"));
  t.push_back(
      Int("qk-pos-emb-head-dim", "qk_pos_emb_head_dim", &C::qk_pos_emb_head_dim)
          .range(2, 1 << 20)
          .required()
          .when(mla)
          .help(G, "query/key features per head with RoPE (even; the keys' shared by the heads)"));
  t.push_back(Int("v-head-dim", "v_head_dim", &C::v_head_dim)
                  .range(1, 1 << 20)
                  .required()
                  .when(mla)
                  .help(G, "value features per head"));
  t.push_back(Text("rope-type", "rope_type", &C::rope_type)
                  .when(mla)
                  .compared_when(rope)
                  .help(G,
                        "rope | yarn (YaRN's frequencies and softmax scale; with "
                        "--multi-latent-attention)"));
  {
    ModelField f = packed(
        "yarn", mla,
        {&C::rotary_scaling_factor, &C::mscale, &C::mscale_all_dim, &C::beta_fast, &C::beta_slow},
        &C::original_max_position_embeddings, [](C&) {});
    f.says = [](const C& c) {
      return c.yarn() ? concat(", YaRN x", c.rotary_scaling_factor, " over ",
                               c.original_max_position_embeddings, " positions")
                      : std::string();
    };
    t.push_back(f);
  }
  t.push_back(compared_only(
      Real("rotary-scaling-factor", "", &C::rotary_scaling_factor)
          .when(yarn)
          .help(G, "YaRN: the context's growth over the original (DeepSeek-V3: 40)")));
  t.push_back(option_only(  // must equal --mscale-all-dim (compared as that)
      Real("mscale", "", &C::mscale)
          .help(G,
                "YaRN: m in 0.1 m ln(factor) + 1 for RoPE's cos and sin (must equal "
                "--mscale-all-dim)")));
  t.push_back(
      compared_only(Real("mscale-all-dim", "", &C::mscale_all_dim)
                        .when(yarn)
                        .help(G, "YaRN: m in the softmax scale's (0.1 m ln(factor) + 1)^2")));
  t.push_back(compared_only(
      Real("beta-fast", "", &C::beta_fast)
          .when(yarn)
          .help(G,
                "YaRN: frequencies that turn more than this often in the original context are "
                "kept")));
  t.push_back(compared_only(
      Real("beta-slow", "", &C::beta_slow)
          .when(yarn)
          .help(G, "YaRN: those that turn fewer times than this are divided by the factor")));
  t.push_back(recorded_elsewhere(  // in yarn above
      Int("original-max-position-embeddings", "", &C::original_max_position_embeddings)
          .when(yarn)
          .help(G, "YaRN: the context the model was first trained for (DeepSeek-V3: 4096)")));
}

// The Mixture of Experts and its router.
void moe_fields(std::vector<ModelField>& t) {
  const std::string G = kMoe;
  // Mixture of Experts (absent: a dense model). num_experts says it is there.
  {
    ModelField f = Int("num-experts", "num_experts", &C::num_experts)
                       .range(1, 1 << 16)
                       .key()
                       .when(moe)
                       .help(G, "experts per MoE layer (0: a dense model)")
                       .says(moe_words);
    f.compared = always;
    t.push_back(f);
  }
  t.push_back(Int("moe-router-topk", "moe_router_topk", &C::moe_router_topk)
                  .range(1, experts)
                  .required()
                  .when(moe)
                  .help(G, "experts each token goes to"));
  t.push_back(Int("moe-ffn-hidden-size", "moe_ffn_hidden_size", &C::moe_ffn_hidden_size)
                  .range(1, 1 << 24)
                  .required()
                  .when(moe)
                  .written_as([](const C& c) { return int64_t(c.moe_ffn()); })
                  .help(G, "each expert's MLP width (0: --ffn-hidden-size)"));
  t.push_back(Text("moe-layer-freq", "moe_layer_freq", &C::moe_layer_freq)
                  .when(moe)
                  .help(G,
                        "which layers are MoE: N (every N-th layer from layer 0) or a 0/1 list per "
                        "layer such as [1,0,1,0] or ([1]*3+[0])*2"));
  // The losses that balance the experts: the objective's, not the model's.
  t.push_back(
      option_only(Text("moe-router-load-balancing-type", "", &C::moe_router_load_balancing_type)
                      .help(G, "aux_loss (per micro-batch) | seq_aux_loss (per sequence) | none")));
  t.push_back(option_only(Real("moe-aux-loss-coeff", "", &C::moe_aux_loss_coeff)
                              .help(G, "the load-balancing loss's weight in the objective")));
  t.push_back(option_only(Real("moe-z-loss-coeff", "", &C::moe_z_loss_coeff)
                              .help(G, "the router z-loss's weight (mean logsumexp(logits)^2)")));
  t.push_back(
      Text("moe-router-score-function", "moe_router_score_function", &C::moe_router_score_function)
          .when(moe)
          .help(G, "softmax | sigmoid (normalized over the top k)"));
  {
    ModelField f =
        Flag("moe-router-pre-softmax", "moe_router_pre_softmax", &C::moe_router_pre_softmax,
             "the top-k of the softmax over all experts", "a softmax over the top-k logits")
            .when(moe)
            .help(G,
                  "routing weights from the softmax over all experts (not renormalized over the "
                  "top k)");
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
                  .when(moe)
                  .help(G, "routing weights times this (0: unscaled)"));
  t.push_back(Int("moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size",
                  &C::moe_shared_expert_intermediate_size)
                  .range(0, 1 << 24)
                  .required()
                  .when(moe)
                  .help(G,
                        "width of a shared expert every token goes through beside its routed ones "
                        "(0: none)"));
  // DeepSeek-V3's router (absent in older checkpoints: off).
  t.push_back(Flag("moe-router-enable-expert-bias", "moe_router_enable_expert_bias",
                   &C::moe_router_enable_expert_bias, "an aux-loss-free expert bias in its routers",
                   "no expert bias")
                  .when(moe)
                  .help(G,
                        "aux-loss-free balancing (DeepSeek-V3; sigmoid scores): a per-expert bias "
                        "added to the scores for choosing the top k, updated after each step from "
                        "the global batch's loads"));
  t.push_back(option_only(
      Real("moe-router-bias-update-rate", "", &C::moe_router_bias_update_rate)
          .help(G,
                "with --moe-router-enable-expert-bias: the bias moves by this times sign(mean load "
                "- the expert's load) after each step")));
  {  // group-limited routing: the three together
    ModelField f = Int("moe-router-num-groups", "moe_router_num_groups", &C::moe_router_num_groups)
                       .range(0, experts)
                       .when(moe)
                       .help(G,
                             "group-limited routing: the experts in this many equal groups (0: "
                             "none)");
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
  // Recorded with the number of groups above.
  t.push_back(recorded_elsewhere(
      Int("moe-router-group-topk", "", &C::moe_router_group_topk)
          .when(moe_groups)
          .help(G,
                "with --moe-router-num-groups: the groups each token chooses its experts from")));
  t.push_back(recorded_elsewhere(
      Int("moe-router-group-score-experts", "", &C::moe_router_group_score_experts)
          .when(moe_groups)
          .compared_as([](const C& c) { return int64_t(c.moe_group_score_experts()); })
          .help(G,
                "with --moe-router-num-groups: a group's score is the sum of its best N scores "
                "(0: topk / group-topk, Megatron-Core's rule; 2: DeepSeek-V3's, as Hugging Face "
                "routes)")));
  // How the experts run: the same results either way.
  t.push_back(option_only(
      Text("moe-token-dispatcher-type", "", &C::moe_token_dispatcher_type)
          .help(G, "alltoall | allgather: how tokens reach their experts' ranks (same results)")));
  t.push_back(option_only(Flag("moe-grouped-gemm", "", &C::moe_grouped_gemm, "", "")
                              .help(G,
                                    "the experts' GEMMs as one grouped GEMM per projection (same "
                                    "results; needs --disable-bias-linear)")));
}

}  // namespace tessera::schema
