// moe.cuh: the Mixture-of-Experts kernels of the CUDA backend, as bodies that nvcc and the host
// warp emulator both compile (tests/backend/test_moe_emu.cpp runs this source against the host
// reference, backend/cpu/moe.hpp, whose semantics they follow):
//  - router_topk: one warp per token picks its k experts (ties: the lower expert) and their
//    routing weights (softmax over the k chosen, softmax over all then top-k, or sigmoid); with
//    the aux-loss-free expert bias or group-limited routing, by the choice scores
//    (choice_scores: sigmoid + bias; only the best groups' experts);
//  - router_backward: one warp per token, the gradient of the routing weights, the load-balancing
//    term and the z-loss term into d logits;
//  - router_scores: one warp per token, the load-balancing scores (softmax, or the sigmoid
//    normalized over all experts) and logsumexp^2, per token (summed in token order on the host);
//  - permute / unpermute and their backwards: one warp per token or slot, rows of C elements moved
//    16 bytes per lane where C allows.
// Launch: block kThreads (8 warps), grid ceil(items / 8). Experts per token at most kMaxExperts.
#pragma once

#include <cmath>
#include <cstdint>

#include "backend/cpu/moe.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::moe_kernels {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kThreads == rowwise::kThreads, "the launchers size grids with rowwise::warp_blocks");
constexpr int kMaxExperts = 256;            // E (lanes hold E / 32 logits each)
constexpr int kPerLane = kMaxExperts / 32;  // logits per lane, at most

constexpr int kMaxGroups = 32;  // group-limited routing: one lane per group

struct Route {
  int E = 0, K = 0;
  bool sigmoid = false, pre_softmax = false;
  float scaling = 1.f;  // 1 when unscaled
  // Group-limited routing (groups > 0, at most kMaxGroups) and the aux-loss-free expert bias (E
  // floats in the kernel's memory; null: none), as MoERouting has them.
  int groups = 0, group_topk = 0, group_score = 0;
  const float* bias = nullptr;
};
// The kernels' view of the routing options (the limits are the launcher's to check; the bias
// pointer is the launcher's to set).
inline Route make_route(const MoERouting& r) {
  Route m;
  m.E = r.experts;
  m.K = r.topk;
  m.sigmoid = r.sigmoid;
  m.pre_softmax = r.pre_softmax;
  m.scaling = r.scaling > 0 ? static_cast<float>(r.scaling) : 1.f;
  m.groups = r.groups;
  m.group_topk = r.group_topk;
  m.group_score = r.group_score;
  return m;
}

TC_DEV float sigmoidf(float x) {
  return 1.f / (1.f + expf(-x));
}
TC_DEV float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, tc::shfl_xor(v, o));
  return v;
}
using rowwise::warp_sum;

// The warp and lane of this thread, and its item (token or slot); false when past the end.
TC_DEV bool warp_item(int64_t items, int64_t* item, int* lane) {
  *lane = tc::thread_id() % 32;
  *item = static_cast<int64_t>(tc::block_x()) * kWarps + tc::thread_id() / 32;
  return *item < items;
}

// Loads token n's E logits: lane l holds z[l], z[l + 32], ... (-inf past E).
TC_DEV void load_logits(float (&z)[kPerLane], const float* logits, int64_t n, int E, int lane) {
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    z[i] = e < E ? logits[n * E + e] : -INFINITY;
  }
}
// softmax of the token's logits into p (lanes as z); returns logsumexp.
TC_DEV float softmax_lanes(const float (&z)[kPerLane], float (&p)[kPerLane], int E, int lane) {
  float m = -INFINITY;
  for (int i = 0; i < kPerLane; ++i) m = fmaxf(m, z[i]);
  m = warp_max(m);
  float s = 0.f;
  for (int i = 0; i < kPerLane; ++i) {
    p[i] = lane + 32 * i < E ? expf(z[i] - m) : 0.f;
    s += p[i];
  }
  s = warp_sum(s);
  for (int i = 0; i < kPerLane; ++i) p[i] /= s;
  return m + logf(s);
}
// The load-balancing scores S (lanes as z): softmax, or the sigmoid normalized over all experts.
TC_DEV void scores_lanes(const float (&z)[kPerLane], float (&S)[kPerLane], const Route& r,
                         int lane) {
  if (!r.sigmoid) {
    softmax_lanes(z, S, r.E, lane);
    return;
  }
  float s = 0.f;
  for (int i = 0; i < kPerLane; ++i) {
    S[i] = lane + 32 * i < r.E ? sigmoidf(z[i]) : 0.f;
    s += S[i];
  }
  s = warp_sum(s) + 1e-20f;
  for (int i = 0; i < kPerLane; ++i) S[i] /= s;
}
// The value of expert e held by some lane, broadcast to the warp.
TC_DEV float lane_value(const float (&v)[kPerLane], int e, int lane) {
  float mine = 0.f;
  for (int i = 0; i < kPerLane; ++i)
    if (lane + 32 * i == e) mine = v[i];
  return warp_sum(mine);  // one lane holds it, the others add 0
}

