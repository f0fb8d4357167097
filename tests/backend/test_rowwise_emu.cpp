// test_rowwise_emu.cpp: the memory-bound reduction kernels of lib/backend/cuda/rowwise.cuh, their
// exact source, run by the warp emulator (warp_emu.hpp) on the host against the CPU reference:
// LayerNorm and RMSNorm forward (alone and after the fused residual add) and input backward, one
// warp per row (backend/cpu/layernorm.hpp, rmsnorm.hpp), with a last block holding fewer rows
// than it has warps and rows longer than one pass of the warp's loads;
// softmax cross-entropy's three passes (backend/cpu/cross_entropy.hpp) in bf16, f16 and f32, on
// rows read 16 bytes at a time and on rows that are not (a vocabulary not a multiple of the
// vector), with vocabulary padding, an ignored row and targets outside the shard; and the two
// stages of a column sum (bias, LayerNorm and RMSNorm parameter gradients) with a partial last
// chunk, a partial last column block, more rows than kMaxChunks chunks of kChunkRows hold, and
// results added to what the output held. Outputs start as NaN where the kernels must write them.
// On a GPU, test_cuda_ops runs the same kernels through the backend.
#define TESSERA_WARP_EMU 1
#include "backend/warp_emu.hpp"
// (warp_emu.hpp first: mma.cuh's emulated primitives use it.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/cross_entropy.hpp"
#include "backend/cpu/layernorm.hpp"
#include "backend/cpu/rmsnorm.hpp"
#include "backend/cuda/rowwise.cuh"

using namespace tessera;
namespace rw = tessera::rowwise;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <typename T>
float widen(T v) {
  return rw::to_f32(v);
}

// Runs the three cross-entropy passes on (N, V) logits of T and checks them against the CPU
// reference in double on the same (rounded) logits.
template <typename T>
void check_xent(int N, int V, int valid, int col_begin, float tol) {
  std::mt19937 gen(1234 + V);
  std::normal_distribution<float> nd(0.f, 3.f);
  // 16-byte aligned storage, as the device allocator gives.
  std::vector<uint4> store((static_cast<size_t>(N) * V * sizeof(T) + 15) / 16 + 1);
  T* logits = reinterpret_cast<T*>(store.data());
  std::vector<double> ref(static_cast<size_t>(N) * V);
  for (size_t i = 0; i < ref.size(); ++i) {
    logits[i] = rw::from_f32<T>(nd(gen));
    ref[i] = widen(logits[i]);
  }
  std::vector<int32_t> targets(N);
  std::uniform_int_distribution<int> pick(0, valid - 1);
  for (int n = 0; n < N; ++n) targets[n] = col_begin + pick(gen);
  targets[1] = -1;                                // ignored row
  if (N > 2) targets[2] = col_begin + valid + 3;  // the target lives on another shard
  if (N > 3) targets[3] = col_begin > 0 ? col_begin - 1 : col_begin + valid - 1;
  const float scale = 1.f / 7.f;

  std::vector<float> rowmax(N, kNaN), sumexp(N, kNaN), tlogit(N, kNaN), losses(N, kNaN);
  tc::emu::launch(N, 1, rw::kThreads, rw::kThreads / 32 * sizeof(float), [&](char* sh) {
    rw::xent_max(rowmax.data(), logits, V, valid, reinterpret_cast<float*>(sh));
  });
  tc::emu::launch(N, 1, rw::kThreads, rw::kThreads / 32 * sizeof(float), [&](char* sh) {
    rw::xent_sums(sumexp.data(), tlogit.data(), logits, rowmax.data(), targets.data(), V, valid,
                  col_begin, reinterpret_cast<float*>(sh));
  });
  tc::emu::launch(N, 1, rw::kThreads, 0, [&](char*) {
    rw::xent_loss_grad(losses.data(), logits, rowmax.data(), sumexp.data(), tlogit.data(),
                       targets.data(), V, valid, col_begin, scale);
  });

  std::vector<double> rmax(N), rsum(N), rt(N), rloss(N);
  cpu::xent_row_max(rmax.data(), ref.data(), N, V, valid);
  cpu::xent_row_sums(rsum.data(), rt.data(), ref.data(), rmax.data(), targets.data(), N, V, valid,
                     col_begin);
  cpu::xent_loss_and_grad(rloss.data(), ref.data(), rmax.data(), rsum.data(), rt.data(),
                          targets.data(), N, V, valid, col_begin, static_cast<double>(scale));
  for (int n = 0; n < N; ++n) {
    EXPECT_EQ(rowmax[n], static_cast<float>(rmax[n])) << "row " << n;  // a max is exact
    EXPECT_NEAR(sumexp[n], rsum[n], 1e-5 * rsum[n]) << "row " << n;
    EXPECT_EQ(tlogit[n], static_cast<float>(rt[n])) << "row " << n;
    EXPECT_NEAR(losses[n], rloss[n], 1e-5 * (1 + std::fabs(rloss[n]))) << "row " << n;
    double worst = 0, gmax = 0;
    for (int j = 0; j < V; ++j) {
      const double g = widen(logits[static_cast<size_t>(n) * V + j]);
      const double r = ref[static_cast<size_t>(n) * V + j];
      ASSERT_TRUE(std::isfinite(g)) << "row " << n << " column " << j;
      if (j >= valid || targets[n] < 0) {
        ASSERT_EQ(g, 0.0) << "row " << n << " column " << j;
      }
      worst = std::max(worst, std::fabs(g - r));
      gmax = std::max(gmax, std::fabs(r));
    }
    EXPECT_LE(worst, tol * std::max(gmax, 1e-30)) << "row " << n;
  }
  EXPECT_EQ(losses[1], 0.f);
}

