// reference_gpt.cpp: the naive double-precision GPT forward used as the test oracle: GPT-2, and
// the Llama family's options (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head, no
// biases) and Qwen2's and Megatron's smaller ones (QKV-only biases, --kv-channels, norms applying
// (1 + w), interleaved rotary pairs, squared ReLU), written from their definitions, per token and
// per head.
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
                      const std::vector<int>& targets, int B, int T) {
  const int C = cfg.hidden_size, H = cfg.num_attention_heads, F = cfg.ffn();
  const int hd = cfg.kv_channels > 0 ? cfg.kv_channels : C / H, D = H * hd;  // D: attention width
  const int G = cfg.group_query_attention ? cfg.num_query_groups : H;
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
  double total = 0;
  int count = 0;
  for (int b = 0; b < B; ++b) {
    std::vector<Vec> x(T, Vec(C));
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        x[t][c] = wte[ids[b * T + t] * C + c] + (wpe ? (*wpe)[t * C + c] : 0.0);
    for (int l = 0; l < cfg.num_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      // Per token: queries q[t][h*hd..], keys k[t][g*hd..], values v[t][g*hd..].
      std::vector<Vec> q(T), k(T), v(T);
      for (int t = 0; t < T; ++t) {
        const Vec h = norm(x[t], p + "ln1");
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
        if (rope) {
          for (int hh = 0; hh < H; ++hh) rotate(q[t], hh * hd, rot, cfg, t);
          for (int g = 0; g < G; ++g) rotate(k[t], g * hd, rot, cfg, t);
        }
      }
      for (int t = 0; t < T; ++t) {
        Vec att(D, 0.0);
        for (int hh = 0; hh < H; ++hh) {
          const int g = hh / (H / G);
          std::vector<double> s(T, 0.0);
          double m = -1e300;
          for (int u = 0; u <= t; ++u) {
            double d = 0;
            for (int e = 0; e < hd; ++e) d += q[t][hh * hd + e] * k[u][g * hd + e];
            s[u] = d / std::sqrt(static_cast<double>(hd));
            if (cfg.position_embedding_type == "alibi") {  // the paper's slopes, in double
              const int p = 1 << static_cast<int>(std::floor(std::log2(H)));
              const double slope = hh < p ? std::pow(2.0, -8.0 * (hh + 1) / p)
                                          : std::pow(2.0, -8.0 * (2 * (hh - p) + 1) / (2 * p));
              s[u] += slope * (u - t);
            }
            m = std::max(m, s[u]);
          }
          double z = 0;
          for (int u = 0; u <= t; ++u) z += std::exp(s[u] - m);
          for (int u = 0; u <= t; ++u)
            for (int e = 0; e < hd; ++e)
              att[hh * hd + e] += std::exp(s[u] - m) / z * v[u][g * hd + e];
        }
        const Vec y = linear(att, P.at(p + "attn.proj.weight"), maybe(P, p + "attn.proj.bias"), C);
        for (int c = 0; c < C; ++c) x[t][c] += y[c];
      }
      for (int t = 0; t < T; ++t) {
        const Vec h = norm(x[t], p + "ln2");
        Vec f = linear(h, P.at(p + "mlp.fc1.weight"), maybe(P, p + "mlp.fc1.bias"),
                       cfg.swiglu ? 2 * F : F);
        Vec act(F);
        for (int i = 0; i < F; ++i)
          act[i] = cfg.swiglu         ? f[i] / (1 + std::exp(-f[i])) * f[F + i]
                   : cfg.squared_relu ? std::max(f[i], 0.0) * std::max(f[i], 0.0)
                                      : gelu(f[i]);
        const Vec y = linear(act, P.at(p + "mlp.fc2.weight"), maybe(P, p + "mlp.fc2.bias"), C);
        for (int c = 0; c < C; ++c) x[t][c] += y[c];
      }
    }
    for (int t = 0; t < T; ++t) {
      const int target = targets[b * T + t];
      if (target < 0) continue;
      const Vec h = norm(x[t], "lnf");
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
      total += std::log(z) + m - logits[target];
      ++count;
    }
  }
  return total / count;
}

}  // namespace tessera::testing
