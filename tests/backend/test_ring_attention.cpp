// test_ring_attention.cpp: context parallelism's attention decomposition (backend/cpu/
// ring_attention.hpp) against the fused causal attention of the CPU backend (backend/cpu/
// attention.hpp, written independently), in double: the sequence cut into 2·CP chunks with rank r
// holding chunks r and 2·CP−1−r, Transformer Engine's ring schedule, the log-sum-exp merge, and
// the backward replayed with the global output and log-sum-exp, at CP 1, 2, 4 and with
// grouped-query attention. Every rank's rows of the output and of dQ, and every owner's dK and dV
// (each the sum of the contributions computed on every rank), equal the whole-sequence attention
// to 1e-12. Two mutations must fail: a merge that drops the log-sum-exp correction, and the naive
// contiguous split under the same schedule. The schedule's load balance: after the first step
// every rank computes 2c² scores per step.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/attention.hpp"
#include "backend/cpu/ring_attention.hpp"

using namespace tessera;
namespace ring = tessera::cpu::ring;

namespace {

struct Whole {
  std::vector<double> q, k, v, dout;  // (S, H, hd), (S, G, hd), (S, G, hd), (S, H, hd)
  std::vector<double> out, lse;       // (S, H, hd), (S, H)
  std::vector<double> dq, dk, dv;     // the whole-sequence gradients
};

// The whole sequence through the fused attention (qkv packed as (S, H + 2G, hd)).
Whole whole_attention(int64_t S, int64_t H, int64_t G, int64_t hd, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  Whole w;
  auto fill = [&](std::vector<double>& x, int64_t n) {
    x.resize(static_cast<size_t>(n));
    for (double& e : x) e = nd(gen);
  };
  fill(w.q, S * H * hd);
  fill(w.k, S * G * hd);
  fill(w.v, S * G * hd);
  fill(w.dout, S * H * hd);
  const int64_t W = (H + 2 * G) * hd;
  std::vector<double> qkv(static_cast<size_t>(S * W)), out(static_cast<size_t>(S * H * hd)),
      lse(static_cast<size_t>(H * S)), dqkv(qkv.size(), 0.0),
      scratch(static_cast<size_t>(cpu::attention_scratch_elems(S)));
  for (int64_t t = 0; t < S; ++t) {
    for (int64_t e = 0; e < H * hd; ++e) qkv[t * W + e] = w.q[t * H * hd + e];
    for (int64_t e = 0; e < G * hd; ++e) {
      qkv[t * W + H * hd + e] = w.k[t * G * hd + e];
      qkv[t * W + (H + G) * hd + e] = w.v[t * G * hd + e];
    }
  }
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), 1, S, H, hd, scratch.data(), nullptr,
                         G);
  cpu::attention_backward(dqkv.data(), w.dout.data(), qkv.data(), out.data(), lse.data(), 1, S, H,
                          hd, scratch.data(), nullptr, G);
  w.out = out;
  w.lse.resize(static_cast<size_t>(S * H));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < S; ++t) w.lse[t * H + h] = lse[h * S + t];  // (H, S) -> (S, H)
  w.dq.resize(w.q.size());
  w.dk.resize(w.k.size());
  w.dv.resize(w.v.size());
  for (int64_t t = 0; t < S; ++t) {
    for (int64_t e = 0; e < H * hd; ++e) w.dq[t * H * hd + e] = dqkv[t * W + e];
    for (int64_t e = 0; e < G * hd; ++e) {
      w.dk[t * G * hd + e] = dqkv[t * W + H * hd + e];
      w.dv[t * G * hd + e] = dqkv[t * W + (H + G) * hd + e];
    }
  }
  return w;
}

// One CP rank's tokens: rows of x (width n per token) at the given positions.
std::vector<double> rows_at(const std::vector<double>& x, const std::vector<int64_t>& pos,
                            int64_t n) {
  std::vector<double> r;
  for (int64_t p : pos) r.insert(r.end(), x.begin() + p * n, x.begin() + (p + 1) * n);
  return r;
}