TEST(RowwiseEmu, CrossEntropyBf16VectorRowsWithPadding) {
  check_xent<__nv_bfloat16>(5, 1024, 1000, 0, 1e-2f);
}
TEST(RowwiseEmu, CrossEntropyF16ShardNotAMultipleOfTheVector) {
  check_xent<__half>(5, 1003, 997, 2000, 2e-3f);
}
TEST(RowwiseEmu, CrossEntropyF32) {
  check_xent<float>(4, 516, 516, 516, 1e-5f);
}
TEST(RowwiseEmu, CrossEntropyShardWithNoValidColumn) {
  // A tensor-parallel shard holding only padding: max -inf, sum 0; the gradient pass is never
  // run on such a shard alone (the statistics are all-reduced first), so only the first two.
  const int N = 2, V = 16;
  std::vector<uint4> store(V * N * 2 / 16 + 1);
  auto* logits = reinterpret_cast<__nv_bfloat16*>(store.data());
  for (int i = 0; i < N * V; ++i) logits[i] = rw::from_f32<__nv_bfloat16>(1.f);
  std::vector<float> rowmax(N, kNaN), sumexp(N, kNaN), tl(N, kNaN);
  std::vector<int32_t> targets = {3, -1};
  tc::emu::launch(N, 1, rw::kThreads, 64, [&](char* sh) {
    rw::xent_max(rowmax.data(), logits, V, 0, reinterpret_cast<float*>(sh));
  });
  EXPECT_EQ(rowmax[0], -std::numeric_limits<float>::infinity());
  rowmax.assign(N, 0.f);
  tc::emu::launch(N, 1, rw::kThreads, 64, [&](char* sh) {
    rw::xent_sums(sumexp.data(), tl.data(), logits, rowmax.data(), targets.data(), V, 0, 0,
                  reinterpret_cast<float*>(sh));
  });
  EXPECT_EQ(sumexp[0], 0.f);
  EXPECT_EQ(tl[0], 0.f);
}

// LayerNorm (kRms false) or RMSNorm, forward with or without the residual add and the input
// backward, on N rows of C elements of T, against the CPU reference in double on the same rounded
// inputs (for the add: on the sum rounded to T, as the kernel stores it).
int held_checked = 0;  // cases that also ran the held-row kernel

