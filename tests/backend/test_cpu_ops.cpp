// test_cpu_ops.cpp: the CPU kernels (backend/cpu/*.hpp) against finite differences, hand-computed
// values and naive references, mostly instantiated in double.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/attention.hpp"
#include "backend/cpu/cross_entropy.hpp"
#include "backend/cpu/dropout.hpp"
#include "backend/cpu/embedding.hpp"
#include "backend/cpu/gelu.hpp"
#include "backend/cpu/layernorm.hpp"
#include "backend/cpu/matmul.hpp"
#include "backend/cpu/optim.hpp"
#include "backend/cpu/rmsnorm.hpp"
#include "backend/cpu/rope.hpp"
#include "backend/cpu/swiglu.hpp"

namespace cpu = tessera::cpu;
using tessera::AttentionDropout;
using tessera::dropout_multiplier;
using tessera::dropout_multiplier2;
using tessera::DropoutKind;
using tessera::DropoutSpec;
using tessera::make_dropout_spec;

namespace {

using Vec = std::vector<double>;

// ---- helpers
// -------------------------------------------------------------------------------------

// Central-difference step and the tolerances used for every finite-difference gradient check.
constexpr double kFdEps = 1e-6;
constexpr double kFdRtol = 1e-6;
constexpr double kFdAtol = 1e-8;

Vec random_vec(size_t n, std::mt19937_64& gen, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (double& x : v) x = dist(gen);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

Vec add(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

std::vector<size_t> all_indices(size_t n) {
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  return idx;
}

// Central-difference gradient of the scalar loss() with respect to x[i] for i in `indices` (other
// entries are 0). x is perturbed in place and restored exactly.
template <typename F>
Vec numeric_grad(Vec& x, F&& loss, const std::vector<size_t>& indices, double eps = kFdEps) {
  Vec g(x.size(), 0.0);
  for (size_t i : indices) {
    const double x0 = x[i], xp = x0 + eps, xm = x0 - eps;
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = x0;
    g[i] = (lp - lm) / (xp - xm);
  }
  return g;
}

template <typename F>
Vec numeric_grad(Vec& x, F&& loss, double eps = kFdEps) {
  return numeric_grad(x, loss, all_indices(x.size()), eps);
}

// Element-wise |actual - expected| <= atol + rtol * |expected| (NaN fails); reports the first few.
void expect_all_close(const Vec& actual, const Vec& expected, double rtol, double atol,
                      const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    if (!(std::fabs(a - e) <= atol + rtol * std::fabs(e))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << a << ", expected " << e << " (diff "
                    << a - e << ")";
      if (++failures >= 8) return;
    }
  }
}

void expect_fd_close(const Vec& actual, const Vec& expected, const std::string& what) {
  expect_all_close(actual, expected, kFdRtol, kFdAtol, what);
}

// Restores omp_get_max_threads() when a test changes it.
struct OmpThreadsGuard {
  int saved = omp_get_max_threads();
  ~OmpThreadsGuard() { omp_set_num_threads(saved); }
};

// ---- matmul
// --------------------------------------------------------------------------------------

TEST(CpuMatmul, ForwardMatchesNaive) {
  std::mt19937_64 gen(1);
  const int64_t N = 7, IC = 13, OC = 11;
  const Vec inp = random_vec(N * IC, gen), w = random_vec(OC * IC, gen), b = random_vec(OC, gen);
  for (bool with_bias : {true, false}) {
    Vec out(N * OC, 123.0), ref(N * OC);
    cpu::matmul_forward(out.data(), inp.data(), w.data(), with_bias ? b.data() : nullptr, N, IC,
                        OC);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        double s = with_bias ? b[o] : 0.0;
        for (int64_t i = 0; i < IC; ++i) s += inp[n * IC + i] * w[o * IC + i];
        ref[n * OC + o] = s;
      }
    expect_all_close(out, ref, 1e-13, 1e-13, with_bias ? "out(bias)" : "out(no bias)");
  }
}

TEST(CpuMatmul, BackwardFiniteDifference) {
  std::mt19937_64 gen(2);
  const int64_t N = 7, IC = 13, OC = 11;
  Vec inp = random_vec(N * IC, gen), w = random_vec(OC * IC, gen), b = random_vec(OC, gen);
  const Vec R = random_vec(N * OC, gen);  // L = sum(out * R), so dout = R
  auto loss = [&] {
    Vec out(N * OC);
    cpu::matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, IC, OC);
    return dot(out, R);
  };
  const Vec dinp_fd = numeric_grad(inp, loss);
  const Vec dw_fd = numeric_grad(w, loss);
  const Vec db_fd = numeric_grad(b, loss);

  // dinp is overwritten (start it from junk); dweight and dbias accumulate onto a known base.
  Vec dinp = random_vec(N * IC, gen, 50.0, 100.0);
  const Vec dw0 = random_vec(OC * IC, gen), db0 = random_vec(OC, gen);
  Vec dw = dw0, db = db0;
  cpu::matmul_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), N, IC,
                       OC);
  expect_fd_close(dinp, dinp_fd, "dinp");
  expect_fd_close(dw, add(dw0, dw_fd), "dweight");
  expect_fd_close(db, add(db0, db_fd), "dbias");

  // Null dinp and dbias are skipped; dweight accumulates a second time.
  cpu::matmul_backward<double>(nullptr, dw.data(), nullptr, R.data(), inp.data(), w.data(), N, IC,
                               OC);
  expect_fd_close(dw, add(dw0, add(dw_fd, dw_fd)), "dweight (second accumulation)");
}

// ---- layernorm
// -----------------------------------------------------------------------------------

TEST(CpuLayernorm, ForwardHandComputed) {
  const Vec x = {1, 2, 3, 4}, w = {1, 1, 1, 1}, b = {0, 0, 0, 0};
  Vec out(4), mean(1), rstd(1);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), 1, 4,
                         1e-5);
  const double s = 1.0 / std::sqrt(1.25 + 1e-5);
  EXPECT_NEAR(mean[0], 2.5, 1e-15);
  EXPECT_NEAR(rstd[0], s, 1e-14);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], (x[i] - 2.5) * s, 1e-14) << "i=" << i;
  EXPECT_NEAR(out[0], -1.3416354199689269, 1e-12);  // (1 - 2.5) / sqrt(1.25001)
}