// max |got - want| / max |want|.
double worst(const std::vector<double>& got, const std::vector<double>& want) {
  double e = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    e = std::max(e, std::fabs(got[i] - want[i]));
    m = std::max(m, std::fabs(want[i]));
  }
  return e / m;
}

struct RingResult {
  double out_err = 0, dq_err = 0, dk_err = 0, dv_err = 0;
};

enum class Mutation { kNone, kMergeWithoutLse, kContiguousSplit };

// Simulates CP ranks in one process: every rank's forward around the ring, then its backward; the
// dK/dV a rank computes for an owner's block are added to the owner's (what the ring carries back).
RingResult run_ring(const Whole& w, int64_t S, int64_t H, int64_t G, int64_t hd, int cp,
                    Mutation mut = Mutation::kNone) {
  const int64_t c = S / (2 * cp), n = 2 * c, Hh = H * hd, Gh = G * hd;
  std::vector<std::vector<int64_t>> pos(static_cast<size_t>(cp));
  for (int r = 0; r < cp; ++r) {
    pos[static_cast<size_t>(r)] = ring::local_positions(r, cp, S);
    if (mut == Mutation::kContiguousSplit)
      for (int64_t t = 0; t < n; ++t)
        pos[static_cast<size_t>(r)][static_cast<size_t>(t)] = r * n + t;
  }
  std::vector<std::vector<double>> q(cp), k(cp), v(cp), dout(cp), out(cp), lse(cp), dq(cp), dk(cp),
      dv(cp);
  for (int r = 0; r < cp; ++r) {
    q[r] = rows_at(w.q, pos[r], Hh);
    k[r] = rows_at(w.k, pos[r], Gh);
    v[r] = rows_at(w.v, pos[r], Gh);
    dout[r] = rows_at(w.dout, pos[r], Hh);
    out[r].assign(static_cast<size_t>(n * Hh), 0.0);
    lse[r].assign(static_cast<size_t>(n * H), -std::numeric_limits<double>::infinity());
    dq[r].assign(q[r].size(), 0.0);
    dk[r].assign(k[r].size(), 0.0);
    dv[r].assign(v[r].size(), 0.0);
  }
  for (int r = 0; r < cp; ++r)
    for (int i = 0; i < cp; ++i) {
      const ring::StepBlock b = ring::step_block(r, cp, i, c);
      std::vector<double> po(static_cast<size_t>(b.nq * Hh)), pl(static_cast<size_t>(b.nq * H));
      ring::block_forward(po.data(), pl.data(), q[r].data() + b.q0 * Hh,
                          k[b.owner].data() + b.k0 * Gh, v[b.owner].data() + b.k0 * Gh,
                          pos[r].data() + b.q0, pos[b.owner].data() + b.k0, b.nq, b.nk, H, G, hd,
                          b.causal);
      if (mut == Mutation::kMergeWithoutLse) {
        for (size_t e = 0; e < po.size(); ++e) out[r][b.q0 * Hh + e] += po[e];
        for (size_t e = 0; e < pl.size(); ++e) lse[r][b.q0 * H + e] = pl[e];
      } else {
        ring::merge(out[r].data() + b.q0 * Hh, lse[r].data() + b.q0 * H, po.data(), pl.data(),
                    b.nq * H, hd);
      }
    }
  for (int r = 0; r < cp; ++r)
    for (int i = 0; i < cp; ++i) {
      const ring::StepBlock b = ring::step_block(r, cp, i, c);
      ring::block_backward(
          dq[r].data() + b.q0 * Hh, dk[b.owner].data() + b.k0 * Gh, dv[b.owner].data() + b.k0 * Gh,
          dout[r].data() + b.q0 * Hh, q[r].data() + b.q0 * Hh, k[b.owner].data() + b.k0 * Gh,
          v[b.owner].data() + b.k0 * Gh, out[r].data() + b.q0 * Hh, lse[r].data() + b.q0 * H,
          pos[r].data() + b.q0, pos[b.owner].data() + b.k0, b.nq, b.nk, H, G, hd, b.causal);
    }
  RingResult res;
  for (int r = 0; r < cp; ++r) {
    res.out_err = std::max(res.out_err, worst(out[r], rows_at(w.out, pos[r], Hh)));
    res.dq_err = std::max(res.dq_err, worst(dq[r], rows_at(w.dq, pos[r], Hh)));
    res.dk_err = std::max(res.dk_err, worst(dk[r], rows_at(w.dk, pos[r], Gh)));
    res.dv_err = std::max(res.dv_err, worst(dv[r], rows_at(w.dv, pos[r], Gh)));
  }
  return res;
}

}  // namespace