template <typename T, bool kRms>
void check_norm(int64_t N, int64_t C, bool add, float tol) {
  std::mt19937 gen(7 + static_cast<unsigned>(C));
  std::normal_distribution<float> nd(0.f, 1.f);
  auto make = [&](int64_t n, float mu, float sd) {
    std::vector<uint4> st((n * sizeof(T) + 15) / 16 + 1);
    T* p = reinterpret_cast<T*>(st.data());
    for (int64_t i = 0; i < n; ++i) p[i] = rw::from_f32<T>(mu + sd * nd(gen));
    return st;
  };
  auto a_s = make(N * C, 0.5f, 2.f), b_s = make(N * C, 0.f, 1.f), w_s = make(C, 1.f, 0.3f),
       bias_s = make(C, 0.f, 0.3f), dy_s = make(N * C, 0.f, 1.f), dx_s = make(N * C, 0.f, 0.5f);
  auto sum_s = make(N * C, 0.f, 0.f), out_s = make(N * C, 0.f, 0.f);
  auto P = [](std::vector<uint4>& v) { return reinterpret_cast<T*>(v.data()); };
  for (int64_t i = 0; i < N * C; ++i) P(out_s)[i] = rw::from_f32<T>(kNaN);
  const std::vector<T> dx0(P(dx_s), P(dx_s) + N * C);
  ASSERT_TRUE(rw::norm_vec_ok<T>(C, {P(a_s), P(w_s)}));
  std::vector<float> mean(N, kNaN), rstd(N, kNaN);
  const int blocks = static_cast<int>((N + rw::kRowsPerBlock - 1) / rw::kRowsPerBlock);
  const float eps = 1e-5f;
  tc::emu::launch(blocks, 1, rw::kThreads, 0, [&](char*) {
    rw::norm_forward<T, kRms>(P(out_s), kRms ? nullptr : mean.data(), rstd.data(),
                              add ? P(sum_s) : nullptr, P(a_s), add ? P(b_s) : nullptr, P(w_s),
                              kRms ? nullptr : P(bias_s), N, C, eps);
  });
  // The kernel that holds the row in registers (few rows, C within its packs): bitwise the
  // streaming kernel's output, statistics and stored sum.
  if (rw::norm_held_ok<T>(N, C)) {
    auto out2_s = make(N * C, 0.f, 0.f), sum2_s = make(N * C, 0.f, 0.f);
    std::vector<float> mean2(N, kNaN), rstd2(N, kNaN);
    tc::emu::launch(blocks, 1, rw::kThreads, 0, [&](char*) {
      rw::norm_forward<T, kRms, rw::kNormHeldPacks>(
          P(out2_s), kRms ? nullptr : mean2.data(), rstd2.data(), add ? P(sum2_s) : nullptr, P(a_s),
          add ? P(b_s) : nullptr, P(w_s), kRms ? nullptr : P(bias_s), N, C, eps);
    });
    EXPECT_EQ(std::memcmp(P(out2_s), P(out_s), N * C * sizeof(T)), 0) << "held: out";
    if (add) {
      EXPECT_EQ(std::memcmp(P(sum2_s), P(sum_s), N * C * sizeof(T)), 0) << "held: sum";
    }
    EXPECT_EQ(rstd2, rstd) << "held: rstd";
    if (!kRms) {
      EXPECT_EQ(mean2, mean) << "held: mean";
    }
    ++held_checked;
  }
  // The reference's input: a, or a + b rounded to T.
  std::vector<double> x(N * C), w(C), bias(C), dy(N * C), ref_out(N * C), rm(N), rr(N);
  for (int64_t i = 0; i < N * C; ++i) {
    const T xr = add ? rw::from_f32<T>(widen(P(a_s)[i]) + widen(P(b_s)[i])) : P(a_s)[i];
    x[i] = widen(xr);
    if (add) {
      ASSERT_EQ(widen(P(sum_s)[i]), x[i]) << "the stored sum, element " << i;
    }
    dy[i] = widen(P(dy_s)[i]);
  }
  for (int64_t c = 0; c < C; ++c) {
    w[c] = widen(P(w_s)[c]);
    bias[c] = widen(P(bias_s)[c]);
  }
  if (kRms)
    cpu::rmsnorm_forward(ref_out.data(), rr.data(), x.data(), w.data(), N, C, eps);
  else
    cpu::layernorm_forward(ref_out.data(), rm.data(), rr.data(), x.data(), w.data(), bias.data(), N,
                           C, eps);
  double omax = 0, oerr = 0;
  for (int64_t i = 0; i < N * C; ++i) {
    const double o = widen(P(out_s)[i]);
    ASSERT_TRUE(std::isfinite(o)) << "out " << i << " not written";
    omax = std::max(omax, std::fabs(ref_out[i]));
    oerr = std::max(oerr, std::fabs(o - ref_out[i]));
  }
  EXPECT_LE(oerr, tol * omax);
  for (int64_t n = 0; n < N; ++n) {
    if (!kRms) {
      EXPECT_NEAR(mean[n], rm[n], 1e-5 * (1 + std::fabs(rm[n]))) << "row " << n;
    }
    EXPECT_NEAR(rstd[n], rr[n], 1e-4 * rr[n]) << "row " << n;
  }

  // Backward (input part; dinp accumulates into what it holds), with the kernel's statistics.
  tc::emu::launch(blocks, 1, rw::kThreads, 0, [&](char*) {
    rw::norm_backward_input<T, kRms>(P(dx_s), P(dy_s), add ? P(sum_s) : P(a_s), P(w_s),
                                     kRms ? nullptr : mean.data(), rstd.data(), N, C);
  });
  std::vector<double> ref_dx(N * C), dw(C, 0.0), db(C, 0.0), m64(mean.begin(), mean.end()),
      r64(rstd.begin(), rstd.end());
  for (int64_t i = 0; i < N * C; ++i) ref_dx[i] = widen(dx0[i]);
  if (kRms)
    cpu::rmsnorm_backward(ref_dx.data(), dw.data(), dy.data(), x.data(), w.data(), r64.data(), N,
                          C);
  else
    cpu::layernorm_backward(ref_dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                            m64.data(), r64.data(), N, C);
  double gmax = 0, gerr = 0;
  for (int64_t i = 0; i < N * C; ++i) {
    gmax = std::max(gmax, std::fabs(ref_dx[i]));
    gerr = std::max(gerr, std::fabs(widen(P(dx_s)[i]) - ref_dx[i]));
  }
  EXPECT_LE(gerr, tol * gmax);
}

