// moe.cpp: the MoE router and token permutation on the host (see moe.hpp).
#include "backend/cpu/moe.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"

namespace tessera {

namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// softmax of z[0..E) into p; returns logsumexp(z).
double softmax(const float* z, int E, double* p) {
  double m = z[0];
  for (int e = 1; e < E; ++e) m = std::max(m, double(z[e]));
  double s = 0;
  for (int e = 0; e < E; ++e) s += (p[e] = std::exp(double(z[e]) - m));
  for (int e = 0; e < E; ++e) p[e] /= s;
  return m + std::log(s);
}

// The load-balancing score of each expert (softmax, or the sigmoid normalized over all experts).
void scores_of(const float* z, const MoERouting& r, double* S) {
  if (!r.sigmoid) {
    softmax(z, r.experts, S);
    return;
  }
  double sum = 0;
  for (int e = 0; e < r.experts; ++e) sum += (S[e] = sigmoid(z[e]));
  for (int e = 0; e < r.experts; ++e) S[e] /= sum + 1e-20;
}

// The k chosen experts of a token by choice score (moe_choice_score), best first (ties: the lower
// expert), within the best groups under group-limited routing.
void choose_keyed(const float* z, const MoERouting& r, std::vector<double>& p,
                  std::vector<float>& key, std::vector<int>& order, int32_t* ex) {
  const int E = r.experts, K = r.topk;
  if (r.pre_softmax) softmax(z, E, p.data());
  for (int e = 0; e < E; ++e)
    key[static_cast<size_t>(e)] =
        moe_choice_score(z[e], static_cast<float>(p[static_cast<size_t>(e)]), e, r);
  auto better = [&](int a, int b) {
    return key[static_cast<size_t>(a)] > key[static_cast<size_t>(b)] ||
           (key[static_cast<size_t>(a)] == key[static_cast<size_t>(b)] && a < b);
  };
  if (r.groups > 0) {
    const int G = r.groups, per = E / G;
    std::vector<float> gscore(static_cast<size_t>(G));
    for (int g = 0; g < G; ++g) {  // the sum of the group's best group_score keys, best first
      std::vector<int> m(static_cast<size_t>(per));
      std::iota(m.begin(), m.end(), g * per);
      std::partial_sort(m.begin(), m.begin() + r.group_score, m.end(), better);
      float sum = 0.f;
      for (int j = 0; j < r.group_score; ++j)
        sum += key[static_cast<size_t>(m[static_cast<size_t>(j)])];
      gscore[static_cast<size_t>(g)] = sum;
    }
    std::vector<int> gorder(static_cast<size_t>(G));
    std::iota(gorder.begin(), gorder.end(), 0);
    std::partial_sort(
        gorder.begin(), gorder.begin() + r.group_topk, gorder.end(), [&](int a, int b) {
          return gscore[static_cast<size_t>(a)] > gscore[static_cast<size_t>(b)] ||
                 (gscore[static_cast<size_t>(a)] == gscore[static_cast<size_t>(b)] && a < b);
        });
    std::vector<bool> keep(static_cast<size_t>(G), false);
    for (int j = 0; j < r.group_topk; ++j)
      keep[static_cast<size_t>(gorder[static_cast<size_t>(j)])] = true;
    for (int e = 0; e < E; ++e)
      if (!keep[static_cast<size_t>(e / per)]) key[static_cast<size_t>(e)] = -INFINITY;
  }
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + K, order.end(), better);
  for (int k = 0; k < K; ++k) ex[k] = order[static_cast<size_t>(k)];
}

}  // namespace

float moe_choice_score(float z, float p, int e, const MoERouting& r) {
  if (r.sigmoid) {
    const float s = 1.f / (1.f + std::exp(-z));
    return r.expert_bias.empty() ? s : s + r.expert_bias[static_cast<size_t>(e)];
  }
  return r.pre_softmax ? p : z;
}

