// gpt_config.cpp: validation and derived sizes of the GPT configuration.
#include "model/gpt_config.hpp"

#include "model/config_schema.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <vector>

#include "core/error.hpp"

namespace tessera {

namespace {

// --moe-layer-freq as Megatron reads it: an integer N (every N-th layer, from layer 0), or a
// list of 0/1 per layer written as Python does: "[1,0,1,1]", "([1]*3+[0]*1)*2". Returns one
// entry per layer; ConfigError naming the option otherwise.
std::vector<int> moe_layer_pattern(const std::string& text, int num_layers) {
  auto bad = [&](const std::string& why) {
    return ConfigError("--moe-layer-freq=" + text + " " + why +
                       " (allowed: an integer N >= 1 for every N-th layer, or a list of 0/1 with "
                       "one entry per layer such as [1,0,1,0] or ([1]*3+[0])*2)");
  };
  size_t i = 0;
  auto skip = [&] {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  };
  auto number = [&]() -> long {
    skip();
    size_t start = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
    if (start == i || i - start > 6) throw bad("is not understood");
    return std::stol(text.substr(start, i - start));
  };
  std::vector<int> out;
  skip();
  if (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const long n = number();
    skip();
    if (i != text.size()) throw bad("is not understood");
    if (n < 1) throw bad("is out of range");
    for (int l = 0; l < num_layers; ++l) out.push_back(l % n == 0 ? 1 : 0);
    return out;
  }
  // expr := term ('+' term)*; term := atom ('*' N)*; atom := '[' N (',' N)* ']' | '(' expr ')'
  std::function<std::vector<int>()> expr;
  auto atom = [&]() -> std::vector<int> {
    skip();
    if (i >= text.size()) throw bad("is not understood");
    if (text[i] == '(') {
      ++i;
      std::vector<int> v = expr();
      skip();
      if (i >= text.size() || text[i] != ')') throw bad("is not understood");
      ++i;
      return v;
    }
    if (text[i] != '[') throw bad("is not understood");
    ++i;
    std::vector<int> v;
    for (;;) {
      const long e = number();
      if (e != 0 && e != 1) throw bad("has an entry other than 0 or 1");
      v.push_back(static_cast<int>(e));
      skip();
      if (i < text.size() && text[i] == ',') {
        ++i;
        continue;
      }
      if (i < text.size() && text[i] == ']') {
        ++i;
        return v;
      }
      throw bad("is not understood");
    }
  };
  auto term = [&]() -> std::vector<int> {
    std::vector<int> v = atom();
    for (;;) {
      skip();
      if (i >= text.size() || text[i] != '*') return v;
      ++i;
      const long n = number();
      if (static_cast<double>(v.size()) * n > 1e6) throw bad("is too long");
      std::vector<int> r;
      for (long k = 0; k < n; ++k) r.insert(r.end(), v.begin(), v.end());
      v = std::move(r);
    }
  };
  expr = [&]() -> std::vector<int> {
    std::vector<int> v = term();
    for (;;) {
      skip();
      if (i >= text.size() || text[i] != '+') return v;
      ++i;
      const std::vector<int> r = term();
      v.insert(v.end(), r.begin(), r.end());
    }
  };
  out = expr();
  skip();
  if (i != text.size()) throw bad("is not understood");
  if (static_cast<int>(out.size()) != num_layers)
    throw bad(detail::concat("has ", out.size(), " entries for ", num_layers, " layers"));
  return out;
}

}  // namespace

int64_t GPTConfig::moe_received_rows(int64_t tokens, int ep) const {
  const int64_t K = moe_router_topk, E = num_experts, local = E / std::max(1, ep);
  if (ep <= 1) return tokens * K;
  int64_t rows = ep * tokens * std::min<int64_t>(K, local);
  if (!moe_dropless()) {
    const auto capacity =
        static_cast<int64_t>(std::ceil(double(tokens) * K / E * moe_expert_capacity_factor));
    if (capacity <= tokens) rows = std::min(rows, ep * local * capacity);
  }
  return rows;
}

bool GPTConfig::is_moe_layer(int layer) const {
  if (!moe()) return false;
  if (layer >= num_layers && layer < total_layers()) layer = num_layers - 1;  // MTP: the last's
  const std::vector<int> p = moe_layer_pattern(moe_layer_freq, num_layers);
  return layer >= 0 && layer < num_layers && p[static_cast<size_t>(layer)] == 1;
}

int GPTConfig::num_moe_layers() const {
  if (!moe()) return 0;
  int n = 0;
  for (int v : moe_layer_pattern(moe_layer_freq, num_layers)) n += v;
  return n;
}

int64_t GPTConfig::padded_vocab_size(int tp_size) const {
  const int64_t multiple = static_cast<int64_t>(make_vocab_size_divisible_by) * tp_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

void GPTConfig::validate() const {
  auto positive = [](const char* opt, int64_t v) {
    if (v <= 0)
      throw ConfigError(detail::concat("--", opt, "=", v, " is out of range (allowed: >= 1)"));
  };
  positive("num-layers", num_layers);
  positive("hidden-size", hidden_size);
  positive("num-attention-heads", num_attention_heads);
  positive("seq-length", seq_length);
  positive("make-vocab-size-divisible-by", make_vocab_size_divisible_by);
  if (vocab_size < 2)
    throw ConfigError(
        detail::concat("--vocab-size=", vocab_size, " is out of range (allowed: >= 2)"));
  if (vocab_size > (int64_t(1) << 31) - 1)
    throw ConfigError(
        detail::concat("--vocab-size=", vocab_size, " is too large (allowed: < 2^31)"));
  if (kv_channels < 0)
    throw ConfigError(detail::concat("--kv-channels=", kv_channels,
                                     " is out of range (allowed: 0 for hidden/heads, or >= 1)"));
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    throw ConfigError(detail::concat(
        "--num-attention-heads=", num_attention_heads, " must divide --hidden-size=", hidden_size,
        " (allowed: a divisor of ", hidden_size, "; or give --kv-channels)"));
  if (ffn_hidden_size < 0)
    throw ConfigError(detail::concat("--ffn-hidden-size=", ffn_hidden_size,
                                     " is out of range (allowed: 0 for 4*hidden, or >= 1)"));
  if (max_position_embeddings < 0)
    throw ConfigError(detail::concat("--max-position-embeddings=", max_position_embeddings,
                                     " is out of range (allowed: 0 for --seq-length, or >= 1)"));
  if (seq_length > max_positions())
    throw ConfigError(detail::concat("--seq-length=", seq_length,
                                     " exceeds --max-position-embeddings=", max_positions(),
                                     " (allowed: seq-length <= max-position-embeddings)"));
  if (!(init_method_std > 0))
    throw ConfigError(detail::concat("--init-method-std=", init_method_std, " must be > 0"));
  if (!(layernorm_epsilon > 0))
    throw ConfigError(detail::concat("--layernorm-epsilon=", layernorm_epsilon, " must be > 0"));
  if (position_embedding_type != "learned_absolute" && position_embedding_type != "rope" &&
      position_embedding_type != "alibi" && position_embedding_type != "none")
    throw ConfigError("--position-embedding-type=" + position_embedding_type +
                      " is not known (allowed: learned_absolute, rope, alibi, none)");
  if (normalization != "LayerNorm" && normalization != "RMSNorm")
    throw ConfigError("--normalization=" + normalization +
                      " is not known (allowed: LayerNorm, RMSNorm)");
  if (!(rotary_percent > 0 && rotary_percent <= 1))
    throw ConfigError(detail::concat("--rotary-percent=", rotary_percent,
                                     " is out of range (allowed: 0 < p <= 1)"));
  if (!(rotary_base > 0))
    throw ConfigError(detail::concat("--rotary-base=", rotary_base, " must be > 0"));
  if (rope() && rotary_dim() < 2)
    throw ConfigError(detail::concat("--rotary-percent=", rotary_percent, " of head dimension ",
                                     head_dim(), " rotates no feature pair (allowed: at least 2 ",
                                     "features, i.e. p >= ", 2.0 / head_dim(), ")"));
  if (rotary_interleaved && !rope())
    throw ConfigError("--rotary-interleaved needs --position-embedding-type rope");
  if (squared_relu && swiglu)
    throw ConfigError(
        "--squared-relu and --swiglu both given: they are two MLP activations; "
        "choose one");
  if (use_rope_scaling && !rope())
    throw ConfigError("--use-rope-scaling needs --position-embedding-type rope");
  if (use_rope_scaling && !(rope_scaling_factor > 1 && rope_scaling_low_freq_factor > 0 &&
                            rope_scaling_high_freq_factor > rope_scaling_low_freq_factor &&
                            rope_scaling_original_max_positions > 0))
    throw ConfigError(detail::concat(
        "--rope-scaling-factor=", rope_scaling_factor, " (low/high frequency factors ",
        rope_scaling_low_freq_factor, "/", rope_scaling_high_freq_factor, ", original positions ",
        rope_scaling_original_max_positions,
        ") is out of range (allowed: factor > 1, 0 < low < high, positions > 0)"));
  if (group_query_attention) {
    if (num_query_groups < 1)
      throw ConfigError(detail::concat("--num-query-groups=", num_query_groups,
                                       " is out of range (allowed: >= 1)"));
    if (num_query_groups == num_attention_heads)
      throw ConfigError(detail::concat(
          "--num-query-groups=", num_query_groups, " equals --num-attention-heads: that is ",
          "multi-head attention; drop --group-query-attention (or use fewer groups)"));
    if (num_attention_heads % num_query_groups != 0)
      throw ConfigError(detail::concat(
          "--num-query-groups=", num_query_groups, " does not divide --num-attention-heads=",
          num_attention_heads, " (allowed: a divisor of ", num_attention_heads, ")"));
  }
  validate_moe();
  validate_mla();
  if (mtp_num_layers < 0)
    throw ConfigError(detail::concat("--mtp-num-layers=", mtp_num_layers,
                                     " is out of range (allowed: 0 for none, or >= 1)"));
  if (mtp() && !(mtp_loss_scaling_factor >= 0 && std::isfinite(mtp_loss_scaling_factor)))
    throw ConfigError(detail::concat("--mtp-loss-scaling-factor=", mtp_loss_scaling_factor,
                                     " is out of range (allowed: >= 0)"));
  if (mtp() && learned_positions())
    throw ConfigError(
        "--mtp-num-layers with --position-embedding-type learned_absolute: "
        "multi-token prediction reads the word embedding alone (DeepSeek-V3 uses "
        "rope)");
  if (!(attention_dropout >= 0 && attention_dropout < 1))
    throw ConfigError(detail::concat("--attention-dropout=", attention_dropout,
                                     " is out of range (allowed: 0 <= p < 1)"));
  if (!(hidden_dropout >= 0 && hidden_dropout < 1))
    throw ConfigError(detail::concat("--hidden-dropout=", hidden_dropout,
                                     " is out of range (allowed: 0 <= p < 1)"));
}

void GPTConfig::validate_moe() const {
  if (num_experts < 0)
    throw ConfigError(detail::concat("--num-experts=", num_experts,
                                     " is out of range (allowed: 0 for a dense model, or >= 1)"));
  if (!moe()) return;
  if (moe_router_topk < 1 || moe_router_topk > num_experts)
    throw ConfigError(detail::concat("--moe-router-topk=", moe_router_topk,
                                     " is out of range for --num-experts=", num_experts,
                                     " (allowed: 1 to ", num_experts, ")"));
  if (moe_ffn_hidden_size < 0)
    throw ConfigError(
        detail::concat("--moe-ffn-hidden-size=", moe_ffn_hidden_size,
                       " is out of range (allowed: 0 for --ffn-hidden-size, or >= 1)"));
  if (moe_shared_expert_intermediate_size < 0)
    throw ConfigError(detail::concat(
        "--moe-shared-expert-intermediate-size=", moe_shared_expert_intermediate_size,
        " is out of range (allowed: 0 for none, or >= 1)"));
  const std::vector<int> pattern = moe_layer_pattern(moe_layer_freq, num_layers);  // or throws
  if (std::find(pattern.begin(), pattern.end(), 1) == pattern.end())
    throw ConfigError(detail::concat(
        "--moe-layer-freq=", moe_layer_freq, " leaves none of the ", num_layers,
        " layers a MoE layer; mark at least one with 1, or leave out --num-experts for a dense "
        "model"));
  if (moe_router_load_balancing_type != "aux_loss" &&
      moe_router_load_balancing_type != "seq_aux_loss" && moe_router_load_balancing_type != "none")
    throw ConfigError("--moe-router-load-balancing-type=" + moe_router_load_balancing_type +
                      " is not known (allowed: aux_loss, seq_aux_loss, none; Megatron's "
                      "sinkhorn balancing is not offered by Tessera)");
  if (moe_router_score_function != "softmax" && moe_router_score_function != "sigmoid")
    throw ConfigError("--moe-router-score-function=" + moe_router_score_function +
                      " is not known (allowed: softmax, sigmoid)");
  if (moe_router_pre_softmax && moe_router_score_function != "softmax")
    throw ConfigError("--moe-router-pre-softmax needs --moe-router-score-function softmax");
  if (!(moe_aux_loss_coeff >= 0) || !std::isfinite(moe_aux_loss_coeff))
    throw ConfigError(detail::concat("--moe-aux-loss-coeff=", moe_aux_loss_coeff,
                                     " is out of range (allowed: >= 0)"));
  if (!(moe_z_loss_coeff >= 0) || !std::isfinite(moe_z_loss_coeff))
    throw ConfigError(detail::concat("--moe-z-loss-coeff=", moe_z_loss_coeff,
                                     " is out of range (allowed: >= 0)"));
  if (!(moe_router_topk_scaling_factor >= 0) || !std::isfinite(moe_router_topk_scaling_factor))
    throw ConfigError(
        detail::concat("--moe-router-topk-scaling-factor=", moe_router_topk_scaling_factor,
                       " is out of range (allowed: > 0, or 0 for none)"));
  if (!std::isfinite(moe_expert_capacity_factor))
    throw ConfigError(detail::concat("--moe-expert-capacity-factor=", moe_expert_capacity_factor,
                                     " is out of range (allowed: > 0, or none for dropless)"));
  if (moe_token_dispatcher_type != "alltoall" && moe_token_dispatcher_type != "allgather")
    throw ConfigError("--moe-token-dispatcher-type=" + moe_token_dispatcher_type +
                      " is not known (allowed: alltoall, allgather)");
  if (moe_grouped_gemm && num_experts > 0 && add_bias_linear)
    throw ConfigError(
        "--moe-grouped-gemm: the grouped expert GEMMs take no biases; add --disable-bias-linear "
        "(as Megatron-Core's grouped GEMM requires)");
  validate_moe_router();
  if (moe_token_drop_policy != "probs" && moe_token_drop_policy != "position")
    throw ConfigError("--moe-token-drop-policy=" + moe_token_drop_policy +
                      " is not known (allowed: probs, position)");
}

void GPTConfig::validate_moe_router() const {
  if (moe_router_enable_expert_bias && moe_router_score_function != "sigmoid")
    throw ConfigError(
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the "
        "aux-loss-free bias is added to sigmoid scores, as in Megatron-Core)");
  if (!(moe_router_bias_update_rate >= 0) || !std::isfinite(moe_router_bias_update_rate))
    throw ConfigError(detail::concat("--moe-router-bias-update-rate=", moe_router_bias_update_rate,
                                     " is out of range (allowed: >= 0)"));
  if (moe_router_num_groups < 0 || moe_router_group_topk < 0 || moe_router_group_score_experts < 0)
    throw ConfigError(detail::concat("--moe-router-num-groups=", moe_router_num_groups,
                                     ", --moe-router-group-topk=", moe_router_group_topk,
                                     " and --moe-router-group-score-experts=",
                                     moe_router_group_score_experts, " must not be negative"));
  if (moe_router_num_groups == 0) {
    if (moe_router_group_topk > 0)
      throw ConfigError("--moe-router-group-topk needs --moe-router-num-groups");
    return;
  }
  const int E = num_experts, G = moe_router_num_groups;
  if (E % G != 0)
    throw ConfigError(detail::concat("--moe-router-num-groups=", G,
                                     " does not divide --num-experts=", E,
                                     " (allowed: a divisor of ", E, ")"));
  if (moe_router_group_topk < 1 || moe_router_group_topk > G)
    throw ConfigError(detail::concat("--moe-router-group-topk=", moe_router_group_topk,
                                     " is out of range for --moe-router-num-groups=", G,
                                     " (allowed: 1 to ", G, ")"));
  const int per_group = E / G;
  if (moe_router_topk > moe_router_group_topk * per_group)
    throw ConfigError(detail::concat(
        "--moe-router-topk=", moe_router_topk, " exceeds the ", moe_router_group_topk * per_group,
        " experts of the ", moe_router_group_topk, " groups each token keeps (",
        "--moe-router-group-topk x --num-experts / --moe-router-num-groups)"));
  const int s = moe_group_score_experts();
  if (s < 1 || s > per_group)
    throw ConfigError(detail::concat(
        "a group's score sums ", s, " experts' scores (",
        moe_router_group_score_experts > 0 ? "--moe-router-group-score-experts"
                                           : "--moe-router-topk / --moe-router-group-topk",
        "), but a group has ", per_group, " experts (allowed: 1 to ", per_group, ")"));
}

double GPTConfig::yarn_softmax_factor() const {
  if (!yarn() || rotary_scaling_factor <= 1) return 1.0;
  const double m = 0.1 * mscale_all_dim * std::log(rotary_scaling_factor) + 1.0;
  return m * m;
}

void GPTConfig::validate_mla() const {
  if (rope_type != "rope" && rope_type != "yarn")
    throw ConfigError("--rope-type=" + rope_type + " is not known (allowed: rope, yarn)");
  if (yarn() && !mla())
    throw ConfigError(
        "--rope-type yarn needs --multi-latent-attention (YaRN is offered with MLA, DeepSeek's "
        "attention)");
  if (!mla()) return;
  auto at_least = [](const char* opt, int64_t v, int64_t lo) {
    if (v < lo)
      throw ConfigError(detail::concat("--", opt, "=", v,
                                       " is out of range with "
                                       "--multi-latent-attention (allowed: >= ",
                                       lo, ")"));
  };
  at_least("kv-lora-rank", kv_lora_rank, 1);
  at_least("q-lora-rank", q_lora_rank, 0);
  at_least("qk-head-dim", qk_head_dim, 1);
  at_least("v-head-dim", v_head_dim, 1);
  if (qk_pos_emb_head_dim < 2 || qk_pos_emb_head_dim % 2 != 0)
    throw ConfigError(detail::concat("--qk-pos-emb-head-dim=", qk_pos_emb_head_dim,
                                     " must be even and at least 2 (RoPE rotates feature pairs)"));
  if (v_head_dim > head_dim())
    throw ConfigError(detail::concat("--v-head-dim=", v_head_dim, " exceeds --qk-head-dim + ",
                                     "--qk-pos-emb-head-dim = ", head_dim(),
                                     " (the values are padded to the query/key heads' width)"));
  if (!rope())
    throw ConfigError(
        "--multi-latent-attention needs --position-embedding-type rope (its keys' "
        "RoPE part is shared by the heads)");
  if (group_query_attention)
    throw ConfigError(
        "--multi-latent-attention with --group-query-attention: MLA's keys and "
        "values are per head, from one latent; drop --group-query-attention");
  if (add_bias_linear || add_qkv_bias)
    throw ConfigError(
        "--multi-latent-attention has no linear biases in Tessera (DeepSeek has "
        "none): add --disable-bias-linear and leave out --add-qkv-bias");
  if (kv_channels > 0 && kv_channels != head_dim())
    throw ConfigError(
        detail::concat("--kv-channels=", kv_channels, " with --multi-latent-attention:",
                       " the heads are --qk-head-dim + --qk-pos-emb-head-dim = ", head_dim(),
                       " wide; leave --kv-channels out"));
  if (use_rope_scaling)
    throw ConfigError(
        "--use-rope-scaling (Llama 3's) with --multi-latent-attention: use "
        "--rope-type yarn for DeepSeek's scaling");
  if (yarn()) {
    if (!(rotary_scaling_factor >= 1) || !(beta_fast > beta_slow) || !(beta_slow > 0) ||
        original_max_position_embeddings < 1)
      throw ConfigError(detail::concat(
          "--rope-type yarn: --rotary-scaling-factor=", rotary_scaling_factor,
          ", --beta-fast=", beta_fast, ", --beta-slow=", beta_slow,
          ", --original-max-position-embeddings=", original_max_position_embeddings,
          " (allowed: factor >= 1, beta-fast > beta-slow > 0, original positions >= 1)"));
    if (mscale != mscale_all_dim && rotary_scaling_factor > 1 && mscale_all_dim != 0)
      throw ConfigError(detail::concat(
          "--mscale=", mscale, " differs from --mscale-all-dim=", mscale_all_dim,
          ": YaRN would then scale RoPE's cos and sin by their ratio, which Tessera does not "
          "(DeepSeek-V2/V3 give the two the same value)"));
  }
}

int GPTConfig::rotary_dim() const {
  if (mla()) return qk_pos_emb_head_dim;  // MLA: the RoPE part of each head
  // Megatron: int(head_dim * percent), rounded down to an even count.
  const int d = static_cast<int>(head_dim() * rotary_percent + 1e-9);
  return d - d % 2;
}

std::string GPTConfig::describe() const {
  return describe_model(*this);  // the table's words (model/config_schema.cpp)
}

// num_parameters() and num_active_parameters(): model/params.cpp, from the parts' parameter specs.

double GPTConfig::train_flops_per_token() const {
  const double h = hidden_size, L = num_layers, s = seq_length, V = static_cast<double>(vocab_size);
  const double f = ffn(), hd = head_dim(), H = num_attention_heads, G = kv_heads();
  // matmul parameters per layer: qkv (H+2G)*hd*h (3h^2 for GPT-2), proj h^2, mlp 2*h*f (= 8h^2
  // for f = 4h; 3*h*f with SwiGLU's gate)
  const double per_f = (swiglu ? 3 : 2) * h;  // MLP GEMM parameters per unit of width
  double mlp = 0;  // summed over layers: with MoE the k experts a token uses, and the router
  for (int l = 0; l < num_layers; ++l)
    mlp +=
        is_moe_layer(l)
            ? per_f * (double(moe_router_topk) * moe_ffn() + moe_shared_expert_intermediate_size) +
                  double(num_experts) * h
            : per_f * f;
  double attn = (H + 2 * G) * hd * h + H * hd * h;
  if (mla()) {
    const double qr = q_lora_rank, kvr = kv_lora_rank;
    attn = (qr > 0 ? qr * h + H * hd * qr : H * hd * h) + (kvr + qk_pos_emb_head_dim) * h +
           H * (qk_head_dim + v_head_dim) * kvr + h * H * v_head_dim;
  }
  const double matmul_params = L * attn + mlp + V * h;
  // attention scores and their weighted sum: 12*L*s*(H*hd) (= 12*L*s*h unless --kv-channels;
  // MLA: 6*L*s*H*(hd + v_head_dim), the padded values not counted)
  const double scores = mla() ? 6.0 * L * s * H * (hd + v_head_dim) : 12.0 * L * s * H * hd;
  return 6.0 * matmul_params + scores;
}

void set_seq_length(GPTConfig& cfg, int seq, const std::string& source) {
  if (seq == 0) return;
  if (seq < 0 || seq > cfg.max_positions())
    throw ConfigError(detail::concat("--seq-length=", seq, " is out of range: the model of '",
                                     source, "' has ", cfg.max_positions(),
                                     " positions (allowed: 1 to ", cfg.max_positions(), ")"));
  cfg.max_position_embeddings = cfg.max_positions();
  cfg.seq_length = seq;
}

}  // namespace tessera