// The warp's best of the values v[i] at experts lane + 32 i where ok(i): the largest, ties to the
// lower expert (be = 1 << 30 when none).
template <typename Ok>
TC_DEV void warp_best(const float (&v)[kPerLane], Ok ok, int E, int lane, float* bv_out,
                      int* be_out) {
  float bv = -INFINITY;
  int be = 1 << 30;
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < E && ok(i) && (v[i] > bv || be == 1 << 30)) {
      bv = v[i];
      be = e;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = tc::shfl_xor(bv, o);
    const int oe = static_cast<int>(tc::shfl_xor(static_cast<float>(be), o));
    if (ov > bv || (ov == bv && oe < be)) {
      bv = ov;
      be = oe;
    }
  }
  *bv_out = bv;
  *be_out = be;
}

// The choice scores of a token (moe_choice_score) and, with groups, -inf for the experts outside
// the group_topk best groups (a group's score: the sum of its group_score best choice scores;
// ties to the lower group). Lanes as z.
TC_DEV void choice_scores(float (&key)[kPerLane], const float (&z)[kPerLane], const Route& r,
                          int lane) {
  float p[kPerLane];
  if (r.pre_softmax) softmax_lanes(z, p, r.E, lane);
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    key[i] = r.sigmoid       ? sigmoidf(z[i]) + (r.bias && e < r.E ? r.bias[e] : 0.f)
             : r.pre_softmax ? p[i]
                             : z[i];
  }
  if (r.groups <= 0) return;
  const int per = r.E / r.groups;
  float mine = -INFINITY;  // lane g holds group g's score
  for (int g = 0; g < r.groups; ++g) {
    bool taken[kPerLane];
    for (int i = 0; i < kPerLane; ++i) taken[i] = false;
    float sum = 0.f;
    for (int j = 0; j < r.group_score; ++j) {
      float bv;
      int be;
      warp_best(
          key, [&](int i) { return !taken[i] && (lane + 32 * i) / per == g; }, r.E, lane, &bv, &be);
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i == be) taken[i] = true;
      sum += bv;
    }
    if (lane == g) mine = sum;
  }
  // The best groups: group_topk rounds of the warp's best lane; the kept ones as two 16-bit masks
  // (sums of distinct powers of two, exact in f32).
  bool kept = false;
  for (int j = 0; j < r.group_topk; ++j) {
    float bv = lane < r.groups && !kept ? mine : -INFINITY;
    int bg = lane < r.groups && !kept ? lane : 1 << 30;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = tc::shfl_xor(bv, o);
      const int og = static_cast<int>(tc::shfl_xor(static_cast<float>(bg), o));
      if (ov > bv || (ov == bv && og < bg)) {
        bv = ov;
        bg = og;
      }
    }
    if (lane == bg) kept = true;
  }
  const float lo = warp_sum(kept && lane < 16 ? static_cast<float>(1 << lane) : 0.f);
  const float hi = warp_sum(kept && lane >= 16 ? static_cast<float>(1 << (lane - 16)) : 0.f);
  const uint32_t mask = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  for (int i = 0; i < kPerLane; ++i) {  // past E no expert: warp_best never picks it
    const int e = lane + 32 * i;
    if (e < r.E && !(mask >> (e / per) & 1u)) key[i] = -INFINITY;
  }
}