int64_t moe_route_host(const float* logits, int64_t N, const MoERouting& r, int64_t group_rows,
                       int32_t* expert, float* weight, int32_t* row, std::vector<int64_t>& routed,
                       std::vector<int64_t>& kept) {
  const int E = r.experts, K = r.topk;
  TESSERA_CHECK(E >= 1 && K >= 1 && K <= E && group_rows >= 1 && N % group_rows == 0,
                "moe_route: ", K, " of ", E, " experts, ", N, " rows in groups of ", group_rows);
  TESSERA_CHECK(r.expert_bias.empty() || static_cast<int>(r.expert_bias.size()) == E,
                "moe_route: ", r.expert_bias.size(), " expert biases for ", E, " experts");
  const double f = r.scaling > 0 ? r.scaling : 1.0;
#pragma omp parallel
  {
    std::vector<int> order(static_cast<size_t>(E));
    std::vector<double> p(static_cast<size_t>(E));
    std::vector<float> key(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* z = logits + n * E;
      int32_t* ex = expert + n * K;
      float* w = weight + n * K;
      if (r.keyed()) {
        choose_keyed(z, r, p, key, order, ex);
      } else {
        std::iota(order.begin(), order.end(), 0);
        // Every score function ranks as the logits do; ties go to the lower expert.
        std::partial_sort(order.begin(), order.begin() + K, order.end(),
                          [&](int a, int b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
        for (int k = 0; k < K; ++k) ex[k] = order[static_cast<size_t>(k)];
      }
      if (r.sigmoid) {
        double sum = 0;
        for (int k = 0; k < K; ++k) sum += (p[static_cast<size_t>(k)] = sigmoid(z[ex[k]]));
        for (int k = 0; k < K; ++k)
          w[k] = static_cast<float>(
              f * (K > 1 ? p[static_cast<size_t>(k)] / (sum + 1e-20) : p[static_cast<size_t>(k)]));
      } else if (r.pre_softmax) {
        softmax(z, E, p.data());
        for (int k = 0; k < K; ++k) w[k] = static_cast<float>(f * p[static_cast<size_t>(ex[k])]);
      } else {  // softmax over the k chosen logits (the top-k of the softmax, renormalized)
        const double m = z[ex[0]];
        double sum = 0;
        for (int k = 0; k < K; ++k) sum += (p[static_cast<size_t>(k)] = std::exp(z[ex[k]] - m));
        for (int k = 0; k < K; ++k) w[k] = static_cast<float>(f * p[static_cast<size_t>(k)] / sum);
      }
    }
  }
  return moe_assign_rows_host(expert, weight, N, r, group_rows, row, routed, kept);
}

int64_t moe_assign_rows_host(int32_t* expert, const float* weight, int64_t N, const MoERouting& r,
                             int64_t group_rows, int32_t* row, std::vector<int64_t>& routed,
                             std::vector<int64_t>& kept) {
  const int E = r.experts, K = r.topk;
  TESSERA_CHECK(group_rows >= 1 && N % group_rows == 0, "moe_route: ", N, " rows in groups of ",
                group_rows);
  routed.assign(static_cast<size_t>(N / group_rows * E), 0);
  for (int64_t n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const int32_t e = expert[n * K + k];
      TESSERA_CHECK(e >= 0 && e < E, "moe_route: token ", n, " slot ", k, " names expert ", e,
                    " of ", E);
      ++routed[static_cast<size_t>((n / group_rows) * E + e)];
    }
  // Token dropping: per expert, the slots over capacity (Megatron's get_capacity of N*K copies).
  if (r.capacity_factor > 0) {
    const int64_t capacity = static_cast<int64_t>(std::ceil(double(N) * K / E * r.capacity_factor));
    if (capacity <= N) {
      std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E));  // n*K + k, token order
      for (int64_t i = 0; i < N * K; ++i) slots[static_cast<size_t>(expert[i])].push_back(i);
      for (auto& s : slots) {
        if (static_cast<int64_t>(s.size()) <= capacity) continue;
        if (!r.drop_by_position)  // keep the highest weights; ties: the earlier token
          std::stable_sort(s.begin(), s.end(),
                           [&](int64_t a, int64_t b) { return weight[a] > weight[b]; });
        for (size_t j = static_cast<size_t>(capacity); j < s.size(); ++j)
          expert[s[j]] = -1 - expert[s[j]];
      }
    }
  }
  // Rows: expert by expert, tokens in order within an expert.
  kept.assign(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < N * K; ++i)
    if (expert[i] >= 0) ++kept[static_cast<size_t>(expert[i])];
  std::vector<int64_t> next(static_cast<size_t>(E), 0);
  int64_t R = 0;
  for (int e = 0; e < E; ++e) {
    next[static_cast<size_t>(e)] = R;
    R += kept[static_cast<size_t>(e)];
  }
  for (int64_t i = 0; i < N * K; ++i)
    row[i] = expert[i] >= 0 ? static_cast<int32_t>(next[static_cast<size_t>(expert[i])]++) : -1;
  return R;
}