TEST(RowwiseEmu, LayerNormBf16WithAndWithoutTheAdd) {
  check_norm<__nv_bfloat16, false>(11, 768, false, 1e-2f);  // 11 rows: the 2nd block holds 3
  check_norm<__nv_bfloat16, false>(3, 2048, true, 1e-2f);   // 8 vectors per lane
}
TEST(RowwiseEmu, LayerNormF32AndF16) {
  check_norm<float, false>(9, 100, true, 1e-5f);  // 25 vectors: some lanes have none
  check_norm<__half, false>(5, 264, false, 2e-3f);
}
TEST(RowwiseEmu, RmsNormBf16AndF32) {
  check_norm<__nv_bfloat16, true>(10, 2048, true, 1e-2f);
  check_norm<float, true>(4, 36, false, 1e-5f);
}
// The decode step's norms (one row; GPT-2 124M's 768, Llama 3.2 1B's 2048) and a row too wide to
// hold (bf16 4096: the streaming kernel), with and without the add.
TEST(RowwiseEmu, NormsOfFewRowsHeldInRegisters) {
  const int before = held_checked;
  check_norm<__nv_bfloat16, false>(1, 768, true, 1e-2f);
  check_norm<__nv_bfloat16, false>(1, 768, false, 1e-2f);
  check_norm<__half, true>(3, 2048, true, 2e-3f);
  check_norm<float, false>(2, 1024, true, 1e-5f);
  EXPECT_EQ(held_checked - before, 4);
  EXPECT_FALSE(rw::norm_held_ok<__nv_bfloat16>(1, 4096));
  EXPECT_FALSE(rw::norm_held_ok<__nv_bfloat16>(16384, 768));  // training's rows stream
  check_norm<__nv_bfloat16, true>(1, 4096, true, 1e-2f);
  EXPECT_EQ(held_checked - before, 4);
}

// The two stages of a column sum with K = 2 terms per row (LayerNorm's xhat * dy and dy), on
// bf16 inputs; the reference adds the same f32 terms in double.
void check_column_sums(int64_t N, int64_t C) {
  std::mt19937 gen(99 + static_cast<unsigned>(N));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<__nv_bfloat16> x(N * C), dy(N * C);
  std::vector<float> mean(N), rstd(N);
  for (int64_t i = 0; i < N * C; ++i) {
    x[i] = rw::from_f32<__nv_bfloat16>(nd(gen));
    dy[i] = rw::from_f32<__nv_bfloat16>(nd(gen));
  }
  for (int64_t r = 0; r < N; ++r) {
    mean[r] = 0.1f * nd(gen);
    rstd[r] = 1.f + 0.1f * std::fabs(nd(gen));
  }
  const int64_t R = rw::num_chunks(N);
  ASSERT_LE(R, rw::kMaxChunks);
  ASSERT_GE(rw::chunk_rows(N) * R, N);
  std::vector<float> part(2 * R * C, kNaN);
  const int gx = static_cast<int>((C + rw::kThreads - 1) / rw::kThreads);
  tc::emu::launch(gx, static_cast<int>(R), rw::kThreads, 0, [&](char*) {
    rw::column_partials<2>(part.data(), N, C, [&](int64_t r, int64_t c, float* acc) {
      const float d = widen(dy[r * C + c]);
      acc[0] += (widen(x[r * C + c]) - mean[r]) * rstd[r] * d;
      acc[1] += d;
    });
  });
  for (float p : part) ASSERT_FALSE(std::isnan(p)) << "a partial was not written";
  std::vector<float> dw(C, 0.5f), db(C, -0.25f);  // the sums are added to what is there
  for (int k = 0; k < 2; ++k) {
    std::vector<float>& out = k == 0 ? dw : db;
    tc::emu::launch(static_cast<int>((C + 31) / 32), 1, rw::kThreads,
                    rw::kSumPartialsShared * sizeof(float), [&](char* sh) {
                      rw::sum_partials(out.data(), part.data() + k * R * C, R, C,
                                       reinterpret_cast<float*>(sh));
                    });
  }
  for (int64_t c = 0; c < C; ++c) {
    double sw = 0.5, sb = -0.25, aw = 0, ab = 0;
    for (int64_t r = 0; r < N; ++r) {
      const float d = widen(dy[r * C + c]);
      const float t = (widen(x[r * C + c]) - mean[r]) * rstd[r] * d;
      sw += t;
      sb += d;
      aw += std::fabs(t);
      ab += std::fabs(d);
    }
    EXPECT_NEAR(dw[c], sw, 1e-5 * (aw + 1)) << "column " << c;
    EXPECT_NEAR(db[c], sb, 1e-5 * (ab + 1)) << "column " << c;
  }
}

