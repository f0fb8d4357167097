// test_moe_emu.cpp: the MoE kernels of lib/backend/cuda/moe.cuh, their exact source, run by the
// warp emulator (warp_emu.hpp) on the host against the host reference (backend/cpu/moe.hpp):
// the router's top-k and weights for each score function (softmax over the k chosen, softmax then
// top-k, sigmoid; scaling; ties to the lower expert; E above 32 so lanes hold several experts;
// top-k = E), its load-balancing scores and logsumexp^2, its backward (through the weights, the
// load-balancing term per group, the z-loss; a dropped slot), and the permutation: permute,
// unpermute, their backwards, in bf16 on the 16-byte path and f32 / f16 on the element path,
// with dropped slots. Outputs start as NaN where the kernels must write. On a GPU, test_cuda_ops
// runs the same kernels through the backend.
#define TESSERA_WARP_EMU 1
#include "backend/warp_emu.hpp"
// (warp_emu.hpp first: mma.cuh's emulated primitives use it.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/moe.hpp"
#include "backend/cuda/moe.cuh"

using namespace tessera;
namespace mk = tessera::moe_kernels;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

int blocks(int64_t items) {
  return static_cast<int>((items + mk::kWarps - 1) / mk::kWarps);
}

std::vector<float> random_logits(int64_t N, int E, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.f, 1.5f);
  std::vector<float> z(static_cast<size_t>(N * E));
  for (float& v : z) v = nd(gen);
  // Ties: token 0 has two equal best logits (the lower expert must come first).
  z[3] = z[1] = 10.f;  // above every other logit
  return z;
}

void check_router(const MoERouting& r, int64_t N, int64_t group_rows) {
  SCOPED_TRACE(testing::Message() << "E " << r.experts << " K " << r.topk << " sigmoid "
                                  << r.sigmoid << " pre_softmax " << r.pre_softmax);
  const int E = r.experts, K = r.topk;
  mk::Route m = mk::make_route(r);
  if (!r.expert_bias.empty()) m.bias = r.expert_bias.data();  // the emulator reads host memory
  const std::vector<float> z = random_logits(N, E, 17u + static_cast<unsigned>(E * 8 + K));

  // Top-k and weights.
  std::vector<int32_t> ex(static_cast<size_t>(N * K), -7), ref_ex(ex.size());
  std::vector<float> w(ex.size(), kNaN), ref_w(ex.size());
  std::vector<int32_t> ref_row(ex.size());
  std::vector<int64_t> routed, kept;
  moe_route_host(z.data(), N, r, group_rows, ref_ex.data(), ref_w.data(), ref_row.data(), routed,
                 kept);
  tc::emu::launch(blocks(N), 1, mk::kThreads, 0,
                  [&](char*) { mk::router_topk(ex.data(), w.data(), z.data(), N, m); });
  for (size_t i = 0; i < ex.size(); ++i) {
    ASSERT_EQ(ex[i], ref_ex[i]) << "slot " << i;
    EXPECT_NEAR(w[i], ref_w[i], 2e-6) << "slot " << i;
  }
  if (!r.keyed()) {
    EXPECT_EQ(ex[0], 1) << "a tie goes to the lower expert";
  }

  // The rows from the device's choice equal the reference's.
  std::vector<int32_t> rows(ex.size());
  std::vector<int64_t> routed2, kept2;
  moe_assign_rows_host(ex.data(), w.data(), N, r, group_rows, rows.data(), routed2, kept2);
  EXPECT_EQ(rows, ref_row);
  EXPECT_EQ(routed2, routed);
  EXPECT_EQ(kept2, kept);

  // Scores and lse^2, summed in token order as moe.cu does.
  std::vector<float> S(static_cast<size_t>(N * E), kNaN), lse(static_cast<size_t>(N), kNaN);
  tc::emu::launch(blocks(N), 1, mk::kThreads, 0,
                  [&](char*) { mk::router_scores(S.data(), lse.data(), z.data(), N, m); });
  std::vector<double> ref_sums;
  double ref_lse = 0;
  moe_router_stats_host(z.data(), N, r, group_rows, ref_sums, ref_lse);
  std::vector<double> sums(ref_sums.size(), 0.0);
  double lse_sum = 0;
  for (int64_t n = 0; n < N; ++n) {
    for (int e = 0; e < E; ++e) sums[static_cast<size_t>((n / group_rows) * E + e)] += S[n * E + e];
    lse_sum += lse[static_cast<size_t>(n)];
  }
  for (size_t i = 0; i < sums.size(); ++i) EXPECT_NEAR(sums[i], ref_sums[i], 1e-5) << i;
  EXPECT_NEAR(lse_sum, ref_lse, 1e-5 * ref_lse);

  // Backward, with one slot dropped (its expert stored as -1 - e) and every term on.
  std::vector<int32_t> exd = ref_ex;
  exd[static_cast<size_t>(K)] = -1 - exd[static_cast<size_t>(K)];  // token 1's first slot
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> dw(ex.size());
  for (float& v : dw) v = nd(gen);
  std::vector<double> aux(static_cast<size_t>(N / group_rows * E));
  for (double& v : aux) v = 0.1 * nd(gen);
  const std::vector<float> auxf(aux.begin(), aux.end());
  const double zg = 0.01;
  std::vector<float> dz(static_cast<size_t>(N * E), kNaN), ref_dz(dz.size());
  moe_router_backward_host(ref_dz.data(), z.data(), N, r, exd.data(), ref_w.data(), dw.data(),
                           group_rows, aux, zg);
  tc::emu::launch(blocks(N), 1, mk::kThreads, 0, [&](char*) {
    mk::router_backward(dz.data(), z.data(), exd.data(), ref_w.data(), dw.data(), auxf.data(),
                        static_cast<float>(zg), N, group_rows, m);
  });
  double scale = 0;
  for (float v : ref_dz) scale = std::max(scale, std::fabs(double(v)));
  for (size_t i = 0; i < dz.size(); ++i) EXPECT_NEAR(dz[i], ref_dz[i], 1e-5 * scale) << i;
}