void moe_router_stats_host(const float* logits, int64_t N, const MoERouting& r, int64_t group_rows,
                           std::vector<double>& score_sums, double& lse_sq_sum) {
  const int E = r.experts;
  const int64_t groups = N / group_rows;
  score_sums.assign(static_cast<size_t>(groups * E), 0.0);
  lse_sq_sum = 0;
  std::vector<double> S(static_cast<size_t>(E)), p(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {  // in order: the same sums on every rank and backend
    const float* z = logits + n * E;
    scores_of(z, r, S.data());
    double* sums = score_sums.data() + (n / group_rows) * E;
    for (int e = 0; e < E; ++e) sums[e] += S[static_cast<size_t>(e)];
    const double lse = softmax(z, E, p.data());
    lse_sq_sum += lse * lse;
  }
}

void moe_router_backward_host(float* dlogits, const float* logits, int64_t N, const MoERouting& r,
                              const int32_t* expert, const float* weight, const float* dweight,
                              int64_t group_rows, const std::vector<double>& aux_grad,
                              double z_grad) {
  const int E = r.experts, K = r.topk;
  const double f = r.scaling > 0 ? r.scaling : 1.0;
  const bool aux = !aux_grad.empty();
#pragma omp parallel
  {
    std::vector<double> dz(static_cast<size_t>(E)), p(static_cast<size_t>(E)),
        S(static_cast<size_t>(E)), dw(static_cast<size_t>(K)), u(static_cast<size_t>(K));
    std::vector<int> ex(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* z = logits + n * E;
      std::fill(dz.begin(), dz.end(), 0.0);
      // Through the routing weights: dw of the unscaled weights u; dropped slots carry none.
      for (int k = 0; k < K; ++k) {
        const int32_t e = expert[n * K + k];
        ex[static_cast<size_t>(k)] = e >= 0 ? e : -1 - e;
        dw[static_cast<size_t>(k)] = e >= 0 ? f * dweight[n * K + k] : 0.0;
        u[static_cast<size_t>(k)] = weight[n * K + k] / f;
      }
      if (r.sigmoid) {
        double sum = 0, dot = 0;
        for (int k = 0; k < K; ++k) sum += sigmoid(z[ex[static_cast<size_t>(k)]]);
        for (int k = 0; k < K; ++k) dot += dw[static_cast<size_t>(k)] * u[static_cast<size_t>(k)];
        for (int k = 0; k < K; ++k) {
          const double s = sigmoid(z[ex[static_cast<size_t>(k)]]);
          const double ds = K > 1 ? (dw[static_cast<size_t>(k)] - dot) / (sum + 1e-20)
                                  : dw[static_cast<size_t>(k)];
          dz[static_cast<size_t>(ex[static_cast<size_t>(k)])] += ds * s * (1 - s);
        }
      } else if (r.pre_softmax) {  // u = softmax(z) at the chosen experts
        softmax(z, E, p.data());
        double dot = 0;
        for (int k = 0; k < K; ++k)
          dot += dw[static_cast<size_t>(k)] * p[static_cast<size_t>(ex[static_cast<size_t>(k)])];
        for (int e = 0; e < E; ++e) dz[static_cast<size_t>(e)] -= p[static_cast<size_t>(e)] * dot;
        for (int k = 0; k < K; ++k) {
          const size_t e = static_cast<size_t>(ex[static_cast<size_t>(k)]);
          dz[e] += p[e] * dw[static_cast<size_t>(k)];
        }
      } else {  // u = softmax over the chosen logits
        double dot = 0;
        for (int k = 0; k < K; ++k) dot += dw[static_cast<size_t>(k)] * u[static_cast<size_t>(k)];
        for (int k = 0; k < K; ++k)
          dz[static_cast<size_t>(ex[static_cast<size_t>(k)])] +=
              u[static_cast<size_t>(k)] * (dw[static_cast<size_t>(k)] - dot);
      }
      if (aux) {  // d loss / d score(n, e) = aux_grad of n's group
        const double* g = aux_grad.data() + (n / group_rows) * E;
        scores_of(z, r, S.data());
        double dot = 0;
        for (int e = 0; e < E; ++e) dot += g[e] * S[static_cast<size_t>(e)];
        if (!r.sigmoid) {
          for (int e = 0; e < E; ++e)
            dz[static_cast<size_t>(e)] += S[static_cast<size_t>(e)] * (g[e] - dot);
        } else {
          double sum = 0;
          for (int e = 0; e < E; ++e) sum += sigmoid(z[e]);
          for (int e = 0; e < E; ++e) {
            const double s = sigmoid(z[e]);
            dz[static_cast<size_t>(e)] += (g[e] - dot) / (sum + 1e-20) * s * (1 - s);
          }
        }
      }
      if (z_grad != 0) {  // d (lse^2) = 2 lse softmax(z)
        const double lse = softmax(z, E, p.data());
        for (int e = 0; e < E; ++e)
          dz[static_cast<size_t>(e)] += z_grad * 2 * lse * p[static_cast<size_t>(e)];
      }
      for (int e = 0; e < E; ++e)
        dlogits[n * E + e] = static_cast<float>(dz[static_cast<size_t>(e)]);
    }
  }
}

void moe_permute_host(float* x_perm, const float* x, const int32_t* row, int64_t N, int K,
                      int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k)
      if (const int32_t r = row[n * K + k]; r >= 0)
        std::copy(x + n * C, x + (n + 1) * C, x_perm + int64_t(r) * C);
}