TEST(CpuLayernorm, BackwardFiniteDifferenceAccumulates) {
  std::mt19937_64 gen(3);
  const int64_t N = 7, C = 13;
  const double eps = 1e-5;
  Vec inp = random_vec(N * C, gen, -2.0, 2.0), w = random_vec(C, gen, 0.5, 1.5),
      b = random_vec(C, gen);
  const Vec R = random_vec(N * C, gen);
  auto loss = [&] {
    Vec out(N * C), mean(N), rstd(N);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N,
                           C, eps);
    return dot(out, R);
  };
  const Vec dinp_fd = numeric_grad(inp, loss);
  const Vec dw_fd = numeric_grad(w, loss);
  const Vec db_fd = numeric_grad(b, loss);

  Vec out(N * C), mean(N), rstd(N);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C,
                         eps);
  // All three gradients accumulate: start them from known random buffers.
  const Vec dinp0 = random_vec(N * C, gen), dw0 = random_vec(C, gen), db0 = random_vec(C, gen);
  Vec dinp = dinp0, dw = dw0, db = db0;
  cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(),
                          mean.data(), rstd.data(), N, C);
  expect_fd_close(dinp, add(dinp0, dinp_fd), "dinp");
  expect_fd_close(dw, add(dw0, dw_fd), "dweight");
  expect_fd_close(db, add(db0, db_fd), "dbias");
}

// ---- gelu
// ----------------------------------------------------------------------------------------

TEST(CpuGelu, ForwardHandComputed) {
  const Vec x = {1.0, -0.5};
  Vec out(2);
  cpu::gelu_forward(out.data(), x.data(), 2);
  EXPECT_NEAR(out[0], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(out[1], -0.15428599017485606, 1e-15);

  const std::vector<float> xf = {1.0f, -0.5f};
  std::vector<float> outf(2);
  cpu::gelu_forward(outf.data(), xf.data(), 2);
  EXPECT_NEAR(outf[0], 0.8411919906082768, 1e-6);
  EXPECT_NEAR(outf[1], -0.15428599017485606, 1e-6);
}

TEST(CpuGelu, BackwardFiniteDifference) {
  std::mt19937_64 gen(4);
  const int64_t N = 37;
  Vec x = random_vec(N, gen, -4.0, 4.0);
  const Vec R = random_vec(N, gen);
  auto loss = [&] {
    Vec out(N);
    cpu::gelu_forward(out.data(), x.data(), N);
    return dot(out, R);
  };
  const Vec dx_fd = numeric_grad(x, loss);

  Vec dx(N, 77.0);  // overwritten
  cpu::gelu_backward(dx.data(), x.data(), R.data(), N);
  expect_fd_close(dx, dx_fd, "dinp");

  // dinp may alias dout.
  Vec inplace = R;
  cpu::gelu_backward(inplace.data(), x.data(), inplace.data(), N);
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(inplace[i], dx[i]) << "i=" << i;
}

// Squared ReLU (--squared-relu): max(x, 0)^2 by hand, its derivative 2 max(x, 0) by finite
// differences (away from the kink at 0), in place.
TEST(CpuSquaredRelu, ForwardHandComputedAndBackwardFiniteDifference) {
  {
    const Vec x = {1.5, -0.5, 0.0, 3.0};
    Vec out(4);
    cpu::squared_relu_forward(out.data(), x.data(), 4);
    EXPECT_EQ(out, (Vec{2.25, 0.0, 0.0, 9.0}));
  }
  std::mt19937_64 gen(14);
  const int64_t N = 41;
  Vec x = random_vec(N, gen, -3.0, 3.0);
  for (double& v : x)
    if (std::fabs(v) < 1e-3) v = 0.5;  // no finite difference across the kink
  const Vec R = random_vec(N, gen);
  auto loss = [&] {
    Vec out(N);
    cpu::squared_relu_forward(out.data(), x.data(), N);
    return dot(out, R);
  };
  const Vec dx_fd = numeric_grad(x, loss);
  Vec dx(N, 77.0);  // overwritten
  cpu::squared_relu_backward(dx.data(), x.data(), R.data(), N);
  expect_fd_close(dx, dx_fd, "dinp");
  int negative = 0;
  for (int64_t i = 0; i < N; ++i)
    if (x[i] < 0) {
      EXPECT_EQ(dx[i], 0.0) << "i=" << i;
      ++negative;
    }
  EXPECT_GT(negative, 5);
  Vec inplace = R;  // dinp may alias dout
  cpu::squared_relu_backward(inplace.data(), x.data(), inplace.data(), N);
  EXPECT_EQ(inplace, dx);
}

// ---- the Llama family: RMSNorm, SwiGLU, RoPE
// ----------------------------------------------------------

TEST(CpuRmsnorm, ForwardHandComputedAndBackwardFiniteDifference) {
  {  // x = (3, 4): mean square 12.5, rstd = 1/sqrt(12.5 + eps)
    const Vec x = {3.0, 4.0}, w = {1.0, 2.0};
    Vec out(2), rstd(1);
    cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), 1, 2, 0.0);
    EXPECT_NEAR(rstd[0], 1 / std::sqrt(12.5), 1e-15);
    EXPECT_NEAR(out[0], 3 / std::sqrt(12.5), 1e-15);
    EXPECT_NEAR(out[1], 8 / std::sqrt(12.5), 1e-15);
  }
  std::mt19937_64 gen(5);
  const int64_t N = 7, C = 13;
  const double eps = 1e-5;
  Vec inp = random_vec(N * C, gen, -2.0, 2.0), w = random_vec(C, gen, 0.5, 1.5);
  const Vec R = random_vec(N * C, gen);
  auto loss = [&] {
    Vec out(N * C), rstd(N);
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
    return dot(out, R);
  };
  const Vec dinp_fd = numeric_grad(inp, loss);
  const Vec dw_fd = numeric_grad(w, loss);
  Vec out(N * C), rstd(N);
  cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
  const Vec dinp0 = random_vec(N * C, gen), dw0 = random_vec(C, gen);  // both accumulate
  Vec dinp = dinp0, dw = dw0;
  cpu::rmsnorm_backward(dinp.data(), dw.data(), R.data(), inp.data(), w.data(), rstd.data(), N, C);
  expect_fd_close(dinp, add(dinp0, dinp_fd), "dinp");
  expect_fd_close(dw, add(dw0, dw_fd), "dweight");
}