// DeepSeek-V3's router: sigmoid scores plus an expert bias for the choice, group-limited (64
// experts in 8 groups, the best 4 groups by the sum of their top 2, then the top 8); and the
// group limit over softmax logits and pre-softmax probabilities with Megatron's group score.
TEST(MoeEmu, RouterSigmoidBiasGroupLimited) {
  MoERouting r;
  r.experts = 64;
  r.topk = 8;
  r.sigmoid = true;
  r.scaling = 2.5;
  r.groups = 8;
  r.group_topk = 4;
  r.group_score = 2;
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.f, 0.3f);
  for (int e = 0; e < r.experts; ++e) r.expert_bias.push_back(nd(gen));
  check_router(r, 19, 19);
  r.groups = r.group_topk = r.group_score = 0;  // the bias alone
  check_router(r, 19, 19);
}
TEST(MoeEmu, RouterGroupLimitedSoftmax) {
  MoERouting r;
  r.experts = 16;
  r.topk = 4;
  r.groups = 4;
  r.group_topk = 2;
  r.group_score = 2;
  check_router(r, 13, 13);
  r.pre_softmax = true;
  r.groups = 8;
  r.group_topk = 3;
  r.group_score = 1;
  check_router(r, 13, 13);
}

TEST(MoeEmu, RouterSoftmaxTopK) {
  MoERouting r;
  r.experts = 8;
  r.topk = 2;
  check_router(r, 21, 7);
}
TEST(MoeEmu, RouterPreSoftmaxScaledManyExperts) {
  MoERouting r;
  r.experts = 40;  // lanes 0..7 hold two experts each
  r.topk = 3;
  r.pre_softmax = true;
  r.scaling = 2.5;
  check_router(r, 9, 9);
}
TEST(MoeEmu, RouterSigmoidAndTopKEqualsE) {
  MoERouting r;
  r.experts = 4;
  r.topk = 4;
  r.sigmoid = true;
  check_router(r, 10, 5);
  r.topk = 1;
  check_router(r, 10, 10);
}

