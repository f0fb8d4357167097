// reference_gpt.cpp: the naive double-precision GPT forward used as the test oracle: GPT-2, and
// the Llama family's options (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head, no
// biases) and Qwen2's and Megatron's smaller ones (QKV-only biases, --kv-channels, norms applying
// (1 + w), interleaved rotary pairs, squared ReLU), Qwen3's per-head query/key norms, written from
// their definitions, per token and per head.
#include "reference_gpt.hpp"

#include <algorithm>
#include <cmath>

namespace tessera::testing {

namespace {
using Vec = std::vector<double>;

Vec layernorm(const Vec& x, const Vec& w, const Vec& b, double eps) {
  const size_t C = x.size();
  double m = 0, v = 0;
  for (double a : x) m += a;
  m /= C;
  for (double a : x) v += (a - m) * (a - m);
  v /= C;
  Vec y(C);
  for (size_t i = 0; i < C; ++i) y[i] = (x[i] - m) / std::sqrt(v + eps) * w[i] + b[i];
  return y;
}

// y[o] = sum_i W[o*in + i] x[i] + b[o]
Vec linear(const Vec& x, const Vec& W, const Vec* b, size_t out) {
  const size_t in = x.size();
  Vec y(out);
  for (size_t o = 0; o < out; ++o) {
    double s = b ? (*b)[o] : 0.0;
    for (size_t i = 0; i < in; ++i) s += W[o * in + i] * x[i];
    y[o] = s;
  }
  return y;
}

double gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

Vec rmsnorm(const Vec& x, const Vec& w, double eps) {
  const size_t C = x.size();
  double ss = 0;
  for (double a : x) ss += a * a;
  Vec y(C);
  for (size_t i = 0; i < C; ++i) y[i] = x[i] / std::sqrt(ss / C + eps) * w[i];
  return y;
}

const Vec* maybe(const RefParams& P, const std::string& name) {
  auto it = P.find(name);
  return it == P.end() ? nullptr : &it->second;
}

// The inverse frequency of pair i, with Llama 3's scaling when configured.
double inv_freq(const GPTConfig& c, int i, int rot) {
  const double inv = std::pow(c.rotary_base, -2.0 * i / rot);
  if (c.rope_type == "yarn" && c.rotary_scaling_factor > 1) {
    // YaRN (DeepSeek's yarn_find_correction_range and linear ramp): pair indices below `lo`
    // keep their frequency, above `hi` are divided by the factor, a ramp between.
    auto dim_at = [&](double turns) {
      return rot * std::log(c.original_max_position_embeddings / (turns * 2 * M_PI)) /
             (2 * std::log(c.rotary_base));
    };
    const double lo = std::max(std::floor(dim_at(c.beta_fast)), 0.0);
    double hi = std::min(std::ceil(dim_at(c.beta_slow)), rot - 1.0);
    if (hi == lo) hi += 0.001;
    const double ramp = std::min(std::max((i - lo) / (hi - lo), 0.0), 1.0);
    return inv / c.rotary_scaling_factor * ramp + inv * (1 - ramp);
  }
  if (!c.use_rope_scaling) return inv;
  const double wavelen = 2 * M_PI / inv, old = c.rope_scaling_original_max_positions;
  const double lo = c.rope_scaling_low_freq_factor, hi = c.rope_scaling_high_freq_factor;
  if (wavelen < old / hi) return inv;
  if (wavelen > old / lo) return inv / c.rope_scaling_factor;
  const double s = (old / wavelen - lo) / (hi - lo);
  return (1 - s) * inv / c.rope_scaling_factor + s * inv;
}

// Rotates features [0, rot) of the head at x[off..] for position t, pairs (i, i + rot/2), or
// (2i, 2i + 1) when interleaved.
void rotate(Vec& x, int off, int rot, const GPTConfig& c, int t) {
  for (int i = 0; i < rot / 2; ++i) {
    const double a = t * inv_freq(c, i, rot);
    const int i1 = off + (c.rotary_interleaved ? 2 * i : i);
    const int i2 = off + (c.rotary_interleaved ? 2 * i + 1 : i + rot / 2);
    const double x1 = x[i1], x2 = x[i2];
    x[i1] = x1 * std::cos(a) - x2 * std::sin(a);
    x[i2] = x2 * std::cos(a) + x1 * std::sin(a);
  }
}
}  // namespace

double reference_loss(const GPTConfig& cfg, const RefParams& P, const std::vector<int>& ids,
                      const std::vector<int>& targets, int B, int T, const RefDocuments* docs) {
  // The position of token t of sample b, and the first key it sees.
  auto pos = [&](int b, int t) {
    return docs && !docs->positions.empty() ? docs->positions[b * T + t] : t;
  };
  auto first_key = [&](int b, int t) {
    return docs && !docs->key_begin.empty() ? docs->key_begin[b * T + t] : 0;
  };
  const int C = cfg.hidden_size, H = cfg.num_attention_heads, F = cfg.ffn();
  const int hd = cfg.kv_channels > 0 ? cfg.kv_channels : C / H, D = H * hd;  // D: attention width
  const int G = cfg.group_query_attention && !cfg.multi_latent_attention ? cfg.num_query_groups : H;
  // Multi-latent attention: queries and keys of dn + dr features per head (the last dr with
  // RoPE, the keys' shared by every head), values of dv.
  const bool mla = cfg.multi_latent_attention;
  const int dn = cfg.qk_head_dim, dr = cfg.qk_pos_emb_head_dim, dv = cfg.v_head_dim;
  const int qkd = mla ? dn + dr : hd, vd = mla ? dv : hd;  // per head: q/k and v widths
  double softmax_scale = 1 / std::sqrt(static_cast<double>(qkd));
  if (mla && cfg.rope_type == "yarn" && cfg.rotary_scaling_factor > 1) {
    const double m = 0.1 * cfg.mscale_all_dim * std::log(cfg.rotary_scaling_factor) + 1;
    softmax_scale *= m * m;
  }
  const double eps = cfg.layernorm_epsilon;
  const int V = static_cast<int>(cfg.vocab_size);
  const bool rms = cfg.normalization == "RMSNorm", rope = cfg.position_embedding_type == "rope";
  const int rot = static_cast<int>(hd * cfg.rotary_percent + 1e-9) / 2 * 2;
  const Vec& wte = P.at("wte");
  const Vec* wpe = maybe(P, "wpe");
  const Vec& head = cfg.untie_embeddings_and_output_weights ? P.at("lm_head") : wte;
  auto norm = [&](const Vec& x, const std::string& name) {
    Vec w = P.at(name + ".weight");
    if (cfg.apply_layernorm_1p)
      for (double& e : w) e += 1;
    return rms ? rmsnorm(x, w, eps) : layernorm(x, w, P.at(name + ".bias"), eps);
  };
  // The MLP of a token (a dense one at prefix m, of width F).
  auto mlp = [&](const Vec& h, const std::string& m, int width) {
    Vec f =
        linear(h, P.at(m + "fc1.weight"), maybe(P, m + "fc1.bias"), cfg.swiglu ? 2 * width : width);
    Vec act(width);
    for (int i = 0; i < width; ++i)
      act[i] = cfg.swiglu         ? f[i] / (1 + std::exp(-f[i])) * f[width + i]
               : cfg.squared_relu ? std::max(f[i], 0.0) * std::max(f[i], 0.0)
                                  : gelu(f[i]);
    return linear(act, P.at(m + "fc2.weight"), maybe(P, m + "fc2.bias"), C);
  };
  double moe_losses = 0;  // the load-balancing and z losses of the MoE layers
  // x[b][t]: the residual stream, layer by layer over the whole micro-batch (MoE's losses see all
  // of its tokens at once).
  std::vector<std::vector<Vec>> x(B, std::vector<Vec>(T, Vec(C)));
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        x[b][t][c] = wte[ids[b * T + t] * C + c] + (wpe ? (*wpe)[pos(b, t) * C + c] : 0.0);
  // One transformer layer l over a residual stream xs (B x T): the model's, and multi-token
  // prediction's (layers num_layers + k) over theirs.
  auto run_layer = [&](int l, std::vector<std::vector<Vec>>& x) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (int b = 0; b < B; ++b) {
      std::vector<Vec>& xb = x[b];
      // Per token: queries q[t][h*hd..], keys k[t][g*hd..], values v[t][g*hd..].
      std::vector<Vec> q(T), k(T), v(T);
      for (int t = 0; t < T; ++t) {
        const Vec h = norm(xb[t], p + "ln1");
        if (mla) {  // the latents, their norms (with --qk-layernorm), the heads
          const std::string a = p + "attn.";
          const int qr = cfg.q_lora_rank, kvr = cfg.kv_lora_rank;
          if (qr > 0) {
            Vec ql = linear(h, P.at(a + "q_down.weight"), nullptr, qr);
            if (cfg.qk_layernorm) ql = norm(ql, a + "q_down_norm");
            q[t] = linear(ql, P.at(a + "q_up.weight"), nullptr, H * qkd);
          } else {
            q[t] = linear(h, P.at(a + "q_proj.weight"), nullptr, H * qkd);
          }
          const Vec lat = linear(h, P.at(a + "kv_down.weight"), nullptr, kvr + dr);
          Vec cl(lat.begin(), lat.begin() + kvr);
          Vec kpe(lat.begin() + kvr, lat.end());
          rotate(kpe, 0, dr, cfg, pos(b, t));
          if (cfg.qk_layernorm) cl = norm(cl, a + "kv_down_norm");
          const Vec kvh = linear(cl, P.at(a + "kv_up.weight"), nullptr, H * (dn + dv));
          k[t].assign(H * qkd, 0.0);
          v[t].assign(H * dv, 0.0);
          for (int hh = 0; hh < H; ++hh) {
            rotate(q[t], hh * qkd + dn, dr, cfg, pos(b, t));
            for (int e = 0; e < dn; ++e) k[t][hh * qkd + e] = kvh[hh * (dn + dv) + e];
            for (int e = 0; e < dr; ++e) k[t][hh * qkd + dn + e] = kpe[e];
            for (int e = 0; e < dv; ++e) v[t][hh * dv + e] = kvh[hh * (dn + dv) + dn + e];
          }
          continue;
        }
        if (cfg.group_query_attention) {
          q[t] = linear(h, P.at(p + "attn.q.weight"), maybe(P, p + "attn.q.bias"), H * hd);
          const Vec kv =
              linear(h, P.at(p + "attn.kv.weight"), maybe(P, p + "attn.kv.bias"), 2 * G * hd);
          k[t] = Vec(kv.begin(), kv.begin() + G * hd);
          v[t] = Vec(kv.begin() + G * hd, kv.end());
        } else {
          const Vec qkv =
              linear(h, P.at(p + "attn.qkv.weight"), maybe(P, p + "attn.qkv.bias"), 3 * D);
          q[t] = Vec(qkv.begin(), qkv.begin() + D);
          k[t] = Vec(qkv.begin() + D, qkv.begin() + 2 * D);
          v[t] = Vec(qkv.begin() + 2 * D, qkv.end());
        }
        if (cfg.qk_layernorm) {  // Qwen3: every query and key head through its norm, then RoPE
          auto heads = [&](Vec& v, int n, const std::string& name) {
            for (int hh = 0; hh < n; ++hh) {
              const Vec y = norm(Vec(v.begin() + hh * hd, v.begin() + (hh + 1) * hd), name);
              std::copy(y.begin(), y.end(), v.begin() + hh * hd);
            }
          };
          heads(q[t], H, p + "attn.q_norm");
          heads(k[t], G, p + "attn.k_norm");
        }
        if (rope) {
          for (int hh = 0; hh < H; ++hh) rotate(q[t], hh * hd, rot, cfg, pos(b, t));
          for (int g = 0; g < G; ++g) rotate(k[t], g * hd, rot, cfg, pos(b, t));
        }
      }
      for (int t = 0; t < T; ++t) {
        Vec att(H * vd, 0.0);
        for (int hh = 0; hh < H; ++hh) {
          const int g = hh / (H / G);
          std::vector<double> s(T, 0.0);
          double m = -1e300;
          const int u0 = first_key(b, t);
          for (int u = u0; u <= t; ++u) {
            double d = 0;
            for (int e = 0; e < qkd; ++e) d += q[t][hh * qkd + e] * k[u][g * qkd + e];
            s[u] = d * softmax_scale;
            if (cfg.position_embedding_type == "alibi") {  // the paper's slopes, in double
              const int p2 = 1 << static_cast<int>(std::floor(std::log2(H)));
              const double slope = hh < p2 ? std::pow(2.0, -8.0 * (hh + 1) / p2)
                                           : std::pow(2.0, -8.0 * (2 * (hh - p2) + 1) / (2 * p2));
              s[u] += slope * (pos(b, u) - pos(b, t));
            }
            m = std::max(m, s[u]);
          }
          double z = 0;
          for (int u = u0; u <= t; ++u) z += std::exp(s[u] - m);
          for (int u = u0; u <= t; ++u)
            for (int e = 0; e < vd; ++e)
              att[hh * vd + e] += std::exp(s[u] - m) / z * v[u][g * vd + e];
        }
        const Vec y = linear(att, P.at(p + "attn.proj.weight"), maybe(P, p + "attn.proj.bias"), C);
        for (int c = 0; c < C; ++c) xb[t][c] += y[c];
      }
    }
    if (!cfg.is_moe_layer(l)) {
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < T; ++t) {
          const Vec y = mlp(norm(x[b][t], p + "ln2"), p + "mlp.", F);
          for (int c = 0; c < C; ++c) x[b][t][c] += y[c];
        }
      return;
    }
    // Mixture of Experts over the micro-batch's N = B*T tokens (docs/model.md).
    const int E = cfg.num_experts, K = cfg.moe_router_topk, N = B * T;
    const double scale =
        cfg.moe_router_topk_scaling_factor > 0 ? cfg.moe_router_topk_scaling_factor : 1.0;
    const bool sig = cfg.moe_router_score_function == "sigmoid";
    std::vector<Vec> h(N), logit(N), score(N);  // score: the load-balancing scores
    std::vector<std::vector<int>> chosen(N);    // the top k, best first
    std::vector<Vec> weight(N);
    for (int n = 0; n < N; ++n) {
      h[n] = norm(x[n / T][n % T], p + "ln2");
      logit[n] = linear(h[n], P.at(p + "mlp.router.weight"), nullptr, E);
      const Vec& z = logit[n];
      double m = -1e300, sum = 0;
      for (double e : z) m = std::max(m, e);
      Vec soft(E), sg(E);
      for (int e = 0; e < E; ++e) sum += (soft[e] = std::exp(z[e] - m));
      double sgsum = 0;
      for (int e = 0; e < E; ++e) {
        soft[e] /= sum;
        sgsum += (sg[e] = 1 / (1 + std::exp(-z[e])));
      }
      score[n] = soft;
      if (sig)
        for (int e = 0; e < E; ++e) score[n][e] = sg[e] / (sgsum + 1e-20);
      moe_losses += cfg.moe_z_loss_coeff * std::pow(m + std::log(sum), 2) / N;
      // The choice: by the logits; or, with DeepSeek-V3's router, by the sigmoid scores plus the
      // expert bias ("layers.l.mlp.router.expert_bias" when given), only among the experts of
      // the best groups (a group's score: the sum of its best `s` choice scores).
      Vec key(E);
      const Vec* bias = maybe(P, p + "mlp.router.expert_bias");
      for (int e = 0; e < E; ++e)
        key[e] = sig                          ? sg[e] + (bias ? (*bias)[e] : 0.0)
                 : cfg.moe_router_pre_softmax ? soft[e]
                                              : z[e];
      if (cfg.moe_router_num_groups > 0) {
        const int G = cfg.moe_router_num_groups, per = E / G;
        const int s = cfg.moe_router_group_score_experts > 0 ? cfg.moe_router_group_score_experts
                                                             : K / cfg.moe_router_group_topk;
        std::vector<std::pair<double, int>> groups;  // (-score, group): best first
        for (int g = 0; g < G; ++g) {
          Vec members(key.begin() + g * per, key.begin() + (g + 1) * per);
          std::sort(members.rbegin(), members.rend());
          double score = 0;
          for (int j = 0; j < s; ++j) score += members[j];
          groups.push_back({-score, g});
        }
        std::sort(groups.begin(), groups.end());
        std::vector<bool> kept(G, false);
        for (int j = 0; j < cfg.moe_router_group_topk; ++j) kept[groups[j].second] = true;
        for (int e = 0; e < E; ++e)
          if (!kept[e / per]) key[e] = -1e300;
      }
      std::vector<int> order(E);
      for (int e = 0; e < E; ++e) order[e] = e;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
      chosen[n].assign(order.begin(), order.begin() + K);
      Vec w(K);
      double wsum = 0;
      for (int j = 0; j < K; ++j) {
        const int e = chosen[n][j];
        w[j] = sig                          ? sg[e]
               : cfg.moe_router_pre_softmax ? soft[e]
                                            : std::exp(z[e] - z[chosen[n][0]]);
        wsum += w[j];
      }
      for (int j = 0; j < K; ++j) {
        const bool renorm = sig ? K > 1 : !cfg.moe_router_pre_softmax;
        if (renorm) w[j] /= sig ? wsum + 1e-20 : wsum;
        w[j] *= scale;
      }
      weight[n] = w;
    }
    // Load balancing, per micro-batch or per sequence.
    if (cfg.moe_router_load_balancing_type != "none") {
      const bool seq = cfg.moe_router_load_balancing_type == "seq_aux_loss";
      const int groups = seq ? B : 1, Tg = seq ? T : N;
      for (int g = 0; g < groups; ++g) {
        Vec Psum(E, 0.0), count(E, 0.0);
        for (int n = g * Tg; n < (g + 1) * Tg; ++n)
          for (int e = 0; e < E; ++e) {
            Psum[e] += score[n][e];
            count[e] += std::count(chosen[n].begin(), chosen[n].end(), e);
          }
        double aux = 0;
        for (int e = 0; e < E; ++e) aux += Psum[e] * count[e];
        moe_losses += cfg.moe_aux_loss_coeff * E * aux / (double(K) * Tg * Tg) / groups;
      }
    }
    // Token dropping: each expert keeps its capacity's highest weights (the earlier token on
    // ties), or its earliest tokens.
    std::vector<std::vector<bool>> keep(N, std::vector<bool>(K, true));
    if (cfg.moe_expert_capacity_factor > 0) {
      const int cap =
          static_cast<int>(std::ceil(double(N) * K / E * cfg.moe_expert_capacity_factor));
      if (cap <= N)
        for (int e = 0; e < E; ++e) {
          std::vector<std::pair<int, int>> slots;  // (n, j)
          for (int n = 0; n < N; ++n)
            for (int j = 0; j < K; ++j)
              if (chosen[n][j] == e) slots.push_back({n, j});
          if (cfg.moe_token_drop_policy == "probs")
            std::stable_sort(slots.begin(), slots.end(), [&](auto a, auto b) {
              return weight[a.first][a.second] > weight[b.first][b.second];
            });
          for (size_t i = cap; i < slots.size(); ++i) keep[slots[i].first][slots[i].second] = false;
        }
    }
    const int S = cfg.moe_shared_expert_intermediate_size;
    for (int n = 0; n < N; ++n) {
      Vec y(C, 0.0);
      for (int j = 0; j < K; ++j) {
        if (!keep[n][j]) continue;
        const Vec ye =
            mlp(h[n], p + "mlp.experts." + std::to_string(chosen[n][j]) + ".", cfg.moe_ffn());
        for (int c = 0; c < C; ++c) y[c] += weight[n][j] * ye[c];
      }
      if (S > 0) {
        const Vec ys = mlp(h[n], p + "mlp.shared_expert.", S);
        for (int c = 0; c < C; ++c) y[c] += ys[c];
      }
      for (int c = 0; c < C; ++c) x[n / T][n % T][c] += y[c];
    }
  };
  for (int l = 0; l < cfg.num_layers; ++l) run_layer(l, x);
  // The cross-entropy of a hidden state through the norm `nm` and the output layer.
  auto xent = [&](const Vec& hidden, const std::string& nm, int target) {
    const Vec h = norm(hidden, nm);
    Vec logits(V);
    double m = -1e300;
    for (int vv = 0; vv < V; ++vv) {
      double s = 0;
      for (int c = 0; c < C; ++c) s += head[vv * C + c] * h[c];
      logits[vv] = s;
      m = std::max(m, s);
    }
    double z = 0;
    for (int vv = 0; vv < V; ++vv) z += std::exp(logits[vv] - m);
    return std::log(z) + m - logits[target];
  };
  double total = 0;
  int count = 0;
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const int target = targets[b * T + t];
      if (target < 0) continue;
      total += xent(x[b][t], "lnf", target);
      ++count;
    }
  }
  // Multi-token prediction (Megatron-Core's MTP): depth k takes the token k + 1 ahead, the
  // previous depth's hidden state, their norms, the projection of [embedding | hidden], layer
  // num_layers + k, its final norm; its cross-entropy against the target k + 1 ahead, summed over
  // the positions that have one, weighs mtp_loss_scaling_factor / D over the main loss tokens.
  double mtp = 0;
  std::vector<std::vector<Vec>> h = x;  // the previous depth's hidden states
  for (int k = 0; k < cfg.mtp_num_layers; ++k) {
    const std::string m = "mtp." + std::to_string(k) + ".";
    std::vector<std::vector<Vec>> xk(B, std::vector<Vec>(T));
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const int q = t + k + 1, id = q < T ? ids[b * T + q] : 0;
        const Vec e = norm(Vec(wte.begin() + id * C, wte.begin() + (id + 1) * C), m + "enorm");
        Vec cat = e;
        const Vec hn = norm(h[b][t], m + "hnorm");
        cat.insert(cat.end(), hn.begin(), hn.end());
        xk[b][t] = linear(cat, P.at(m + "eh_proj.weight"), nullptr, C);
      }
    run_layer(cfg.num_layers + k, xk);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const int q = t + k + 1;
        if (q >= T || targets[b * T + q] < 0) continue;
        mtp += xent(xk[b][t], m + "final_norm", targets[b * T + q]);
      }
    h = xk;
  }
  return total / count + moe_losses +
         (cfg.mtp_num_layers > 0 ? cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * mtp / count
                                 : 0.0);
}

}  // namespace tessera::testing