TEST(CpuSwiglu, ForwardHandComputedAndBackwardFiniteDifference) {
  {  // gate 1, up 2: silu(1) * 2 = 2 / (1 + e^-1)
    const Vec x = {1.0, 2.0};
    Vec out(1);
    cpu::swiglu_forward(out.data(), x.data(), 1, 1);
    EXPECT_NEAR(out[0], 2 / (1 + std::exp(-1.0)), 1e-15);
  }
  std::mt19937_64 gen(6);
  const int64_t N = 5, F = 9;
  Vec inp = random_vec(N * 2 * F, gen, -4.0, 4.0);
  const Vec R = random_vec(N * F, gen);
  auto loss = [&] {
    Vec out(N * F);
    cpu::swiglu_forward(out.data(), inp.data(), N, F);
    return dot(out, R);
  };
  const Vec dinp_fd = numeric_grad(inp, loss);
  Vec dinp(N * 2 * F, 77.0);  // overwritten
  cpu::swiglu_backward(dinp.data(), inp.data(), R.data(), N, F);
  expect_fd_close(dinp, dinp_fd, "dinp");
}

// RoPE against the rotation written out per pair, its inverse, and its backward (the transpose
// of a rotation is its inverse) by finite differences; values and features past rot_dim stay.
TEST(CpuRope, RotatesPairsInvertsAndHasTransposeBackward) {
  std::mt19937_64 gen(7);
  const int64_t B = 2, T = 5, H = 4, G = 2, hd = 8, N = B * T, C3 = (H + 2 * G) * hd;
  for (const int64_t rot : {int64_t(8), int64_t(4)}) {
    SCOPED_TRACE("rot_dim " + std::to_string(rot));
    const double base = 500000;
    const Vec x0 = random_vec(N * C3, gen);
    Vec x = x0;
    cpu::rope(x.data(), N, H, G, hd, rot, base, nullptr, T, false);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t h = 0; h < H + 2 * G; ++h)
        for (int64_t i = 0; i < hd; ++i) {
          const int64_t at = r * C3 + h * hd + i;
          double want = x0[at];
          if (h < H + G && i < rot) {
            const int64_t k = i % (rot / 2);
            const double a = static_cast<double>(r % T) * std::pow(base, -2.0 * k / rot);
            const double x1 = x0[r * C3 + h * hd + k], x2 = x0[r * C3 + h * hd + k + rot / 2];
            want = i < rot / 2 ? x1 * std::cos(a) - x2 * std::sin(a)
                               : x2 * std::cos(a) + x1 * std::sin(a);
          }
          ASSERT_NEAR(x[at], want, 1e-6) << "row " << r << " head " << h << " feature " << i;
        }
    // Given positions: the same as the implicit r % T.
    std::vector<int32_t> pos(N);
    for (int64_t r = 0; r < N; ++r) pos[r] = static_cast<int32_t>(r % T);
    Vec y = x0;
    cpu::rope(y.data(), N, H, G, hd, rot, base, pos.data(), 0, false);
    EXPECT_EQ(y, x);
    cpu::rope(y.data(), N, H, G, hd, rot, base, pos.data(), 0, true);
    expect_all_close(y, x0, 0, 1e-12, "inverse");
    // Backward: d/dx <rope(x), R> = rope^-1(R).
    const Vec R = random_vec(N * C3, gen);
    Vec xin = x0;
    auto loss = [&] {
      Vec z = xin;
      cpu::rope(z.data(), N, H, G, hd, rot, base, nullptr, T, false);
      return dot(z, R);
    };
    const Vec fd = numeric_grad(xin, loss);
    Vec back = R;
    cpu::rope(back.data(), N, H, G, hd, rot, base, nullptr, T, true);
    expect_fd_close(back, fd, "rope backward");
  }
}

// Interleaved RoPE (--rotary-interleaved): pair k is features (2k, 2k+1) with the angle of pair k
// of the halves convention, written out per pair; the inverse undoes it; and it is the halves
// rotation of the head with its features permuted (2k -> k, 2k+1 -> k + rot/2).
TEST(CpuRope, InterleavedRotatesAdjacentPairs) {
  std::mt19937_64 gen(17);
  const int64_t T = 6, H = 2, G = 1, hd = 8, N = T, C3 = (H + 2 * G) * hd;
  for (const int64_t rot : {int64_t(8), int64_t(4)}) {
    SCOPED_TRACE("rot_dim " + std::to_string(rot));
    const double base = 100;
    const Vec x0 = random_vec(N * C3, gen);
    Vec x = x0;
    cpu::rope(x.data(), N, H, G, hd, rot, base, nullptr, T, false, {}, true);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t h = 0; h < H + 2 * G; ++h)
        for (int64_t i = 0; i < hd; ++i) {
          const int64_t at = r * C3 + h * hd + i;
          double want = x0[at];
          if (h < H + G && i < rot) {
            const int64_t k = i / 2;
            const double a = static_cast<double>(r) * std::pow(base, -2.0 * k / rot);
            const double x1 = x0[r * C3 + h * hd + 2 * k], x2 = x0[r * C3 + h * hd + 2 * k + 1];
            want = i % 2 == 0 ? x1 * std::cos(a) - x2 * std::sin(a)
                              : x2 * std::cos(a) + x1 * std::sin(a);
          }
          ASSERT_NEAR(x[at], want, 1e-6) << "row " << r << " head " << h << " feature " << i;
        }
    // The permutation: halves RoPE of the permuted head, permuted back.
    Vec perm(N * C3), halves;
    auto to_halves = [&](int64_t i) { return i < rot ? (i % 2 ? i / 2 + rot / 2 : i / 2) : i; };
    for (int64_t r = 0; r < N; ++r)
      for (int64_t h = 0; h < H + 2 * G; ++h)
        for (int64_t i = 0; i < hd; ++i)
          perm[r * C3 + h * hd + to_halves(i)] = x0[r * C3 + h * hd + i];
    halves = perm;
    cpu::rope(halves.data(), N, H, G, hd, rot, base, nullptr, T, false);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t h = 0; h < H + 2 * G; ++h)
        for (int64_t i = 0; i < hd; ++i)
          ASSERT_NEAR(x[r * C3 + h * hd + i], halves[r * C3 + h * hd + to_halves(i)], 1e-12);
    cpu::rope(x.data(), N, H, G, hd, rot, base, nullptr, T, true, {}, true);
    expect_all_close(x, x0, 0, 1e-12, "inverse");
  }
}