// expert (N,K) int32 and weight (N,K) f32: each token's top k, best first.
TC_DEV void router_topk(int32_t* expert, float* weight, const float* logits, int64_t N,
                        const Route& r) {
  int64_t n;
  int lane;
  if (!warp_item(N, &n, &lane)) return;
  float z[kPerLane];
  load_logits(z, logits, n, r.E, lane);
  bool taken[kPerLane];
  for (int i = 0; i < kPerLane; ++i) taken[i] = false;
  int ex[kMaxExperts < 64 ? kMaxExperts : 64];  // lane 0's copy of the chosen experts (K <= 64)
  float zk[kMaxExperts < 64 ? kMaxExperts : 64];
  // The choice: the largest logits (every score function ranks as they do), or with the expert
  // bias or groups the choice scores; ties to the lower expert. The weights below read the
  // chosen experts' logits.
  float key[kPerLane];
  const bool keyed = r.groups > 0 || r.bias;
  if (keyed) choice_scores(key, z, r, lane);
  for (int k = 0; k < r.K; ++k) {
    float bv;
    int be;
    warp_best(
        keyed ? key : z, [&](int i) { return !taken[i]; }, r.E, lane, &bv, &be);
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i == be) taken[i] = true;
    ex[k] = be;
    zk[k] = keyed ? lane_value(z, be, lane) : bv;
  }
  float p[kPerLane];
  if (r.pre_softmax) softmax_lanes(z, p, r.E, lane);
  float pk[kMaxExperts < 64 ? kMaxExperts : 64];
  if (r.pre_softmax)
    for (int k = 0; k < r.K; ++k) pk[k] = lane_value(p, ex[k], lane);
  if (lane != 0) return;
  int32_t* eo = expert + n * r.K;
  float* wo = weight + n * r.K;
  if (r.sigmoid) {
    float sum = 0.f;
    for (int k = 0; k < r.K; ++k) sum += sigmoidf(zk[k]);
    for (int k = 0; k < r.K; ++k)
      wo[k] = r.scaling * (r.K > 1 ? sigmoidf(zk[k]) / (sum + 1e-20f) : sigmoidf(zk[k]));
  } else if (r.pre_softmax) {
    for (int k = 0; k < r.K; ++k) wo[k] = r.scaling * pk[k];
  } else {
    float sum = 0.f;
    for (int k = 0; k < r.K; ++k) sum += expf(zk[k] - zk[0]);
    for (int k = 0; k < r.K; ++k) wo[k] = r.scaling * expf(zk[k] - zk[0]) / sum;
  }
  for (int k = 0; k < r.K; ++k) eo[k] = ex[k];
}

// scores (N,E): each token's load-balancing scores; lse_sq (N): logsumexp(logits)^2.
TC_DEV void router_scores(float* scores, float* lse_sq, const float* logits, int64_t N,
                          const Route& r) {
  int64_t n;
  int lane;
  if (!warp_item(N, &n, &lane)) return;
  float z[kPerLane], S[kPerLane], p[kPerLane];
  load_logits(z, logits, n, r.E, lane);
  scores_lanes(z, S, r, lane);
  const float lse = softmax_lanes(z, p, r.E, lane);
  for (int i = 0; i < kPerLane; ++i)
    if (lane + 32 * i < r.E) scores[n * r.E + lane + 32 * i] = S[i];
  if (lane == 0) lse_sq[n] = lse * lse;
}

