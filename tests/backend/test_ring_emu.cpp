// test_ring_emu.cpp: context parallelism's kernels (lib/backend/cuda/ring.cuh), their exact
// source, run by the warp emulator (warp_emu.hpp) on the host against the host reference
// (backend/cpu/ring_attention.hpp): the log-sum-exp merge of a ring block's partial attention into
// the running output, in f32 and bf16, at a query offset inside the rank's rows, with head dims
// above and below one pass of the warp (64 and 40), rows whose block saw no key (part lse -inf:
// unchanged) and rows with nothing merged yet (running lse -inf: the part as it is); and the
// column copy that takes the K/V heads out of qkv and puts dK/dV back. Outputs the kernels must
// not touch are checked unchanged. On a GPU, test_cuda_ops runs them through the backend.
#define TESSERA_WARP_EMU 1
#include "backend/warp_emu.hpp"
// (warp_emu.hpp first: mma.cuh's emulated primitives use it.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/ring_attention.hpp"
#include "backend/cuda/ring.cuh"

using namespace tessera;
namespace rk = tessera::ring_kernels;

namespace {

int blocks(int64_t items) {
  return static_cast<int>((items + rk::kWarps - 1) / rk::kWarps);
}

template <typename T>
void check_merge(int64_t B, int64_t Tn, int64_t H, int64_t hd, int64_t q0, int64_t nq, float tol) {
  SCOPED_TRACE(testing::Message() << "B " << B << " T " << Tn << " H " << H << " hd " << hd
                                  << " rows [" << q0 << ", " << q0 + nq << ")");
  std::mt19937 gen(static_cast<unsigned>(7 + hd + q0));
  std::normal_distribution<float> nd(0.f, 1.f);
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<T> out(static_cast<size_t>(B * Tn * H * hd)),
      part(static_cast<size_t>(B * nq * H * hd));
  std::vector<double> ref_out(out.size()), ref_part(part.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = tc::from_f32<T>(nd(gen));
    ref_out[i] = tc::to_f32(out[i]);
  }
  for (size_t i = 0; i < part.size(); ++i) {
    part[i] = tc::from_f32<T>(nd(gen));
    ref_part[i] = tc::to_f32(part[i]);
  }
  std::vector<float> lse(static_cast<size_t>(B * H * Tn)),
      part_lse(static_cast<size_t>(B * H * nq));
  for (float& v : lse) v = 3.f * nd(gen);
  for (float& v : part_lse) v = 3.f * nd(gen);
  part_lse[1] = ninf;                    // the block saw no key for this row
  lse[q0 + 2] = ninf;                    // nothing merged yet into this one (head 0, sample 0)
  part_lse[part_lse.size() - 1] = 40.f;  // a part that dominates
  std::vector<double> ref_lse(lse.begin(), lse.end()), ref_plse(part_lse.begin(), part_lse.end());
  const std::vector<T> out_before = out;
  const std::vector<float> lse_before = lse;
  cpu::ring::merge_block(ref_out.data(), ref_lse.data(), ref_part.data(), ref_plse.data(), B, Tn, H,
                         hd, q0, nq);
  tc::emu::launch(blocks(B * nq * H), 1, rk::kThreads, 0, [&](char*) {
    rk::merge(out.data(), lse.data(), part.data(), part_lse.data(), B, Tn, H, hd, q0, nq);
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const size_t l = static_cast<size_t>((b * H + h) * Tn + t);
        if (std::isinf(ref_lse[l]))
          ASSERT_TRUE(std::isinf(lse[l]) && lse[l] < 0) << "lse " << b << " " << t << " " << h;
        else
          ASSERT_NEAR(lse[l], ref_lse[l], 1e-5 * (1 + std::fabs(ref_lse[l])))
              << "lse " << b << " " << t << " " << h;
        const bool inside = t >= q0 && t < q0 + nq;
        for (int64_t d = 0; d < hd; ++d) {
          const size_t o = static_cast<size_t>(((b * Tn + t) * H + h) * hd + d);
          if (!inside) {  // rows outside the block stay as they were, bit for bit
            ASSERT_EQ(tc::to_f32(out[o]), tc::to_f32(out_before[o])) << "row " << t;
            continue;
          }
          ASSERT_NEAR(tc::to_f32(out[o]), ref_out[o], tol * (1 + std::fabs(ref_out[o])))
              << "out " << b << " " << t << " " << h << " " << d;
        }
      }
  // The row whose part saw no key (sample 0, head 0, block row 1) kept its lse and values.
  EXPECT_EQ(lse[q0 + 1], lse_before[q0 + 1]);
  for (int64_t d = 0; d < hd; ++d)
    ASSERT_EQ(tc::to_f32(out[(q0 + 1) * H * hd + d]),
              tc::to_f32(out_before[(q0 + 1) * H * hd + d]));
}

}  // namespace

TEST(RingEmu, MergeF32) {
  check_merge<float>(2, 8, 3, 64, 4, 4, 1e-6f);
  check_merge<float>(1, 6, 2, 40, 0, 6, 1e-6f);
}

TEST(RingEmu, MergeBf16) {
  check_merge<__nv_bfloat16>(2, 8, 3, 64, 4, 4, 1e-2f);
  check_merge<__nv_bfloat16>(1, 6, 2, 40, 0, 6, 1e-2f);
}

TEST(RingEmu, CopyColumnsTakesTheKeyValueHeadsAndPutsTheirGradientsBack) {
  // qkv rows of (H + 2G) * hd with H 4, G 2, hd 8: the K/V heads are columns [32, 64).
  const int64_t rows = 11, W = 64, KW = 32;
  std::vector<float> qkv(static_cast<size_t>(rows * W)), kv(static_cast<size_t>(rows * KW), -1.f);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>(i);
  tc::emu::launch(blocks(rows), 1, rk::kThreads, 0,
                  [&](char*) { rk::copy_columns(kv.data(), KW, 0, qkv.data(), W, 32, rows, KW); });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < KW; ++c)
      ASSERT_EQ(kv[r * KW + c], qkv[r * W + 32 + c]) << r << " " << c;
  // Back into a zeroed dqkv: the query columns stay 0.
  std::vector<float> dqkv(qkv.size(), 0.f);
  tc::emu::launch(blocks(rows), 1, rk::kThreads, 0,
                  [&](char*) { rk::copy_columns(dqkv.data(), W, 32, kv.data(), KW, 0, rows, KW); });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < W; ++c)
      ASSERT_EQ(dqkv[r * W + c], c < 32 ? 0.f : qkv[r * W + c]) << r << " " << c;
}