// Grouped-query attention equals multi-head attention with each key/value head repeated for its
// group's query heads; its key/value gradients are the group sums of the repeated ones.
TEST(CpuAttention, GroupedQueryEqualsRepeatedKeyValueHeads) {
  std::mt19937_64 gen(8);
  const int64_t B = 2, T = 70, H = 6, hd = 5;  // T > 64: the backward crosses row blocks
  for (const int64_t G : {int64_t(3), int64_t(1)}) {
    SCOPED_TRACE("G=" + std::to_string(G));
    const int64_t R = H / G, Cg = (H + 2 * G) * hd, C3 = 3 * H * hd;
    const Vec qkv = random_vec(B * T * Cg, gen);
    Vec full(B * T * C3);  // [q H | k H | v H], k and v heads repeated
    for (int64_t bt = 0; bt < B * T; ++bt)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < hd; ++d) {
          const int64_t g = h / R;
          full[bt * C3 + h * hd + d] = qkv[bt * Cg + h * hd + d];
          full[bt * C3 + (H + h) * hd + d] = qkv[bt * Cg + (H + g) * hd + d];
          full[bt * C3 + (2 * H + h) * hd + d] = qkv[bt * Cg + (H + G + g) * hd + d];
        }
    Vec scratch(cpu::attention_scratch_elems(T));
    Vec out(B * T * H * hd), lse(B * H * T), out_f(out.size()), lse_f(lse.size());
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, hd, scratch.data(), nullptr,
                           G);
    cpu::attention_forward(out_f.data(), lse_f.data(), full.data(), B, T, H, hd, scratch.data());
    expect_all_close(out, out_f, 0, 1e-12, "out");
    expect_all_close(lse, lse_f, 0, 1e-12, "lse");
    const Vec dout = random_vec(out.size(), gen);
    Vec dqkv(qkv.size(), 77.0), dfull(full.size(), 77.0);
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H,
                            hd, scratch.data(), nullptr, G);
    cpu::attention_backward(dfull.data(), dout.data(), full.data(), out_f.data(), lse_f.data(), B,
                            T, H, hd, scratch.data());
    Vec want(qkv.size(), 0.0);
    for (int64_t bt = 0; bt < B * T; ++bt)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < hd; ++d) {
          const int64_t g = h / R;
          want[bt * Cg + h * hd + d] = dfull[bt * C3 + h * hd + d];
          want[bt * Cg + (H + g) * hd + d] += dfull[bt * C3 + (H + h) * hd + d];
          want[bt * Cg + (H + G + g) * hd + d] += dfull[bt * C3 + (2 * H + h) * hd + d];
        }
    expect_all_close(dqkv, want, 0, 1e-11, "dqkv");
  }
}

// ---- embeddings
// ----------------------------------------------------------------------------------

// A shard holding global rows [row_begin, row_begin + rows); ids include ones below and above it,
// and repeats.
constexpr int64_t kShardBegin = 5, kShardRows = 9;
const std::vector<int32_t> kShardIds = {7, 0, 13, 5, 14, 7, 20, 9, 4, 13, 7, 6, 30};

TEST(CpuEmbedding, ForwardShardLookup) {
  std::mt19937_64 gen(5);
  const int64_t N = static_cast<int64_t>(kShardIds.size()), C = 13;
  const Vec table = random_vec(kShardRows * C, gen);
  Vec out(N * C, 9.0);
  cpu::embedding_forward(out.data(), kShardIds.data(), table.data(), N, C, kShardBegin, kShardRows);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = kShardIds[n] - kShardBegin;
    const bool inside = r >= 0 && r < kShardRows;
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(out[n * C + c], inside ? table[r * C + c] : 0.0) << "n=" << n << " c=" << c;
  }
}

TEST(CpuEmbedding, BackwardFiniteDifferenceShard) {
  // C = 13 is one 16-channel block of the backward; C = 37 has two full blocks and a ragged one.
  for (int64_t C : {13, 37}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    std::mt19937_64 gen(6 + C);
    const int64_t N = static_cast<int64_t>(kShardIds.size());
    Vec table = random_vec(kShardRows * C, gen);
    const Vec R = random_vec(N * C, gen);
    auto loss = [&] {
      Vec out(N * C);
      cpu::embedding_forward(out.data(), kShardIds.data(), table.data(), N, C, kShardBegin,
                             kShardRows);
      return dot(out, R);
    };
    const Vec dt_fd = numeric_grad(table, loss);

    const Vec dt0 = random_vec(kShardRows * C, gen);
    Vec dt = dt0;
    cpu::embedding_backward(dt.data(), R.data(), kShardIds.data(), N, C, kShardBegin, kShardRows);
    expect_fd_close(dt, add(dt0, dt_fd), "dtable");

    // Exact scatter: out-of-shard ids contribute nothing; rows nobody references stay bit-equal.
    Vec ref = dt0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t r = kShardIds[n] - kShardBegin;
      if (r < 0 || r >= kShardRows) continue;
      for (int64_t c = 0; c < C; ++c) ref[r * C + c] += R[n * C + c];
    }
    for (size_t i = 0; i < dt.size(); ++i) EXPECT_EQ(dt[i], ref[i]) << "i=" << i;
    for (int64_t r : {3, 6, 7}) {  // global ids 8, 11, 12 are not in kShardIds
      for (int64_t c = 0; c < C; ++c) EXPECT_EQ(dt[r * C + c], dt0[r * C + c]) << "row " << r;
    }
  }
}