// dlogits (N,E) = the router's gradient (moe_router_backward_host): through the routing weights
// (dweight; dropped slots, expert < 0, carry none), plus aux_grad[group of n][e] through the
// scores (aux_grad may be null), plus z_grad * d lse^2.
TC_DEV void router_backward(float* dlogits, const float* logits, const int32_t* expert,
                            const float* weight, const float* dweight, const float* aux_grad,
                            float z_grad, int64_t N, int64_t group_rows, const Route& r) {
  int64_t n;
  int lane;
  if (!warp_item(N, &n, &lane)) return;
  const int E = r.E, K = r.K;
  const float f = r.scaling;
  float z[kPerLane], dz[kPerLane], p[kPerLane];
  load_logits(z, logits, n, E, lane);
  for (int i = 0; i < kPerLane; ++i) dz[i] = 0.f;
  // Every lane walks the k slots (K is small); the lane holding the slot's expert adds to it.
  auto add_at = [&](int e, float v) {
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i == e) dz[i] += v;
  };
  auto slot = [&](int k, int* e, float* dw, float* u) {
    const int32_t x = expert[n * K + k];
    *e = x >= 0 ? x : -1 - x;
    *dw = x >= 0 ? f * dweight[n * K + k] : 0.f;
    *u = weight[n * K + k] / f;
  };
  if (r.sigmoid) {
    float sum = 0.f, dot = 0.f;
    for (int k = 0; k < K; ++k) {
      int e;
      float dw, u;
      slot(k, &e, &dw, &u);
      sum += sigmoidf(lane_value(z, e, lane));
      dot += dw * u;
    }
    for (int k = 0; k < K; ++k) {
      int e;
      float dw, u;
      slot(k, &e, &dw, &u);
      const float s = sigmoidf(lane_value(z, e, lane));
      const float ds = K > 1 ? (dw - dot) / (sum + 1e-20f) : dw;
      add_at(e, ds * s * (1 - s));
    }
  } else if (r.pre_softmax) {
    softmax_lanes(z, p, E, lane);
    float dot = 0.f;
    for (int k = 0; k < K; ++k) {
      int e;
      float dw, u;
      slot(k, &e, &dw, &u);
      dot += dw * lane_value(p, e, lane);
    }
    for (int i = 0; i < kPerLane; ++i) dz[i] -= p[i] * dot;
    for (int k = 0; k < K; ++k) {
      int e;
      float dw, u;
      slot(k, &e, &dw, &u);
      add_at(e, lane_value(p, e, lane) * dw);
    }
  } else {
    float dot = 0.f;
    for (int k = 0; k < K; ++k) {
      int e;
      float dw, u;
      slot(k, &e, &dw, &u);
      dot += dw * u;
    }
    for (int k = 0; k < K; ++k) {
      int e;
      float dw, u;
      slot(k, &e, &dw, &u);
      add_at(e, u * (dw - dot));
    }
  }
  if (aux_grad) {
    const float* g = aux_grad + (n / group_rows) * E;
    float S[kPerLane];
    scores_lanes(z, S, r, lane);
    float dot = 0.f;
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i < E) dot += g[lane + 32 * i] * S[i];
    dot = warp_sum(dot);
    if (!r.sigmoid) {
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < E) dz[i] += S[i] * (g[lane + 32 * i] - dot);
    } else {
      float sum = 0.f;
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < E) sum += sigmoidf(z[i]);
      sum = warp_sum(sum) + 1e-20f;
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < E) {
          const float s = sigmoidf(z[i]);
          dz[i] += (g[lane + 32 * i] - dot) / sum * s * (1 - s);
        }
    }
  }
  if (z_grad != 0.f) {
    const float lse = softmax_lanes(z, p, E, lane);
    for (int i = 0; i < kPerLane; ++i) dz[i] += z_grad * 2 * lse * p[i];
  }
  for (int i = 0; i < kPerLane; ++i)
    if (lane + 32 * i < E) dlogits[n * E + lane + 32 * i] = dz[i];
}

// ---- permutation: rows of C elements of T -------------------------------------------------------

// dst[row] = (or +=) scale * src row, lanes over the row's elements, 16 bytes per lane per step
// when vec.
template <typename T>
TC_DEV void row_axpy(T* dst, const T* src, float scale, bool accumulate, int64_t C, bool vec,
                     int lane) {
  using rowwise::from_f32;
  using rowwise::to_f32;
  if (vec) {
    constexpr int V = rowwise::kVec<T>;
    for (int64_t v = lane; v < C / V; v += 32) {
      const rowwise::Pack<T> s = rowwise::load16(src + v * V);
      rowwise::Pack<T> d;
      if (accumulate) d = rowwise::load16(dst + v * V);
      TC_UNROLL
      for (int e = 0; e < V; ++e)
        d.e[e] = from_f32<T>((accumulate ? to_f32(d.e[e]) : 0.f) + scale * to_f32(s.e[e]));
      rowwise::store16(dst + v * V, d);
    }
    return;
  }
  for (int64_t c = lane; c < C; c += 32)
    dst[c] = from_f32<T>((accumulate ? to_f32(dst[c]) : 0.f) + scale * to_f32(src[c]));
}

