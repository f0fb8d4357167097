// reference_gpt.cpp: the naive double-precision GPT-2 forward used as the test oracle.
#include "reference_gpt.hpp"

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
}  // namespace

double reference_loss(const GPTConfig& cfg, const RefParams& P, const std::vector<int>& ids,
                      const std::vector<int>& targets, int B, int T) {
  const int C = cfg.hidden_size, H = cfg.num_attention_heads, hd = C / H, F = cfg.ffn();
  const double eps = cfg.layernorm_epsilon;
  const int V = static_cast<int>(cfg.vocab_size);
  const Vec& wte = P.at("wte");
  const Vec& wpe = P.at("wpe");
  double total = 0;
  int count = 0;
  for (int b = 0; b < B; ++b) {
    std::vector<Vec> x(T, Vec(C));
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) x[t][c] = wte[ids[b * T + t] * C + c] + wpe[t * C + c];
    for (int l = 0; l < cfg.num_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      std::vector<Vec> qkv(T);
      for (int t = 0; t < T; ++t) {
        const Vec h = layernorm(x[t], P.at(p + "ln1.weight"), P.at(p + "ln1.bias"), eps);
        qkv[t] = linear(h, P.at(p + "attn.qkv.weight"), &P.at(p + "attn.qkv.bias"), 3 * C);
      }
      for (int t = 0; t < T; ++t) {
        Vec att(C, 0.0);
        for (int hh = 0; hh < H; ++hh) {
          std::vector<double> s(T, 0.0);
          double m = -1e300;
          for (int u = 0; u <= t; ++u) {
            double d = 0;
            for (int k = 0; k < hd; ++k) d += qkv[t][hh * hd + k] * qkv[u][C + hh * hd + k];
            s[u] = d / std::sqrt(static_cast<double>(hd));
            m = std::max(m, s[u]);
          }
          double z = 0;
          for (int u = 0; u <= t; ++u) z += std::exp(s[u] - m);
          for (int u = 0; u <= t; ++u)
            for (int k = 0; k < hd; ++k)
              att[hh * hd + k] += std::exp(s[u] - m) / z * qkv[u][2 * C + hh * hd + k];
        }
        const Vec y = linear(att, P.at(p + "attn.proj.weight"), &P.at(p + "attn.proj.bias"), C);
        for (int c = 0; c < C; ++c) x[t][c] += y[c];
      }
      for (int t = 0; t < T; ++t) {
        const Vec h = layernorm(x[t], P.at(p + "ln2.weight"), P.at(p + "ln2.bias"), eps);
        Vec f = linear(h, P.at(p + "mlp.fc1.weight"), &P.at(p + "mlp.fc1.bias"), F);
        for (double& a : f) a = gelu(a);
        const Vec y = linear(f, P.at(p + "mlp.fc2.weight"), &P.at(p + "mlp.fc2.bias"), C);
        for (int c = 0; c < C; ++c) x[t][c] += y[c];
      }
    }
    for (int t = 0; t < T; ++t) {
      const int target = targets[b * T + t];
      if (target < 0) continue;
      const Vec h = layernorm(x[t], P.at("lnf.weight"), P.at("lnf.bias"), eps);
      Vec logits(V);
      double m = -1e300;
      for (int v = 0; v < V; ++v) {
        double s = 0;
        for (int c = 0; c < C; ++c) s += wte[v * C + c] * h[c];
        logits[v] = s;
        m = std::max(m, s);
      }
      double z = 0;
      for (int v = 0; v < V; ++v) z += std::exp(logits[v] - m);
      total += std::log(z) + m - logits[target];
      ++count;
    }
  }
  return total / count;
}

}  // namespace tessera::testing