TEST(CpuPositionEmbedding, ForwardAddsPositionRows) {
  std::mt19937_64 gen(7);
  const int64_t B = 2, T = 11, C = 13;
  const Vec wpe = random_vec((T + 2) * C, gen), x = random_vec(B * T * C, gen);
  Vec out = x;
  cpu::position_embedding_forward(out.data(), wpe.data(), B, T, C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (b * T + t) * C + c;
        EXPECT_EQ(out[i], x[i] + wpe[t * C + c]) << "b=" << b << " t=" << t << " c=" << c;
      }
}

TEST(CpuPositionEmbedding, BackwardFiniteDifference) {
  std::mt19937_64 gen(8);
  const int64_t B = 2, T = 11, C = 13, Tmax = T + 2;  // rows T.. of wpe are unused
  Vec wpe = random_vec(Tmax * C, gen);
  const Vec x = random_vec(B * T * C, gen), R = random_vec(B * T * C, gen);
  auto loss = [&] {
    Vec out = x;
    cpu::position_embedding_forward(out.data(), wpe.data(), B, T, C);
    return dot(out, R);
  };
  const Vec dwpe_fd = numeric_grad(wpe, loss);

  const Vec dwpe0 = random_vec(Tmax * C, gen);
  Vec dwpe = dwpe0;
  cpu::position_embedding_backward(dwpe.data(), R.data(), B, T, C);
  expect_fd_close(dwpe, add(dwpe0, dwpe_fd), "dwpe");
  for (int64_t i = T * C; i < Tmax * C; ++i) EXPECT_EQ(dwpe[i], dwpe0[i]) << "unused row, i=" << i;
}

// ---- attention
// -----------------------------------------------------------------------------------

// Forward through the flash-style kernel with freshly sized scratch. qkv (B,T,3,NH,hd).
template <typename T>
void run_attention_forward(std::vector<T>& out, std::vector<T>& lse, const std::vector<T>& qkv,
                           int64_t B, int64_t Tn, int64_t NH, int64_t hd,
                           const AttentionDropout* drop = nullptr) {
  out.assign(B * Tn * NH * hd, T(0));
  lse.assign(B * NH * Tn, T(0));
  std::vector<T> scratch(cpu::attention_scratch_elems(Tn));
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, Tn, NH, hd, scratch.data(), drop);
}

// Naive causal attention with an explicit T x T score matrix per (batch, head); with `drop`, each
// probability times its mask multiplier (drawn element by element, by global index).
void naive_attention(Vec& out, Vec& lse, const Vec& qkv, int64_t B, int64_t Tn, int64_t NH,
                     int64_t hd, const AttentionDropout* drop = nullptr) {
  const int64_t C = NH * hd, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  out.assign(B * Tn * C, 0.0);
  lse.assign(B * NH * Tn, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      auto q = [&](int64_t t, int64_t d) { return qkv[(b * Tn + t) * C3 + h * hd + d]; };
      auto k = [&](int64_t t, int64_t d) { return qkv[(b * Tn + t) * C3 + C + h * hd + d]; };
      auto v = [&](int64_t t, int64_t d) { return qkv[(b * Tn + t) * C3 + 2 * C + h * hd + d]; };
      Vec S(Tn * Tn, -INFINITY);
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t j = 0; j <= t; ++j) {
          double s = 0;
          for (int64_t d = 0; d < hd; ++d) s += q(t, d) * k(j, d);
          S[t * Tn + j] = s * scale;
        }
      for (int64_t t = 0; t < Tn; ++t) {
        double m = -INFINITY;
        for (int64_t j = 0; j < Tn; ++j) m = std::max(m, S[t * Tn + j]);
        double sum = 0;
        for (int64_t j = 0; j < Tn; ++j) sum += std::exp(S[t * Tn + j] - m);  // exp(-inf) = 0
        lse[(b * NH + h) * Tn + t] = m + std::log(sum);
        for (int64_t d = 0; d < hd; ++d) {
          double o = 0;
          for (int64_t j = 0; j < Tn; ++j) {
            const double mul = drop && j <= t ? drop->multiplier(b, h, t, j, Tn) : 1.0;
            o += std::exp(S[t * Tn + j] - m) / sum * mul * v(j, d);
          }
          out[(b * Tn + t) * C + h * hd + d] = o;
        }
      }
    }
}

TEST(CpuAttention, ForwardHandComputedT2) {
  // B=1, T=2, one head, head_dim 1 (scale 1); row t of qkv is [q_t, k_t, v_t].
  const double q0 = 0.3, k0 = 0.7, v0 = 2.0, q1 = 0.5, k1 = -0.4, v1 = -1.0;
  const Vec qkv = {q0, k0, v0, q1, k1, v1};
  Vec out, lse;
  run_attention_forward(out, lse, qkv, 1, 2, 1, 1);
  // Row 0 sees only itself.
  EXPECT_NEAR(out[0], v0, 1e-15);
  EXPECT_NEAR(lse[0], q0 * k0, 1e-15);
  // Row 1: softmax over s10 = q1*k0 = 0.35 and s11 = q1*k1 = -0.2.
  const double e0 = std::exp(0.35), e1 = std::exp(-0.2);
  EXPECT_NEAR(out[1], (e0 * v0 + e1 * v1) / (e0 + e1), 1e-14);
  EXPECT_NEAR(out[1], 0.9024067730324021, 1e-12);  // (e^.35 * 2 - e^-.2) / (e^.35 + e^-.2)
  EXPECT_NEAR(lse[1], std::log(e0 + e1), 1e-14);
}

struct AttnShape {
  int64_t B, T, NH, hd;
};

// Odd sizes, plus T at and beyond the 64-row block so several row blocks (and a ragged last one)
// are exercised.
const std::vector<AttnShape> kAttnShapes = {
    {2, 11, 3, 5}, {1, 1, 2, 3}, {1, 64, 1, 4}, {1, 67, 3, 5}, {2, 130, 2, 7}};