// Permute, unpermute and their backwards on N tokens of C elements of T, K slots each, some
// dropped, against the host reference on the same rounded inputs.
template <typename T>
void check_permutation(int64_t N, int K, int64_t C, bool vec, float tol) {
  SCOPED_TRACE(testing::Message() << "C " << C << " vec " << vec);
  using rowwise::from_f32;
  using rowwise::to_f32;
  std::mt19937 gen(11 + static_cast<unsigned>(C));
  std::normal_distribution<float> nd(0.f, 1.f);
  // Rows: a random permutation of the kept slots; every 5th slot dropped.
  std::vector<int32_t> row(static_cast<size_t>(N * K));
  std::vector<int32_t> order;
  for (int64_t s = 0; s < N * K; ++s)
    if (s % 5 != 3) order.push_back(static_cast<int32_t>(order.size()));
  std::shuffle(order.begin(), order.end(), gen);
  const int64_t R = static_cast<int64_t>(order.size());
  for (int64_t s = 0, i = 0; s < N * K; ++s) row[s] = s % 5 == 3 ? -1 : order[i++];
  std::vector<float> weight(row.size());
  for (float& v : weight) v = 0.5f + 0.3f * nd(gen);

  auto buf = [](int64_t n) {
    return std::vector<uint4>(static_cast<size_t>((n * sizeof(T) + 15) / 16 + 1));
  };
  auto P = [](std::vector<uint4>& v) { return reinterpret_cast<T*>(v.data()); };
  auto xs = buf(N * C), xp = buf(R * C), outs = buf(R * C), ys = buf(N * C), dys = buf(N * C),
       douts = buf(R * C), dxs = buf(N * C);
  std::vector<float> x(N * C), out(R * C), dy(N * C);
  for (int64_t i = 0; i < N * C; ++i) {
    P(xs)[i] = from_f32<T>(nd(gen));
    x[i] = to_f32(P(xs)[i]);
    P(dys)[i] = from_f32<T>(nd(gen));
    dy[i] = to_f32(P(dys)[i]);
    P(ys)[i] = P(dxs)[i] = from_f32<T>(kNaN);
  }
  for (int64_t i = 0; i < R * C; ++i) {
    P(outs)[i] = from_f32<T>(nd(gen));
    out[i] = to_f32(P(outs)[i]);
    P(xp)[i] = P(douts)[i] = from_f32<T>(kNaN);
  }
  std::vector<float> dweight(row.size(), kNaN);

  tc::emu::launch(blocks(N * K), 1, mk::kThreads, 0,
                  [&](char*) { mk::permute(P(xp), P(xs), row.data(), N, K, C, vec); });
  tc::emu::launch(blocks(N), 1, mk::kThreads, 0, [&](char*) {
    mk::gather_rows(P(ys), P(outs), row.data(), weight.data(), N, K, C, vec);
  });
  tc::emu::launch(blocks(N * K), 1, mk::kThreads, 0, [&](char*) {
    mk::unpermute_backward(P(douts), dweight.data(), P(dys), P(outs), row.data(), weight.data(), N,
                           K, C, vec);
  });
  // The permute's backward reads the gradient rows the unpermute's backward wrote.
  tc::emu::launch(blocks(N), 1, mk::kThreads, 0, [&](char*) {
    mk::gather_rows(P(dxs), P(douts), row.data(), nullptr, N, K, C, vec);
  });

  std::vector<float> rxp(R * C), ry(N * C), rdout(R * C, 0.f), rdw(row.size()), rdx(N * C);
  moe_permute_host(rxp.data(), x.data(), row.data(), N, K, C);
  moe_unpermute_host(ry.data(), out.data(), row.data(), weight.data(), N, K, C);
  moe_unpermute_backward_host(rdout.data(), rdw.data(), dy.data(), out.data(), row.data(),
                              weight.data(), N, K, C);
  std::vector<float> rdout_t(R * C);  // as stored in T, which the permute's backward reads
  for (int64_t i = 0; i < R * C; ++i) rdout_t[i] = to_f32(from_f32<T>(rdout[i]));
  moe_permute_backward_host(rdx.data(), rdout_t.data(), row.data(), N, K, C);

  auto near = [&](float got, float want, const char* what, int64_t i) {
    ASSERT_TRUE(std::isfinite(got)) << what << " " << i << " not written";
    ASSERT_NEAR(got, want, tol * (1 + std::fabs(want))) << what << " " << i;
  };
  for (int64_t i = 0; i < R * C; ++i) {
    ASSERT_EQ(to_f32(P(xp)[i]), rxp[i]) << "x_perm " << i;  // a copy is exact
    near(to_f32(P(douts)[i]), rdout[i], "dout", i);
  }
  for (int64_t i = 0; i < N * C; ++i) {
    near(to_f32(P(ys)[i]), ry[i], "y", i);
    near(to_f32(P(dxs)[i]), rdx[i], "dx", i);
  }
  for (size_t s = 0; s < row.size(); ++s) {
    if (row[s] < 0) {
      EXPECT_EQ(dweight[s], 0.f) << "dropped slot " << s;
      continue;
    }
    double mag = 0;
    for (int64_t c = 0; c < C; ++c) mag += std::fabs(dy[(s / K) * C + c] * out[row[s] * C + c]);
    EXPECT_NEAR(dweight[s], rdw[s], 1e-5 * (mag + 1)) << "dweight " << s;
  }
}

TEST(MoeEmu, PermutationBf16Vector) {
  check_permutation<__nv_bfloat16>(11, 2, 96, true, 1e-2f);
}
TEST(MoeEmu, PermutationF16AndF32Elements) {
  check_permutation<__half>(7, 3, 37, false, 2e-3f);
  check_permutation<float>(9, 2, 70, false, 1e-6f);
  check_permutation<float>(5, 1, 64, true, 1e-6f);
}

}  // namespace