TEST(RowwiseEmu, ColumnSumsPartialChunkAndColumnBlock) {
  check_column_sums(100, 300);
}
TEST(RowwiseEmu, ColumnSumsMoreRowsThanTheChunkCap) {
  // 512 chunks of 32 rows hold 16,384: 16,389 rows need chunks of 33.
  EXPECT_EQ(rw::chunk_rows(16384), 32);
  EXPECT_EQ(rw::num_chunks(16384), 512);
  EXPECT_EQ(rw::chunk_rows(16389), 33);
  check_column_sums(16389, 3);
}
TEST(RowwiseEmu, ColumnSumsAreDeterministic) {
  // Same inputs, same bits: the order of every addition is fixed by the shapes.
  const int64_t N = 70, C = 40;
  std::vector<float> x(N * C);
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& v : x) v = nd(gen);
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    const int64_t R = rw::num_chunks(N);
    std::vector<float> part(R * C), out(C, 0.f);
    tc::emu::launch(1, static_cast<int>(R), rw::kThreads, 0, [&](char*) {
      rw::column_partials<1>(part.data(), N, C,
                             [&](int64_t r, int64_t c, float* acc) { acc[0] += x[r * C + c]; });
    });
    tc::emu::launch(2, 1, rw::kThreads, rw::kSumPartialsShared * sizeof(float), [&](char* sh) {
      rw::sum_partials(out.data(), part.data(), R, C, reinterpret_cast<float*>(sh));
    });
    if (run == 0)
      first = out;
    else
      for (int64_t c = 0; c < C; ++c) EXPECT_EQ(out[c], first[c]);
  }
}

// The emulator itself (warp_emu.hpp): its threads are fibers run in a fixed order, each until it
// waits at a barrier. A read of another thread's shared-memory write without the barrier between
// them sees the NaN fill (thread 0 runs to its barrier before thread 1 writes); with the barrier
// it sees the value. Threads waiting at a barrier that returned threads never reach end the test
// with a message (a hang with one OS thread per CUDA thread).
TEST(WarpEmu, AReadWithoutItsBarrierSeesUnwrittenSharedMemory) {
  for (const bool barrier : {false, true}) {
    std::vector<float> got(64);
    tc::emu::launch(1, 1, 64, 64 * sizeof(float), [&](char* sh) {
      float* s = reinterpret_cast<float*>(sh);
      const int t = tc::thread_id();
      s[t] = static_cast<float>(t);
      if (barrier) tc::sync_block();
      got[t] = s[(t + 1) % 64];
    });
    for (int t = 0; t < 64; ++t) {
      if (barrier) {
        EXPECT_EQ(got[t], static_cast<float>((t + 1) % 64)) << t;
      } else if (t < 63) {  // the last thread reads thread 0's value, written before it ran
        EXPECT_TRUE(std::isnan(got[t])) << t << ": " << got[t];
      }
    }
  }
}
TEST(WarpEmuDeathTest, ABarrierThatReturnedThreadsNeverReachIsAnErrorNotAHang) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(tc::emu::launch(2, 1, 64, 0,
                               [&](char*) {
                                 if (tc::block_x() == 1 && tc::thread_id() == 5) return;
                                 tc::sync_block();
                               }),
               "deadlock: thread [0-9]+ of block \\(1, 0\\) waits at a block barrier");
  EXPECT_DEATH(tc::emu::launch(1, 1, 64, 0,
                               [&](char*) {
                                 if (tc::thread_id() % 32 < 16) return;
                                 rw::warp_sum(1.f);
                               }),
               "waits at a warp barrier");
}

}  // namespace