TEST(CpuAttention, ForwardMatchesNaiveReference) {
  for (const AttnShape& s : kAttnShapes) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                 " NH=" + std::to_string(s.NH) + " hd=" + std::to_string(s.hd));
    std::mt19937_64 gen(10 + s.T);
    const Vec qkv = random_vec(s.B * s.T * 3 * s.NH * s.hd, gen, -2.0, 2.0);
    Vec out, lse, ref_out, ref_lse;
    run_attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.hd);
    naive_attention(ref_out, ref_lse, qkv, s.B, s.T, s.NH, s.hd);
    expect_all_close(out, ref_out, 1e-12, 1e-13, "out");
    expect_all_close(lse, ref_lse, 1e-12, 1e-13, "lse");
  }
}

TEST(CpuAttention, FloatMatchesDouble) {
  for (const AttnShape& s : kAttnShapes) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T));
    std::mt19937_64 gen(20 + s.T);
    const Vec qkv = random_vec(s.B * s.T * 3 * s.NH * s.hd, gen);
    const std::vector<float> qkvf(qkv.begin(), qkv.end());
    Vec out, lse;
    std::vector<float> outf, lsef;
    run_attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.hd);
    run_attention_forward(outf, lsef, qkvf, s.B, s.T, s.NH, s.hd);
    expect_all_close(Vec(outf.begin(), outf.end()), out, 0.0, 1e-5, "out float vs double");
    expect_all_close(Vec(lsef.begin(), lsef.end()), lse, 0.0, 1e-5, "lse float vs double");
  }
}

TEST(CpuAttention, BackwardFiniteDifference) {
  // One small case, and one with T > 64 so the backward crosses row blocks.
  for (const AttnShape& s : {AttnShape{2, 11, 3, 5}, AttnShape{1, 67, 2, 3}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T));
    std::mt19937_64 gen(30 + s.T);
    const int64_t C = s.NH * s.hd;
    Vec qkv = random_vec(s.B * s.T * 3 * C, gen);
    const Vec R = random_vec(s.B * s.T * C, gen);
    auto loss = [&] {
      Vec out, lse;
      run_attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.hd);
      return dot(out, R);
    };
    const Vec dqkv_fd = numeric_grad(qkv, loss);

    Vec out, lse;
    run_attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.hd);
    Vec dqkv = random_vec(qkv.size(), gen, 50.0, 100.0);  // overwritten: start from junk
    Vec scratch(cpu::attention_scratch_elems(s.T));
    cpu::attention_backward(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), s.B, s.T,
                            s.NH, s.hd, scratch.data());
    // Split into dq, dk, dv for clearer failure messages.
    Vec got[3], want[3];
    for (int64_t bt = 0; bt < s.B * s.T; ++bt)
      for (int part = 0; part < 3; ++part)
        for (int64_t c = 0; c < C; ++c) {
          got[part].push_back(dqkv[bt * 3 * C + part * C + c]);
          want[part].push_back(dqkv_fd[bt * 3 * C + part * C + c]);
        }
    expect_fd_close(got[0], want[0], "dq");
    expect_fd_close(got[1], want[1], "dk");
    expect_fd_close(got[2], want[2], "dv");
  }
}

// Attention dropout (p = 0.3, heads placed as on TP rank 1 of 2): the forward against the naive
// one with the same mask, the backward against finite differences with the mask held fixed.
TEST(CpuAttention, DropoutForwardAndBackward) {
  for (const AttnShape& s : {AttnShape{2, 11, 3, 5}, AttnShape{1, 67, 2, 3}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T));
    AttentionDropout drop;
    drop.spec = make_dropout_spec(0.3, 42, 7, 1, DropoutKind::Attention, 100);
    drop.head_begin = s.NH;
    drop.heads_total = 2 * s.NH;
    std::mt19937_64 gen(40 + s.T);
    const int64_t C = s.NH * s.hd;
    Vec qkv = random_vec(s.B * s.T * 3 * C, gen);
    const Vec R = random_vec(s.B * s.T * C, gen);
    Vec out, lse, ref_out, ref_lse, plain, plain_lse;
    run_attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.hd, &drop);
    naive_attention(ref_out, ref_lse, qkv, s.B, s.T, s.NH, s.hd, &drop);
    expect_all_close(out, ref_out, 1e-12, 1e-13, "out with dropout");
    expect_all_close(lse, ref_lse, 1e-12, 1e-13, "lse (the softmax's, dropout or not)");
    run_attention_forward(plain, plain_lse, qkv, s.B, s.T, s.NH, s.hd);
    double moved = 0;
    for (size_t i = 0; i < out.size(); ++i) moved = std::max(moved, std::fabs(out[i] - plain[i]));
    EXPECT_GT(moved, 0.05) << "dropout changed nothing";

    auto loss = [&] {
      Vec o, l;
      run_attention_forward(o, l, qkv, s.B, s.T, s.NH, s.hd, &drop);
      return dot(o, R);
    };
    const Vec fd = numeric_grad(qkv, loss);
    Vec dqkv(qkv.size(), 77.0), scratch(cpu::attention_scratch_elems(s.T));
    cpu::attention_backward(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), s.B, s.T,
                            s.NH, s.hd, scratch.data(), &drop);
    expect_fd_close(dqkv, fd, "dqkv with dropout");
  }
}