void moe_unpermute_host(float* y, const float* out, const int32_t* row, const float* weight,
                        int64_t N, int K, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* yn = y + n * C;
    std::fill(yn, yn + C, 0.f);
    for (int k = 0; k < K; ++k) {
      const int32_t r = row[n * K + k];
      if (r < 0) continue;
      const float w = weight[n * K + k];
      const float* o = out + int64_t(r) * C;
      for (int64_t c = 0; c < C; ++c) yn[c] += w * o[c];
    }
  }
}

void moe_unpermute_backward_host(float* dout, float* dweight, const float* dy, const float* out,
                                 const int32_t* row, const float* weight, int64_t N, int K,
                                 int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = dy + n * C;
    for (int k = 0; k < K; ++k) {
      const int32_t r = row[n * K + k];
      if (r < 0) {
        dweight[n * K + k] = 0.f;
        continue;
      }
      const float w = weight[n * K + k];
      const float* o = out + int64_t(r) * C;
      float* d = dout + int64_t(r) * C;
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        d[c] = w * g[c];
        dot += double(g[c]) * o[c];
      }
      dweight[n * K + k] = static_cast<float>(dot);
    }
  }
}

void moe_permute_backward_host(float* dx, const float* dx_perm, const int32_t* row, int64_t N,
                               int K, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* d = dx + n * C;
    std::fill(d, d + C, 0.f);
    for (int k = 0; k < K; ++k)
      if (const int32_t r = row[n * K + k]; r >= 0) {
        const float* s = dx_perm + int64_t(r) * C;
        for (int64_t c = 0; c < C; ++c) d[c] += s[c];
      }
  }
}

}  // namespace tessera
