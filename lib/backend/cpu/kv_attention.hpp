// kv_attention.hpp: causal attention for generation with a KV cache. New tokens of several
// sequences (segments of rows) append their keys and values to the cache at their positions, and
// each new query attends to every cached position of its sequence up to its own.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/alibi.hpp"

namespace tessera::cpu {

// A run of `count` consecutive new tokens of the sequence in cache slot `slot`, at positions
// [pos0, pos0 + count), stored in rows [row0, row0 + count) of qkv and out.
struct KvSegment {
  int64_t slot = 0, pos0 = 0, count = 0, row0 = 0;
};

// qkv (N, (H+2G)*hd): H query heads, then G key and G value heads (G = NKV, 0 meaning H); out
// (N, H*hd); caches (slots, G, Tmax, hd). Query head h reads key/value head h / (H/G). With
// `alibi`, slope_h * (j - i) is added to the score of cached position j for the query at i.
template <typename T>
void kv_attention(T* out, const T* qkv, T* k_cache, T* v_cache, const std::vector<KvSegment>& segs,
                  int64_t H, int64_t hd, int64_t Tmax, int64_t NKV = 0,
                  const AttentionAlibi* alibi = nullptr) {
  const int64_t G = NKV > 0 ? NKV : H, C = H * hd, C3 = (H + 2 * G) * hd;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int64_t segments = static_cast<int64_t>(segs.size());
  // The new keys and values into the caches first (each (segment, group) once), then the queries.
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < segments * G; ++job) {
    const KvSegment& s = segs[job / G];
    const int64_t g = job % G;
    T* kc = k_cache + ((s.slot * G + g) * Tmax) * hd;
    T* vc = v_cache + ((s.slot * G + g) * Tmax) * hd;
    for (int64_t t = 0; t < s.count; ++t) {
      const T* row = qkv + (s.row0 + t) * C3 + C + g * hd;
      for (int64_t d = 0; d < hd; ++d) {
        kc[(s.pos0 + t) * hd + d] = row[d];
        vc[(s.pos0 + t) * hd + d] = row[G * hd + d];
      }
    }
  }
  const int64_t jobs = segments * H;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t job = 0; job < jobs; ++job) {
    const KvSegment& s = segs[job / H];
    const int64_t h = job % H, g = h / (H / G);
    const T* kc = k_cache + ((s.slot * G + g) * Tmax) * hd;
    const T* vc = v_cache + ((s.slot * G + g) * Tmax) * hd;
    std::vector<T> p(static_cast<size_t>(s.pos0 + s.count));
    for (int64_t t = 0; t < s.count; ++t) {
      const T* q = qkv + (s.row0 + t) * C3 + h * hd;
      const int64_t last = s.pos0 + t;
      T m = -INFINITY;
      for (int64_t j = 0; j <= last; ++j) {
        T dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot += q[d] * kc[j * hd + d];
        p[j] = dot * scale + (alibi ? static_cast<T>(alibi->bias(h, last, j)) : T(0));
        m = p[j] > m ? p[j] : m;
      }
      T sum = 0;
      for (int64_t j = 0; j <= last; ++j) {
        p[j] = std::exp(p[j] - m);
        sum += p[j];
      }
      T* o = out + (s.row0 + t) * C + h * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = 0;
      for (int64_t j = 0; j <= last; ++j) {
        const T w = p[j] / sum;
        for (int64_t d = 0; d < hd; ++d) o[d] += w * vc[j * hd + d];
      }
    }
  }
}

}  // namespace tessera::cpu