// Hidden dropout: the drop rate, the survivors' scale, and the keying: a slice of rows (sequence
// parallelism), a batch split in two (data parallelism, micro-batches) and another iteration.
TEST(CpuDropout, RateScaleAndGlobalKeying) {
  const int64_t B = 4, T = 16, C = 48, N = B * T;
  const DropoutSpec d = make_dropout_spec(0.1, 1234, 3, 2, DropoutKind::MlpOut, 40);
  std::mt19937_64 gen(5);
  const Vec x = random_vec(N * C, gen, 0.5, 1.5);  // never 0: a 0 out means dropped
  Vec y(N * C);
  cpu::dropout(y.data(), x.data(), d, N, C, 0, T);
  int64_t dropped = 0;
  for (int64_t i = 0; i < N * C; ++i) {
    if (y[i] == 0) {
      ++dropped;
    } else {
      EXPECT_DOUBLE_EQ(y[i], x[i] * static_cast<double>(1.0f / 0.9f)) << i;
    }
  }
  const double rate = static_cast<double>(dropped) / (N * C);  // 3072 draws: sigma 0.0054
  EXPECT_NEAR(rate, 0.1, 0.02);
  // Rows 24.. alone (row_begin 24): the same values as in the full tensor.
  Vec part(static_cast<size_t>((N - 24) * C));
  cpu::dropout(part.data(), x.data() + 24 * C, d, N - 24, C, 24, T);
  for (size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], y[24 * C + i]) << i;
  // Samples 2..3 as their own batch (sample_begin 42): the same values.
  DropoutSpec d2 = d;
  d2.sample_begin = 42;
  Vec half(static_cast<size_t>(2 * T * C));
  cpu::dropout(half.data(), x.data() + 2 * T * C, d2, 2 * T, C, 0, T);
  for (size_t i = 0; i < half.size(); ++i) ASSERT_EQ(half[i], y[2 * T * C + i]) << i;
  // In place gives the same; another iteration or site gives another mask.
  Vec z = x;
  cpu::dropout(z.data(), z.data(), d, N, C, 0, T);
  EXPECT_EQ(z, y);
  const DropoutSpec other = make_dropout_spec(0.1, 1234, 4, 2, DropoutKind::MlpOut, 40);
  const DropoutSpec site = make_dropout_spec(0.1, 1234, 3, 2, DropoutKind::AttnOut, 40);
  for (const DropoutSpec& o : {other, site}) {
    Vec w(N * C);
    cpu::dropout(w.data(), x.data(), o, N, C, 0, T);
    int64_t differ = 0;
    for (int64_t i = 0; i < N * C; ++i) differ += (w[i] == 0) != (y[i] == 0);
    EXPECT_GT(differ, N * C / 20);
  }
}

// The pair shortcut (one Philox call for two neighbours) gives what two single draws give.
TEST(CpuDropout, PairDrawsEqualSingleDraws) {
  const DropoutSpec d = make_dropout_spec(0.5, 9, 1, 0, DropoutKind::Attention, 3);
  for (uint64_t e = 0; e < 64; ++e) {
    float m0 = -1, m1 = -1;
    dropout_multiplier2(d, 5, e, m0, m1);
    EXPECT_EQ(m0, dropout_multiplier(d, 5, e)) << e;
    EXPECT_EQ(m1, dropout_multiplier(d, 5, e + 1)) << e;
  }
}

// ---- cross-entropy
// -------------------------------------------------------------------------------

struct XentResult {
  Vec losses, grad;
};

// The three vocab-parallel passes on one shard: row max, row sums, then loss and gradient.
XentResult xent_chain(Vec logits, const std::vector<int32_t>& targets, int64_t N, int64_t V,
                      int64_t valid_cols, int64_t col_begin, double grad_scale = 1.0) {
  Vec rowmax(N), sumexp(N), target_logit(N), losses(N, 55.0);
  cpu::xent_row_max(rowmax.data(), logits.data(), N, V, valid_cols);
  cpu::xent_row_sums(sumexp.data(), target_logit.data(), logits.data(), rowmax.data(),
                     targets.data(), N, V, valid_cols, col_begin);
  cpu::xent_loss_and_grad(losses.data(), logits.data(), rowmax.data(), sumexp.data(),
                          target_logit.data(), targets.data(), N, V, valid_cols, col_begin,
                          grad_scale);
  return {losses, logits};
}

double sum(const Vec& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

TEST(CpuCrossEntropy, HandComputed1x3) {
  const Vec logits = {1.0, 2.0, 3.0};
  const XentResult r = xent_chain(logits, {0}, 1, 3, 3, 0);
  const double Z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(r.losses[0], std::log(Z) - 1.0, 1e-14);
  EXPECT_NEAR(r.losses[0], 2.40760596444438, 1e-13);
  EXPECT_NEAR(r.grad[0], std::exp(1.0) / Z - 1.0, 1e-15);
  EXPECT_NEAR(r.grad[1], std::exp(2.0) / Z, 1e-15);
  EXPECT_NEAR(r.grad[2], std::exp(3.0) / Z, 1e-15);
}

TEST(CpuCrossEntropy, ChainFiniteDifferenceWithPaddingAndIgnoredRow) {
  std::mt19937_64 gen(40);
  // Shard 2 of a padded vocabulary with shard width 37: global columns [74, 111), of which the
  // first 31 are real tokens and the last 6 padding.
  const int64_t N = 7, V = 37, valid = 31, col_begin = 74;
  // Row 2 is ignored; row 5's target lives in another shard (its local loss is the shard's
  // log-sum-exp, still the function whose gradient the kernel writes); the rest are local,
  // including the first and last valid columns.
  const std::vector<int32_t> targets = {74, 90, -1, 104, 80, 3, 99};
  const int64_t kIgnored = 2;
  Vec logits = random_vec(N * V, gen, -3.0, 3.0);
  std::vector<size_t> valid_idx;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < V; ++j) {
      if (j >= valid)
        logits[n * V + j] = 1e30;  // padding: must never be read
      else
        valid_idx.push_back(n * V + j);
    }

  auto loss = [&] { return sum(xent_chain(logits, targets, N, V, valid, col_begin).losses); };
  const Vec dlogits_fd = numeric_grad(logits, loss, valid_idx);
  const XentResult r = xent_chain(logits, targets, N, V, valid, col_begin);
  expect_fd_close(r.grad, dlogits_fd, "dlogits");

  // Padding never enters the loss and gets exactly zero gradient; the ignored row has loss 0 and
  // zero gradient everywhere.
  Vec zero_pad = logits;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = valid; j < V; ++j) zero_pad[n * V + j] = 0.0;
  const XentResult rz = xent_chain(zero_pad, targets, N, V, valid, col_begin);
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(r.losses[n], rz.losses[n]) << "row " << n;
    EXPECT_TRUE(std::isfinite(r.losses[n])) << "row " << n;
    for (int64_t j = valid; j < V; ++j)
      EXPECT_EQ(r.grad[n * V + j], 0.0) << "n=" << n << " j=" << j;
  }
  EXPECT_EQ(r.losses[kIgnored], 0.0);
  for (int64_t j = 0; j < V; ++j) EXPECT_EQ(r.grad[kIgnored * V + j], 0.0) << "j=" << j;

  // A local-target row's loss is logsumexp(valid logits) - logit[target].
  {
    const int64_t n = 1, tj = targets[n] - col_begin;
    double z = 0;
    for (int64_t j = 0; j < valid; ++j) z += std::exp(logits[n * V + j]);
    EXPECT_NEAR(r.losses[n], std::log(z) - logits[n * V + tj], 1e-13);
  }

  // grad_scale multiplies the gradient, not the loss.
  const XentResult rs = xent_chain(logits, targets, N, V, valid, col_begin, 0.25);
  expect_all_close(rs.losses, r.losses, 0.0, 0.0, "losses with grad_scale");
  Vec quarter = r.grad;
  for (double& g : quarter) g *= 0.25;
  expect_all_close(rs.grad, quarter, 1e-15, 1e-17, "grad with grad_scale 0.25");
}

