// dropout.hpp: dropout masks from the counter-based RNG (DESIGN.md invariant 2), the same
// function on the host (CPU backend, tests) and in CUDA kernels.
//
// Whether element e of sample s survives depends only on (seed, iteration, site, s, e): the
// global sample index (its position in the training stream, whatever DP rank and micro-batch
// carries it), the site (which dropout of which layer) and the element's index inside that
// sample's global tensor (hidden dropout: t * C + c over the full hidden width; attention
// dropout: (h * T + i) * T + j over every head). Any layout (TP, PP, DP, sequence parallelism,
// virtual stages, micro-batch size, recomputation) therefore draws the same masks, and the
// backward draws the mask of its forward again instead of storing it.
//
// One Philox4x32-10 call gives 4 words: the mask of 4 consecutive elements. Counter: (e / 4 low
// 32 bits, sample, iteration, site | (e / 4 bits 32..47) << 16); key: the seed, salted.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace tessera {

// Where a dropout sits; the site number is 4 * (layer + 1) + kind, the embedding's is 0.
enum class DropoutKind : uint32_t { Embedding = 0, Attention = 1, AttnOut = 2, MlpOut = 3 };

struct DropoutSpec {
  float p = 0;             // probability of dropping an element; 0: dropout off
  float scale = 1;         // 1 / (1 - p), applied to the survivors
  uint32_t threshold = 0;  // a word below it drops its element
  uint32_t seed_lo = 0, seed_hi = 0;
  uint32_t iteration = 0;
  uint32_t site = 0;
  int64_t sample_begin = 0;  // global index of sample 0 of the tensor's batch
  TESSERA_HD bool active() const { return p > 0; }
};

// The spec of one dropout site; p in [0, 1).
inline DropoutSpec make_dropout_spec(double p, uint64_t seed, int64_t iteration, int layer,
                                     DropoutKind kind, int64_t sample_begin) {
  DropoutSpec d;
  d.p = static_cast<float>(p);
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  const double t = p * 4294967296.0;
  d.threshold = t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
  const uint64_t salted = seed ^ 0x6a09e667f3bcc909ull;  // not the init streams' key
  d.seed_lo = static_cast<uint32_t>(salted);
  d.seed_hi = static_cast<uint32_t>(salted >> 32);
  d.iteration = static_cast<uint32_t>(iteration);
  d.site = kind == DropoutKind::Embedding
               ? 0u
               : 4u * static_cast<uint32_t>(layer + 1) + static_cast<uint32_t>(kind);
  d.sample_begin = sample_begin;
  return d;
}

TESSERA_HD uint32_t dropout_mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// Philox4x32-10 (the same rounds as core/rng.hpp) on counter c, key (k0, k1); the result in c.
TESSERA_HD void dropout_philox(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = dropout_mulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
    const uint32_t hi1 = dropout_mulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// The 4 mask words of elements 4 * group .. 4 * group + 3 of global sample `sample`.
TESSERA_HD void dropout_words(const DropoutSpec& d, int64_t sample, uint64_t group,
                              uint32_t (&w)[4]) {
  w[0] = static_cast<uint32_t>(group);
  w[1] = static_cast<uint32_t>(sample);
  w[2] = d.iteration;
  w[3] = d.site | (static_cast<uint32_t>(group >> 32) << 16);
  dropout_philox(w, d.seed_lo, d.seed_hi);
}

// Word i of w, selected without indexing the array by a run-time value (which would put it in
// local memory in a CUDA kernel).
TESSERA_HD uint32_t dropout_pick(const uint32_t (&w)[4], uint32_t i) {
  return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
}

// The multiplier of element `element` of global sample `sample`: 0 (dropped) or spec.scale.
TESSERA_HD float dropout_multiplier(const DropoutSpec& d, int64_t sample, uint64_t element) {
  uint32_t w[4];
  dropout_words(d, sample, element >> 2, w);
  return dropout_pick(w, static_cast<uint32_t>(element & 3)) >= d.threshold ? d.scale : 0.f;
}

// The multipliers of elements `element` and `element + 1`: one Philox call when both are in the
// same group of 4 (element even), two otherwise.
TESSERA_HD void dropout_multiplier2(const DropoutSpec& d, int64_t sample, uint64_t element,
                                    float& m0, float& m1) {
  if (element & 1) {
    m0 = dropout_multiplier(d, sample, element);
    m1 = dropout_multiplier(d, sample, element + 1);
    return;
  }
  uint32_t w[4];
  dropout_words(d, sample, element >> 2, w);
  const bool high = (element & 2) != 0;  // words 2, 3 (else 0, 1)
  m0 = (high ? w[2] : w[0]) >= d.threshold ? d.scale : 0.f;
  m1 = (high ? w[3] : w[1]) >= d.threshold ? d.scale : 0.f;
}

// Multipliers of one sample's elements read in increasing order (a row of a tensor): one Philox
// call per group of 4 elements instead of one per element.
class DropoutStream {
 public:
  TESSERA_HD DropoutStream(const DropoutSpec& d, int64_t sample) : d_(d), sample_(sample) {}
  TESSERA_HD float operator()(uint64_t element) {
    const uint64_t group = element >> 2;
    if (group != group_) {
      dropout_words(d_, sample_, group, w_);
      group_ = group;
    }
    return dropout_pick(w_, static_cast<uint32_t>(element & 3)) >= d_.threshold ? d_.scale : 0.f;
  }

 private:
  DropoutSpec d_;  // a copy: small, and no reference to outlive
  int64_t sample_;
  uint64_t group_ = ~uint64_t(0);
  uint32_t w_[4] = {0, 0, 0, 0};
};

// Attention dropout: the spec, and where this rank's heads sit among all of them.
struct AttentionDropout {
  DropoutSpec spec;
  int64_t head_begin = 0, heads_total = 0;
  // Multiplier of probability (query i, key j) of local head h in batch row b (T tokens).
  TESSERA_HD uint64_t element(int64_t h, int64_t i, int64_t j, int64_t T) const {
    return (static_cast<uint64_t>(head_begin + h) * T + i) * T + j;
  }
  TESSERA_HD float multiplier(int64_t b, int64_t h, int64_t i, int64_t j, int64_t T) const {
    return dropout_multiplier(spec, spec.sample_begin + b, element(h, i, j, T));
  }
  // Keys j and j + 1 of query i.
  TESSERA_HD void multiplier2(int64_t b, int64_t h, int64_t i, int64_t j, int64_t T, float& m0,
                              float& m1) const {
    dropout_multiplier2(spec, spec.sample_begin + b, element(h, i, j, T), m0, m1);
  }
};

}  // namespace tessera