// x_perm[row[s]] = x[s / K] for every kept slot s (one warp per slot).
template <typename T>
TC_DEV void permute(T* x_perm, const T* x, const int32_t* row, int64_t N, int K, int64_t C,
                    bool vec) {
  int64_t s;
  int lane;
  if (!warp_item(N * K, &s, &lane)) return;
  const int32_t r = row[s];
  if (r < 0) return;
  const T* src = x + (s / K) * C;
  T* dst = x_perm + static_cast<int64_t>(r) * C;
  if (vec) {
    constexpr int V = rowwise::kVec<T>;
    for (int64_t v = lane; v < C / V; v += 32)
      rowwise::store16(dst + v * V, rowwise::load16(src + v * V));
    return;
  }
  for (int64_t c = lane; c < C; c += 32) dst[c] = src[c];
}

// y[n] = sum over n's kept slots, in slot order, of weight * out[row] (one warp per token; f32
// sums, rounded once). With accumulate_rows (the permute's backward): weight 1.
template <typename T>
TC_DEV void gather_rows(T* y, const T* out, const int32_t* row, const float* weight, int64_t N,
                        int K, int64_t C, bool vec) {
  int64_t n;
  int lane;
  if (!warp_item(N, &n, &lane)) return;
  using rowwise::from_f32;
  using rowwise::to_f32;
  T* yn = y + n * C;
  if (vec) {
    constexpr int V = rowwise::kVec<T>;
    for (int64_t v = lane; v < C / V; v += 32) {
      float acc[V];
      for (int e = 0; e < V; ++e) acc[e] = 0.f;
      for (int k = 0; k < K; ++k) {
        const int32_t r = row[n * K + k];
        if (r < 0) continue;
        const float w = weight ? weight[n * K + k] : 1.f;
        const rowwise::Pack<T> o = rowwise::load16(out + static_cast<int64_t>(r) * C + v * V);
        TC_UNROLL
        for (int e = 0; e < V; ++e) acc[e] += w * to_f32(o.e[e]);
      }
      rowwise::Pack<T> d;
      TC_UNROLL
      for (int e = 0; e < V; ++e) d.e[e] = from_f32<T>(acc[e]);
      rowwise::store16(yn + v * V, d);
    }
    return;
  }
  for (int64_t c = lane; c < C; c += 32) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) {
      const int32_t r = row[n * K + k];
      if (r < 0) continue;
      acc += (weight ? weight[n * K + k] : 1.f) * to_f32(out[static_cast<int64_t>(r) * C + c]);
    }
    yn[c] = from_f32<T>(acc);
  }
}

// The unpermute's backward, one warp per slot s = (n, k): dout[row] = weight * dy[n];
// dweight[s] = <dy[n], out[row]> (0 for a dropped slot).
template <typename T>
TC_DEV void unpermute_backward(T* dout, float* dweight, const T* dy, const T* out,
                               const int32_t* row, const float* weight, int64_t N, int K, int64_t C,
                               bool vec) {
  int64_t s;
  int lane;
  if (!warp_item(N * K, &s, &lane)) return;
  using rowwise::to_f32;
  const int32_t r = row[s];
  if (r < 0) {
    if (lane == 0) dweight[s] = 0.f;
    return;
  }
  const T* g = dy + (s / K) * C;
  const T* o = out + static_cast<int64_t>(r) * C;
  row_axpy(dout + static_cast<int64_t>(r) * C, g, weight[s], false, C, vec, lane);
  float dot = 0.f;
  if (vec) {
    constexpr int V = rowwise::kVec<T>;
    for (int64_t v = lane; v < C / V; v += 32) {
      const rowwise::Pack<T> a = rowwise::load16(g + v * V), b = rowwise::load16(o + v * V);
      TC_UNROLL
      for (int e = 0; e < V; ++e) dot += to_f32(a.e[e]) * to_f32(b.e[e]);
    }
  } else {
    for (int64_t c = lane; c < C; c += 32) dot += to_f32(g[c]) * to_f32(o[c]);
  }
  dot = warp_sum(dot);
  if (lane == 0) dweight[s] = dot;
}

}  // namespace tessera::moe_kernels