// ---- optimizer
// -----------------------------------------------------------------------------------

TEST(CpuAdamW, OneStepMatchesPyTorch) {
  // lr 0.1, betas 0.9/0.999, eps 1e-8, wd 0.1, p = 1, g = 0.5, step 1:
  // decay p = 1 - 0.1*0.1*1 = 0.99; m = 0.05, v = 0.00025; mhat = 0.5, vhat = 0.25;
  // p = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8).
  double p = 1.0, m = 0.0, v = 0.0;
  const double g = 0.5;
  cpu::adamw_step(&p, &g, &m, &v, 1, 0.1, 0.9, 0.999, 1e-8, 0.1, 1);
  EXPECT_NEAR(m, 0.05, 1e-16);
  EXPECT_NEAR(v, 0.00025, 1e-18);
  EXPECT_NEAR(p, 0.99 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-14);
  EXPECT_NEAR(p, 0.890000002, 1e-12);

  float pf = 1.0f, mf = 0.0f, vf = 0.0f;
  const float gf = 0.5f;
  cpu::adamw_step(&pf, &gf, &mf, &vf, 1, 0.1, 0.9, 0.999, 1e-8, 0.1, 1);
  EXPECT_NEAR(pf, 0.890000002, 1e-6);
}

TEST(CpuAdamW, SeveralStepsMatchReference) {
  // Per-element reference of torch.optim.AdamW's update, over 3 steps on an odd-length vector.
  std::mt19937_64 gen(50);
  const int64_t n = 13;
  const double lr = 3e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  Vec p = random_vec(n, gen), m(n, 0.0), v(n, 0.0);
  Vec rp = p, rm = m, rv = v;
  for (int64_t step = 1; step <= 3; ++step) {
    const Vec g = random_vec(n, gen);
    cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, step);
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (int64_t i = 0; i < n; ++i) {
      rp[i] *= 1 - lr * wd;
      rm[i] = b1 * rm[i] + (1 - b1) * g[i];
      rv[i] = b2 * rv[i] + (1 - b2) * g[i] * g[i];
      rp[i] -= lr * (rm[i] / bc1) / (std::sqrt(rv[i] / bc2) + eps);
    }
  }
  expect_all_close(p, rp, 1e-13, 1e-15, "param");
  expect_all_close(m, rm, 1e-14, 0.0, "m");
  expect_all_close(v, rv, 1e-14, 0.0, "v");
}

// ---- reductions and elementwise helpers
// ----------------------------------------------------------

TEST(CpuSumSquares, MatchesNaiveAndIsThreadCountInvariant) {
  OmpThreadsGuard guard;
  std::mt19937_64 gen(60);
  const int64_t n = 100003;  // several 16384-element blocks and a ragged tail
  const Vec x = random_vec(n, gen);
  double naive = 0;
  for (double e : x) naive += e * e;

  omp_set_num_threads(1);
  const double s1 = cpu::sum_squares(x.data(), n);
  omp_set_num_threads(2);
  const double s2 = cpu::sum_squares(x.data(), n);
  omp_set_num_threads(3);
  const double s3 = cpu::sum_squares(x.data(), n);
  EXPECT_NEAR(s1, naive, 1e-12 * naive);
  EXPECT_EQ(std::memcmp(&s1, &s2, sizeof(double)), 0) << s1 << " vs " << s2;
  EXPECT_EQ(std::memcmp(&s1, &s3, sizeof(double)), 0) << s1 << " vs " << s3;

  EXPECT_EQ(cpu::sum_squares<double>(x.data(), 0), 0.0);
}

TEST(CpuSumSquares, FloatInputBeyondOneChunkOfBlocks) {
  // 256 blocks of 2^14 are summed per pass; go past that so the outer chunk loop runs twice.
  OmpThreadsGuard guard;
  std::mt19937_64 gen(61);
  const int64_t n = 256 * (int64_t{1} << 14) + 777;
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = dist(gen);
  double naive = 0;
  for (float e : x) naive += static_cast<double>(e) * e;

  omp_set_num_threads(1);
  const double s1 = cpu::sum_squares(x.data(), n);
  omp_set_num_threads(2);
  const double s2 = cpu::sum_squares(x.data(), n);
  EXPECT_NEAR(s1, naive, 1e-11 * naive);
  EXPECT_EQ(std::memcmp(&s1, &s2, sizeof(double)), 0) << s1 << " vs " << s2;
}

TEST(CpuElementwise, ScaleAndAdd) {
  std::mt19937_64 gen(70);
  const int64_t n = 37;
  const Vec a = random_vec(n, gen), b = random_vec(n, gen);
  Vec s = a;
  cpu::scale_inplace(s.data(), n, 0.375);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(s[i], a[i] * 0.375) << "i=" << i;
  Vec out(n), alias = a;
  cpu::add(out.data(), a.data(), b.data(), n);
  cpu::add(alias.data(), alias.data(), b.data(), n);  // out may alias a
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(out[i], a[i] + b[i]) << "i=" << i;
    EXPECT_EQ(alias[i], out[i]) << "i=" << i;
  }
}

}  // namespace
