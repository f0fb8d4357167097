// hf_deepseek.cpp: DeepSeek-V3's adapter (hf_deepseek.hpp): its config.json to and from Tessera's
// options, its tensor names and the tensors beside the parameters.
#include "checkpoint/hf_deepseek.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include "core/error.hpp"
#include "core/json.hpp"
#include "core/logging.hpp"

namespace tessera {

namespace {

std::string num(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%.10g", v);
  return b;
}

// The settings of a DeepSeek-V3 config.json, with DeepseekV3Config's defaults.
struct DeepSeekSettings {
  int64_t vocab = 129280, hidden = 7168, inter = 18432, moe_inter = 2048, layers = 61, mtp = 0;
  int64_t heads = 128, kv_heads = 0, shared = 1, routed = 256, kv_lora = 512, q_lora = 1536;
  int64_t rope_dim = 64, v_dim = 128, nope_dim = 128, groups = 8, group_topk = 4, topk = 8;
  int64_t layer_freq = 1, first_dense = 3, max_pos = 4096;
  double scaling = 2.5, aux = 0.001, eps = 1e-6, theta = 10000, init_std = 0.02;
  bool norm_topk = true, seq_aux = true, tied = false, attention_bias = false, quantized = false;
  bool rope_interleave = true;      // Hugging Face's default
  std::vector<std::string> unread;  // keys this importer does not read (said, not ignored)
  std::string topk_method = "noaux_tc", scoring = "sigmoid", act = "silu";
  // rope_scaling (absent or null: plain RoPE)
  std::string rope_type;
  double factor = 1, original = 4096, beta_fast = 32, beta_slow = 1, mscale = 1, mscale_all = 0;
};

void parse_rope(JsonReader& r, DeepSeekSettings& d) {
  if (r.null_value()) return;
  d.rope_type = "unnamed";
  r.object([&](const std::string& k) {
    if (k == "type" || k == "rope_type")
      d.rope_type = r.string_value();
    else if (k == "factor")
      d.factor = r.number_value();
    else if (k == "original_max_position_embeddings")
      d.original = r.number_value();
    else if (k == "beta_fast")
      d.beta_fast = r.number_value();
    else if (k == "beta_slow")
      d.beta_slow = r.number_value();
    else if (k == "mscale")
      d.mscale = r.number_value();
    else if (k == "mscale_all_dim")
      d.mscale_all = r.number_value();
    else
      r.skip_value();
  });
}

void parse(const std::string& path, const std::string& text, DeepSeekSettings& d) {
  try {
    JsonReader r(text);
    auto whole = [&](const std::string& k, int64_t lo) -> int64_t {
      const double v = r.number_value();
      if (!(v >= double(lo) && v <= double(1 << 30) && v == std::floor(v)))
        throw ConfigError("'" + path + "' has \"" + k + "\": " + num(v) +
                          " (allowed: a whole number >= " + std::to_string(lo) + ")");
      return static_cast<int64_t>(v);
    };
    r.object([&](const std::string& k) {
      static const std::vector<std::pair<const char*, int64_t DeepSeekSettings::*>> ints{
          {"vocab_size", &DeepSeekSettings::vocab},
          {"hidden_size", &DeepSeekSettings::hidden},
          {"intermediate_size", &DeepSeekSettings::inter},
          {"moe_intermediate_size", &DeepSeekSettings::moe_inter},
          {"num_hidden_layers", &DeepSeekSettings::layers},
          {"num_attention_heads", &DeepSeekSettings::heads},
          {"n_shared_experts", &DeepSeekSettings::shared},
          {"n_routed_experts", &DeepSeekSettings::routed},
          {"kv_lora_rank", &DeepSeekSettings::kv_lora},
          {"qk_rope_head_dim", &DeepSeekSettings::rope_dim},
          {"v_head_dim", &DeepSeekSettings::v_dim},
          {"qk_nope_head_dim", &DeepSeekSettings::nope_dim},
          {"n_group", &DeepSeekSettings::groups},
          {"topk_group", &DeepSeekSettings::group_topk},
          {"num_experts_per_tok", &DeepSeekSettings::topk},
          {"moe_layer_freq", &DeepSeekSettings::layer_freq},
          {"max_position_embeddings", &DeepSeekSettings::max_pos}};
      for (const auto& [name, field] : ints)
        if (k == name) {
          d.*field = whole(k, 1);
          return;
        }
      if (k == "num_nextn_predict_layers")
        d.mtp = whole(k, 0);
      else if (k == "first_k_dense_replace")
        d.first_dense = whole(k, 0);
      else if (k == "num_key_value_heads")
        d.kv_heads = r.null_value() ? 0 : whole(k, 1);
      else if (k == "q_lora_rank")
        d.q_lora = r.null_value() ? 0 : whole(k, 1);
      else if (k == "routed_scaling_factor")
        d.scaling = r.number_value();
      else if (k == "aux_loss_alpha")
        d.aux = r.number_value();
      else if (k == "rms_norm_eps")
        d.eps = r.number_value();
      else if (k == "rope_theta")
        d.theta = r.number_value();
      else if (k == "initializer_range")
        d.init_std = r.number_value();
      else if (k == "norm_topk_prob")
        d.norm_topk = r.bool_value();
      else if (k == "seq_aux")
        d.seq_aux = r.bool_value();
      else if (k == "tie_word_embeddings")
        d.tied = r.bool_value();
      else if (k == "attention_bias")
        d.attention_bias = r.bool_value();
      else if (k == "topk_method")
        d.topk_method = r.string_value();
      else if (k == "scoring_func")
        d.scoring = r.string_value();
      else if (k == "hidden_act")
        d.act = r.string_value();
      else if (k == "rope_interleave")
        d.rope_interleave = r.bool_value();
      else if (k == "rope_scaling")
        parse_rope(r, d);
      else if (k == "quantization_config") {
        d.quantized = !r.null_value();
        if (d.quantized) r.skip_value();
      } else {
        // Keys that do not change what the model computes (identity, token ids, the layout it
        // was trained at, the library's caches); any other is said (import_deepseek_config).
        static const std::vector<std::string> inert{
            "architectures", "model_type",     "bos_token_id",         "eos_token_id",
            "pad_token_id",  "torch_dtype",    "transformers_version", "use_cache",
            "ep_size",       "pretraining_tp", "attention_dropout",    "_name_or_path",
            "auto_map"};
        if (std::find(inert.begin(), inert.end(), k) == inert.end()) d.unread.push_back(k);
        r.skip_value();
      }
    });
  } catch (const JsonError& e) {
    throw ConfigError("'" + path + "' does not parse: " + e.message);
  }
}

// What Tessera does not compute, one line each.
void refuse(const std::string& path, const DeepSeekSettings& d) {
  auto no = [&](bool bad, const std::string& what, const std::string& allowed) {
    if (bad) throw ConfigError("'" + path + "' has " + what + " (allowed: " + allowed + ")");
  };
  no(d.quantized, "quantization_config (FP8 block-quantized weights)",
     "bf16 or f32 weights: dequantize them first, e.g. with DeepSeek's fp8_cast_bf16.py");
  no(d.topk_method != "noaux_tc", "topk_method \"" + d.topk_method + "\"",
     "noaux_tc, DeepSeek-V3's; V2's greedy routers are not offered");
  no(d.scoring != "sigmoid", "scoring_func \"" + d.scoring + "\"", "sigmoid");
  no(!d.norm_topk, "norm_topk_prob false",
     "true: Tessera renormalizes the chosen sigmoid scores, as Megatron-Core does");
  no(d.attention_bias, "attention_bias true", "false");
  no(!d.rope_interleave, "rope_interleave false",
     "true: DeepSeek-V3's RoPE rotates interleaved pairs (2i, 2i+1), as Tessera's import does");
  no(d.topk == 1, "num_experts_per_tok 1 with norm_topk_prob",
     "2 or more: Hugging Face then weighs the expert 1, Tessera (as Megatron-Core) by its score");
  no(d.act != "silu", "hidden_act \"" + d.act + "\"", "silu");
  no(d.kv_heads != 0 && d.kv_heads != d.heads,
     "num_key_value_heads " + std::to_string(d.kv_heads) + " for " + std::to_string(d.heads) +
         " heads",
     "the heads' count: multi-latent attention has keys and values per head");
  no(!d.rope_type.empty() && d.rope_type != "yarn", "rope_scaling of type \"" + d.rope_type + "\"",
     "yarn, or null");
  no(d.rope_type == "yarn" && d.mscale != d.mscale_all && d.mscale_all != 0 && d.factor > 1,
     "rope_scaling mscale " + num(d.mscale) + " and mscale_all_dim " + num(d.mscale_all),
     "equal values (Tessera does not scale RoPE's cos and sin by their ratio)");
  no(d.routed % d.groups != 0 || d.group_topk > d.groups,
     "n_group " + std::to_string(d.groups) + " and topk_group " + std::to_string(d.group_topk) +
         " for " + std::to_string(d.routed) + " experts",
     "n_group dividing n_routed_experts, topk_group <= n_group");
}

void parse_deepseek_config(const std::string& path, const std::string& text, GPTConfig& cfg,
                           double& aux_coeff) {
  DeepSeekSettings d;
  parse(path, text, d);
  refuse(path, d);
  for (const std::string& k : d.unread)
    TLOG(warning) << "'" << path << "': key \"" << k
                  << "\" is not read by the DeepSeek-V3 import (Tessera has no such setting); "
                     "check that it does not change the model";
  cfg.vocab_size = d.vocab;
  cfg.hidden_size = static_cast<int>(d.hidden);
  cfg.ffn_hidden_size = static_cast<int>(d.inter);
  cfg.num_layers = static_cast<int>(d.layers);
  cfg.num_attention_heads = static_cast<int>(d.heads);
  cfg.max_position_embeddings = static_cast<int>(d.max_pos);
  cfg.seq_length = cfg.max_position_embeddings;
  cfg.layernorm_epsilon = d.eps;
  cfg.init_method_std = d.init_std;
  cfg.untie_embeddings_and_output_weights = !d.tied;
  cfg.position_embedding_type = "rope";
  cfg.rotary_base = d.theta;
  cfg.rotary_interleaved = true;  // HF's apply_rotary_pos_emb_interleave: pairs (2i, 2i+1)
  cfg.normalization = "RMSNorm";
  cfg.swiglu = true;
  cfg.add_bias_linear = false;
  cfg.multi_latent_attention = true;
  cfg.q_lora_rank = static_cast<int>(d.q_lora);
  cfg.kv_lora_rank = static_cast<int>(d.kv_lora);
  cfg.qk_head_dim = static_cast<int>(d.nope_dim);
  cfg.qk_pos_emb_head_dim = static_cast<int>(d.rope_dim);
  cfg.v_head_dim = static_cast<int>(d.v_dim);
  cfg.qk_layernorm = true;  // q_a_layernorm and kv_a_layernorm
  if (d.rope_type == "yarn") {
    cfg.rope_type = "yarn";
    cfg.rotary_scaling_factor = d.factor;
    cfg.original_max_position_embeddings = static_cast<int>(d.original);
    cfg.beta_fast = d.beta_fast;
    cfg.beta_slow = d.beta_slow;
    cfg.mscale = d.mscale;
    cfg.mscale_all_dim = d.mscale_all;
  }
  cfg.num_experts = static_cast<int>(d.routed);
  cfg.moe_router_topk = static_cast<int>(d.topk);
  cfg.moe_ffn_hidden_size = static_cast<int>(d.moe_inter);
  cfg.moe_shared_expert_intermediate_size = static_cast<int>(d.shared * d.moe_inter);
  cfg.moe_router_score_function = "sigmoid";
  cfg.moe_router_enable_expert_bias = true;
  cfg.moe_router_topk_scaling_factor = d.scaling;
  if (d.groups > 1) {  // one group is no limit
    cfg.moe_router_num_groups = static_cast<int>(d.groups);
    cfg.moe_router_group_topk = static_cast<int>(d.group_topk);
    cfg.moe_router_group_score_experts = 2;  // the sum of a group's top 2, as Hugging Face's
  }
  std::string pattern = "[";
  bool sparse = false;
  for (int64_t l = 0; l < d.layers; ++l) {
    const bool moe = l >= d.first_dense && l % d.layer_freq == 0;
    pattern += std::string(l ? "," : "") + (moe ? "1" : "0");
    sparse |= moe;
  }
  cfg.moe_layer_freq = pattern + "]";
  for (int64_t k = 0; k < d.mtp; ++k) {  // Tessera's MTP layers are of the last layer's kind
    const int64_t l = d.layers + k;
    const bool moe = l >= d.first_dense && l % d.layer_freq == 0;
    const bool last = d.layers - 1 >= d.first_dense && (d.layers - 1) % d.layer_freq == 0;
    if (moe != last)
      throw ConfigError("'" + path + "' makes multi-token prediction layer " + std::to_string(l) +
                        (moe ? " MoE" : " dense") + " and the last layer" +
                        (last ? " MoE" : " dense") +
                        " (allowed: the same kind; Tessera's MTP layers follow the last layer)");
  }
  if (!sparse) {  // every layer dense (first_k_dense_replace >= the layers): no experts at all
    const GPTConfig dense;
    cfg.num_experts = 0;
    cfg.moe_layer_freq = dense.moe_layer_freq;
    cfg.moe_router_score_function = dense.moe_router_score_function;
    cfg.moe_router_enable_expert_bias = false;
    cfg.moe_router_topk_scaling_factor = 0;
    cfg.moe_router_num_groups = cfg.moe_router_group_topk = cfg.moe_router_group_score_experts = 0;
    cfg.moe_shared_expert_intermediate_size = 0;
  }
  cfg.moe_router_load_balancing_type = d.seq_aux ? "seq_aux_loss" : "aux_loss";
  cfg.moe_aux_loss_coeff = aux_coeff = d.aux;
  cfg.mtp_num_layers = static_cast<int>(d.mtp);
  try {
    cfg.validate();
  } catch (const ConfigError& e) {
    throw ConfigError("'" + path + "' describes an invalid model: " + e.what());
  }
}

void check_deepseek_exportable(const GPTConfig& cfg, const std::string& ck) {
  std::string why;
  if (!cfg.mla())
    why = "no multi-latent attention";
  else if (!cfg.moe() || cfg.moe_router_score_function != "sigmoid" ||
           !cfg.moe_router_enable_expert_bias)
    why = "no sigmoid router with the expert bias (DeepSeek-V3's noaux_tc)";
  else if (!cfg.qk_layernorm)
    why = "no latent norms (--qk-layernorm)";
  else if (!cfg.rotary_interleaved)
    why = "RoPE in halves (DeepSeek-V3 rotates interleaved pairs: --rotary-interleaved)";
  else if (cfg.moe_router_num_groups > 0 && cfg.moe_group_score_experts() != 2)
    why =
        "Megatron's group score (DeepSeek-V3 sums a group's top 2: "
        "--moe-router-group-score-experts 2)";
  else if (cfg.moe_shared_expert_intermediate_size % cfg.moe_ffn() != 0)
    why = "a shared expert whose width is not a multiple of the experts'";
  else if (cfg.moe_router_topk_scaling_factor <= 0)
    why = "unscaled routing weights (routed_scaling_factor: --moe-router-topk-scaling-factor)";
  else if (cfg.moe_expert_capacity_factor > 0)
    why = "token dropping (--moe-expert-capacity-factor)";
  int first = 0;
  while (first < cfg.num_layers && !cfg.is_moe_layer(first)) ++first;
  for (int l = first; l < cfg.num_layers && why.empty(); ++l)
    if (!cfg.is_moe_layer(l))
      why = "dense layers after the first MoE one (--moe-layer-freq " + cfg.moe_layer_freq +
            "; DeepSeek-V3 has first_k_dense_replace dense layers, then MoE)";
  if (!why.empty()) throw ConfigError(ck + " has " + why + "; DeepseekV3ForCausalLM has not");
}

std::string deepseek_config_json(const GPTConfig& cfg, const std::string& torch_dtype,
                                 double aux_coeff) {
  int first = 0;
  while (first < cfg.num_layers && !cfg.is_moe_layer(first)) ++first;
  std::ostringstream c;
  c << "{\n  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n  \"model_type\": \"deepseek_v3\""
    << ",\n  \"vocab_size\": " << cfg.vocab_size << ",\n  \"hidden_size\": " << cfg.hidden_size
    << ",\n  \"intermediate_size\": " << cfg.ffn()
    << ",\n  \"moe_intermediate_size\": " << cfg.moe_ffn()
    << ",\n  \"num_hidden_layers\": " << cfg.num_layers
    << ",\n  \"num_nextn_predict_layers\": " << cfg.mtp_num_layers
    << ",\n  \"num_attention_heads\": " << cfg.num_attention_heads
    << ",\n  \"num_key_value_heads\": " << cfg.num_attention_heads
    << ",\n  \"n_shared_experts\": " << cfg.moe_shared_expert_intermediate_size / cfg.moe_ffn()
    << ",\n  \"n_routed_experts\": " << cfg.num_experts
    << ",\n  \"routed_scaling_factor\": " << num(cfg.moe_router_topk_scaling_factor)
    << ",\n  \"kv_lora_rank\": " << cfg.kv_lora_rank << ",\n  \"q_lora_rank\": "
    << (cfg.q_lora_rank > 0 ? std::to_string(cfg.q_lora_rank) : std::string("null"))
    << ",\n  \"qk_rope_head_dim\": " << cfg.qk_pos_emb_head_dim
    << ",\n  \"v_head_dim\": " << cfg.v_head_dim << ",\n  \"qk_nope_head_dim\": " << cfg.qk_head_dim
    << ",\n  \"topk_method\": \"noaux_tc\",\n  \"n_group\": "
    << std::max(1, cfg.moe_router_num_groups)
    << ",\n  \"topk_group\": " << std::max(1, cfg.moe_router_group_topk)
    << ",\n  \"num_experts_per_tok\": " << cfg.moe_router_topk
    << ",\n  \"moe_layer_freq\": 1,\n  \"first_k_dense_replace\": " << first
    << ",\n  \"norm_topk_prob\": true,\n  \"scoring_func\": \"sigmoid\""
    << ",\n  \"aux_loss_alpha\": " << num(aux_coeff) << ",\n  \"seq_aux\": "
    << (cfg.moe_router_load_balancing_type == "seq_aux_loss" ? "true" : "false")
    << ",\n  \"hidden_act\": \"silu\",\n  \"max_position_embeddings\": " << cfg.max_positions()
    << ",\n  \"initializer_range\": " << num(cfg.init_method_std)
    << ",\n  \"rms_norm_eps\": " << num(cfg.layernorm_epsilon)
    << ",\n  \"tie_word_embeddings\": " << (cfg.tied_head() ? "true" : "false")
    << ",\n  \"rope_theta\": " << num(cfg.rotary_base) << ",\n  \"rope_scaling\": ";
  if (cfg.yarn())
    c << "{\n    \"type\": \"yarn\",\n    \"factor\": " << num(cfg.rotary_scaling_factor)
      << ",\n    \"original_max_position_embeddings\": " << cfg.original_max_position_embeddings
      << ",\n    \"beta_fast\": " << num(cfg.beta_fast)
      << ",\n    \"beta_slow\": " << num(cfg.beta_slow) << ",\n    \"mscale\": " << num(cfg.mscale)
      << ",\n    \"mscale_all_dim\": " << num(cfg.mscale_all_dim) << "\n  }";
  else
    c << "null";
  c << ",\n  \"attention_bias\": false,\n  \"attention_dropout\": 0.0,\n  \"torch_dtype\": \""
    << torch_dtype << "\"\n}\n";
  return c.str();
}

// DeepSeek-V3's names: multi-latent attention's projections and latent norms, the router
// (mlp.gate), the shared experts, the routed experts as Llama MLPs, and multi-token prediction's
// depth k as layer num_layers + k.
std::vector<std::string> deepseek_parts(const std::string& n, int num_layers) {
  if (n.rfind("mtp.", 0) == 0) {
    const size_t dot = n.find('.', 4);
    const std::string q =
        "model.layers." + std::to_string(num_layers + std::stoi(n.substr(4, dot - 4))) + ".";
    const std::string r = n.substr(dot + 1);
    if (r == "enorm.weight" || r == "hnorm.weight" || r == "eh_proj.weight") return {q + r};
    if (r == "final_norm.weight") return {q + "shared_head.norm.weight"};
    throw Error("no Hugging Face DeepSeek-V3 name for parameter " + n);
  }
  if (n.rfind("layers.", 0) != 0) return {};
  const size_t dot = n.find('.', 7);
  const std::string h = "model.layers." + n.substr(7, dot - 7) + ".", rest = n.substr(dot + 1);
  const std::string a = h + "self_attn.", m = h + "mlp.";
  static const std::map<std::string, std::string> mla{
      {"attn.q_down.weight", "q_a_proj.weight"},
      {"attn.q_down_norm.weight", "q_a_layernorm.weight"},
      {"attn.q_up.weight", "q_b_proj.weight"},
      {"attn.q_proj.weight", "q_proj.weight"},
      {"attn.kv_down.weight", "kv_a_proj_with_mqa.weight"},
      {"attn.kv_down_norm.weight", "kv_a_layernorm.weight"},
      {"attn.kv_up.weight", "kv_b_proj.weight"}};
  if (const auto it = mla.find(rest); it != mla.end()) return {a + it->second};
  if (rest == "mlp.router.weight") return {m + "gate.weight"};
  auto llama_mlp = [](const std::string& x, const std::string& w) -> std::vector<std::string> {
    if (w == "fc1.weight") return {x + "gate_proj.weight", x + "up_proj.weight"};
    if (w == "fc2.weight") return {x + "down_proj.weight"};
    return {};
  };
  if (rest.rfind("mlp.shared_expert.", 0) == 0)
    return llama_mlp(m + "shared_experts.", rest.substr(18));
  if (rest.rfind("mlp.experts.", 0) == 0) {
    const size_t d = rest.find('.', 12);
    return llama_mlp(m + "experts." + rest.substr(12, d - 12) + ".", rest.substr(d + 1));
  }
  return {};
}

// Each MoE layer's e_score_correction_bias (the router's expert bias) and each MTP layer's copies
// of the embedding and the output layer (Tessera's MTP shares them).
std::vector<HfExtra> deepseek_extras(const GPTConfig& cfg) {
  std::vector<HfExtra> out;
  for (int l = 0; l < cfg.total_layers(); ++l)
    if (cfg.is_moe_layer(l) && cfg.moe_router_enable_expert_bias)
      out.push_back({"model.layers." + std::to_string(l) + ".mlp.gate.e_score_correction_bias",
                     {cfg.num_experts},
                     l,
                     "",
                     ""});
  for (int k = 0; k < cfg.mtp_num_layers; ++k) {
    const std::string q = "model.layers." + std::to_string(cfg.num_layers + k) + ".";
    const std::string why =
        "Tessera's multi-token prediction shares the model's (they must be equal, as in "
        "DeepSeek's checkpoints)";
    out.push_back({q + "embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size}, -1, "wte", why});
    out.push_back({q + "shared_head.head.weight",
                   {cfg.vocab_size, cfg.hidden_size},
                   -1,
                   cfg.tied_head() ? "wte" : "lm_head",
                   why});
  }
  return out;
}

}  // namespace

const HfFamily& deepseek_v3_family() {
  static const HfFamily f{
      "deepseek_v3",         "DeepseekV3ForCausalLM", deepseek_parts,           deepseek_extras,
      parse_deepseek_config, deepseek_config_json,    check_deepseek_exportable};
  return f;
}

}  // namespace tessera