TEST(RingAttention, ChunksAndScheduleBalanceTheWork) {
  EXPECT_EQ(ring::local_positions(1, 2, 8), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(ring::local_positions(0, 2, 8), (std::vector<int64_t>{0, 1, 6, 7}));
  const int64_t c = 3;
  for (int cp : {1, 2, 4, 8})
    for (int r = 0; r < cp; ++r) {
      std::vector<bool> owners(static_cast<size_t>(cp), false);
      for (int i = 0; i < cp; ++i) {
        const ring::StepBlock b = ring::step_block(r, cp, i, c);
        owners[static_cast<size_t>(b.owner)] = true;
        if (i == 0) {
          EXPECT_EQ(b.owner, r);
          EXPECT_TRUE(b.causal);
        } else {
          EXPECT_EQ(b.nq * b.nk, 2 * c * c) << "cp " << cp << " rank " << r << " step " << i;
          EXPECT_FALSE(b.causal);
        }
      }
      for (bool o : owners) EXPECT_TRUE(o) << "every owner's block visits rank " << r;
    }
}

TEST(RingAttention, EveryRankEqualsTheWholeSequence) {
  const int64_t H = 4, hd = 8;
  for (int cp : {1, 2, 4}) {
    for (int64_t G : {H, int64_t(2)}) {  // multi-head and grouped-query
      SCOPED_TRACE("cp " + std::to_string(cp) + " kv heads " + std::to_string(G));
      const int64_t S = 2 * cp * 5;
      const Whole w = whole_attention(S, H, G, hd, 7u + static_cast<unsigned>(cp * 10 + G));
      const RingResult r = run_ring(w, S, H, G, hd, cp);
      EXPECT_LT(r.out_err, 1e-12);
      EXPECT_LT(r.dq_err, 1e-12);
      EXPECT_LT(r.dk_err, 1e-12);
      EXPECT_LT(r.dv_err, 1e-12);
    }
  }
}

TEST(RingAttention, MutationsAreCaught) {
  const int64_t H = 2, G = 2, hd = 8, cp = 4, S = 2 * cp * 4;
  const Whole w = whole_attention(S, H, G, hd, 99u);
  const RingResult no_lse = run_ring(w, S, H, G, hd, cp, Mutation::kMergeWithoutLse);
  EXPECT_GT(no_lse.out_err, 1e-3) << "a merge without the log-sum-exp correction";
  const RingResult contiguous = run_ring(w, S, H, G, hd, cp, Mutation::kContiguousSplit);
  EXPECT_GT(std::max({contiguous.out_err, contiguous.dq_err, contiguous.dk_err}), 1e-3)
      << "the contiguous split under the load-balanced schedule";
}

// The batched BLAS form the CPU backend runs (ring_block_forward / ring_block_backward, several
// samples, qkv and kv layouts, query and key row ranges, attention dropout and ALiBi keyed by
// global positions) equals the scalar block reference above, element for element, in double.
TEST(RingAttention, BatchedBlocksEqualTheScalarReference) {
  const int64_t B = 2, H = 4, G = 2, hd = 8, cp = 2, Tn = 12, c = Tn / 2, S = cp * Tn;
  const int64_t W = (H + 2 * G) * hd, KW = 2 * G * hd, OW = H * hd;
  std::mt19937 gen(99);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> qkv(static_cast<size_t>(B * Tn * W)), kv(static_cast<size_t>(B * Tn * KW)),
      dout(static_cast<size_t>(B * Tn * OW)), gout(dout.size()),
      glse(static_cast<size_t>(B * H * Tn));
  for (auto* x : {&qkv, &kv, &dout, &gout})
    for (double& e : *x) e = nd(gen);
  for (double& e : glse) e = 2.0 + nd(gen);
  AttentionDropout drop;
  drop.spec = make_dropout_spec(0.3, 5, 2, 1, DropoutKind::Attention, 11);
  drop.head_begin = 4;
  drop.heads_total = 8;
  AttentionAlibi alibi;
  alibi.head_begin = 4;
  alibi.heads_total = 8;
  for (int step = 0; step < 2; ++step)
    for (int with = 0; with < 2; ++with) {
      SCOPED_TRACE(testing::Message() << "step " << step << " dropout/alibi " << with);
      const CpStepBlock s = cp_step_block(1, cp, step, c);
      const RingBlockSpec b =
          ring_block_spec(s, 1, cp, H, G, with ? &drop : nullptr, with ? &alibi : nullptr);
      std::vector<double> out(static_cast<size_t>(B * b.nq * OW)),
          lse(static_cast<size_t>(B * H * b.nq));
      ring::ring_block_forward(out.data(), lse.data(), qkv.data(), kv.data(), B, Tn, hd, b);
      std::vector<double> dq(qkv.size(), 0.0), dk(kv.size(), 0.0);
      ring::ring_block_backward(dq.data(), dk.data(), dout.data(), qkv.data(), kv.data(),
                                gout.data(), glse.data(), B, Tn, hd, b);
      std::vector<double> dq_ref(qkv.size(), 0.0), dk_ref(kv.size(), 0.0);
      std::vector<int64_t> qpos, kpos;
      for (int64_t i = 0; i < b.nq; ++i) qpos.push_back(cp_position(1, cp, c, b.q0 + i));
      for (int64_t j = 0; j < b.nk; ++j) kpos.push_back(cp_position(s.owner, cp, c, b.k0 + j));
      for (int64_t bb = 0; bb < B; ++bb) {
        auto mult = [&](int64_t h, int64_t i, int64_t j) {
          return with ? drop.multiplier(bb, h, qpos[i], kpos[j], S) : 1.0;
        };
        auto bias = [&](int64_t h, int64_t i, int64_t j) {
          return with ? double(alibi.bias(h, qpos[i], kpos[j])) : 0.0;
        };
        const double* k = kv.data() + (bb * Tn + b.k0) * KW;
        const ring::BlockArgs<double> a{qkv.data() + (bb * Tn + b.q0) * W,
                                        k,
                                        k + G * hd,
                                        W,
                                        KW,
                                        qpos.data(),
                                        kpos.data(),
                                        b.nq,
                                        b.nk,
                                        H,
                                        G,
                                        hd,
                                        b.causal};
        std::vector<double> o(static_cast<size_t>(b.nq * OW)), l(static_cast<size_t>(H * b.nq));
        ring::block_forward(a, o.data(), OW, l.data(), 1, b.nq, mult, bias);
        for (int64_t i = 0; i < b.nq * OW; ++i)
          ASSERT_NEAR(out[bb * b.nq * OW + i], o[i], 1e-12) << "out " << bb << " " << i;
        for (int64_t i = 0; i < H * b.nq; ++i)
          ASSERT_NEAR(lse[bb * H * b.nq + i], l[i], 1e-12) << "lse " << bb << " " << i;
        double* dkr = dk_ref.data() + (bb * Tn + b.k0) * KW;
        ring::block_backward(a, dq_ref.data() + (bb * Tn + b.q0) * W, dkr, dkr + G * hd,
                             dout.data() + (bb * Tn + b.q0) * OW,
                             gout.data() + (bb * Tn + b.q0) * OW, OW,
                             glse.data() + bb * H * Tn + b.q0, 1, Tn, mult, bias);
      }
      double m = 0;
      for (double e : dq_ref) m = std::max(m, std::fabs(e));
      ASSERT_GT(m, 0.0);
      for (size_t i = 0; i < dq.size(); ++i) ASSERT_NEAR(dq[i], dq_ref[i], 1e-12 * m) << "dq " << i;
      for (size_t i = 0; i < dk.size(); ++i)
        ASSERT_NEAR(dk[i], dk_ref[i], 1e-12 * m) << "dkv " << i;
    }
}

// Documents that do not see each other under context parallelism (--reset-attention-mask, --sft):
// the tables of the whole samples by global position, documents spanning the chunks and ranks,
// with and without ALiBi by the reset position ids. Every rank's output, log-sum-exp and dQ, and
// every owner's dK/dV summed over the ring, equal the whole-sequence attention with the same tables
// (cpu::attention_forward/backward, the CP-1 path) to 1e-12, at CP 2 and 4 with grouped-query
// attention; and the tables change the result (the mask is applied at all).
TEST(RingAttention, DocumentsSpanningChunksEqualTheWholeSequence) {
  const int64_t B = 2, H = 4, G = 2, hd = 8, W = (H + 2 * G) * hd, KW = 2 * G * hd, OW = H * hd;
  for (int cp : {2, 4})
    for (int with_alibi = 0; with_alibi < 2; ++with_alibi) {
      SCOPED_TRACE(testing::Message() << "cp " << cp << " alibi " << with_alibi);
      const int64_t S = 2 * cp * 6, Tn = S / cp, c = Tn / 2;
      std::mt19937 gen(static_cast<unsigned>(40 + cp + 10 * with_alibi));
      std::normal_distribution<double> nd(0.0, 1.0);
      std::vector<double> qkv(static_cast<size_t>(B * S * W)),
          dout(static_cast<size_t>(B * S * OW));
      for (double& e : qkv) e = nd(gen);
      for (double& e : dout) e = nd(gen);
      // Documents of 1 to 9 tokens: their first key and restarted positions.
      std::vector<int32_t> kb(static_cast<size_t>(B * S)), pos(kb.size());
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0, start = 0, len = 1 + int64_t(gen() % 9); t < S; ++t) {
          if (t - start == len) {
            start = t;
            len = 1 + int64_t(gen() % 9);
          }
          kb[static_cast<size_t>(b * S + t)] = static_cast<int32_t>(start);
          pos[static_cast<size_t>(b * S + t)] = static_cast<int32_t>(t - start);
        }
      AttentionAlibi alibi;
      alibi.head_begin = 0;
      alibi.heads_total = H;
      const AttentionAlibi* al = with_alibi ? &alibi : nullptr;
      const int32_t* ptab = with_alibi ? pos.data() : nullptr;
      // The whole sequence (CP 1) with the tables, and without them.
      std::vector<double> out(static_cast<size_t>(B * S * OW)), lse(static_cast<size_t>(B * H * S)),
          dqkv(qkv.size(), 0.0), scratch(static_cast<size_t>(cpu::attention_scratch_elems(S))),
          plain(out.size()), plain_lse(lse.size());
      cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, S, H, hd, scratch.data(),
                             nullptr, G, al, kb.data(), ptab);
      cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, S, H,
                              hd, scratch.data(), nullptr, G, al, kb.data(), ptab);
      cpu::attention_forward(plain.data(), plain_lse.data(), qkv.data(), B, S, H, hd,
                             scratch.data(), nullptr, G, al);
      double moved = 0;
      for (size_t i = 0; i < out.size(); ++i) moved = std::max(moved, std::fabs(out[i] - plain[i]));
      EXPECT_GT(moved, 1e-2) << "the documents change the attention";
      // Each rank's rows: qkv (B,Tn,W), its K/V (B,Tn,KW).
      auto local = [&](const std::vector<double>& x, int64_t width, int r, int64_t col,
                       int64_t cols) {
        std::vector<double> y(static_cast<size_t>(B * Tn * cols));
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < Tn; ++t) {
            const int64_t g = cp_position(r, cp, c, t);
            for (int64_t e = 0; e < cols; ++e)
              y[static_cast<size_t>((b * Tn + t) * cols + e)] =
                  x[static_cast<size_t>((b * S + g) * width + col + e)];
          }
        return y;
      };
      const ring::RingDocs docs{kb.data(), ptab};
      std::vector<std::vector<double>> q(cp), kv(cp), o(cp), l(cp), dq(cp), dkv(cp), dO(cp);
      for (int r = 0; r < cp; ++r) {
        q[r] = local(qkv, W, r, 0, W);
        kv[r] = local(qkv, W, r, H * hd, KW);
        dO[r] = local(dout, OW, r, 0, OW);
        o[r].assign(static_cast<size_t>(B * Tn * OW), 0.0);
        l[r].assign(static_cast<size_t>(B * H * Tn), 0.0);
        dq[r].assign(q[r].size(), 0.0);
        dkv[r].assign(kv[r].size(), 0.0);
      }
      for (int r = 0; r < cp; ++r)
        for (int i = 0; i < cp; ++i) {
          const CpStepBlock s = cp_step_block(r, cp, i, c);
          const RingBlockSpec b = ring_block_spec(s, r, cp, H, G, nullptr, al);
          if (i == 0) {
            ring::ring_block_forward(o[r].data(), l[r].data(), q[r].data(), kv[s.owner].data(), B,
                                     Tn, hd, b, docs);
            continue;
          }
          std::vector<double> po(static_cast<size_t>(B * s.nq * OW)),
              pl(static_cast<size_t>(B * H * s.nq));
          ring::ring_block_forward(po.data(), pl.data(), q[r].data(), kv[s.owner].data(), B, Tn, hd,
                                   b, docs);
          ring::merge_block(o[r].data(), l[r].data(), po.data(), pl.data(), B, Tn, H, hd, s.q0,
                            s.nq);
        }
      for (int r = 0; r < cp; ++r)
        for (int i = 0; i < cp; ++i) {
          const CpStepBlock s = cp_step_block(r, cp, i, c);
          const RingBlockSpec b = ring_block_spec(s, r, cp, H, G, nullptr, al);
          ring::ring_block_backward(dq[r].data(), dkv[s.owner].data(), dO[r].data(), q[r].data(),
                                    kv[s.owner].data(), o[r].data(), l[r].data(), B, Tn, hd, b,
                                    docs);
        }
      for (int r = 0; r < cp; ++r) {
        SCOPED_TRACE(testing::Message() << "rank " << r);
        EXPECT_LT(worst(o[r], local(out, OW, r, 0, OW)), 1e-12) << "out";
        std::vector<double> dq_cols;  // the query columns of the rank's (B,Tn,W) gradient
        for (int64_t row = 0; row < B * Tn; ++row)
          dq_cols.insert(dq_cols.end(), dq[r].begin() + row * W, dq[r].begin() + row * W + OW);
        EXPECT_LT(worst(dq_cols, local(dqkv, W, r, 0, OW)), 1e-12) << "dq";
        EXPECT_LT(worst(dkv[r], local(dqkv, W, r, H * hd, KW)), 1e-12) << "dk, dv";
        std::vector<double> want_lse(l[r].size());
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < Tn; ++t)
              want_lse[static_cast<size_t>((b * H + h) * Tn + t)] =
                  lse[static_cast<size_t>((b * H + h) * S + cp_position(r, cp, c, t))];
        EXPECT_LT(worst(l[r], want_lse), 1e-12) << "lse";
      }
    }
}
