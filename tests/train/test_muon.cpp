// test_muon.cpp: Muon (step/muon.hpp, issue 59) against a float64 reference written from the
// definitions (Megatron-Core's Muon: Megatron-LM d98e8a6 with Emerging-Optimizers v0.3.0):
//   m <- beta m + (1 - beta) g; u = Nesterov ? (1 - beta) g + beta m : m;
//   X = u / max(||u||_F, 1e-7), transposed when it has more rows than columns; per step k
//   X <- a X + (b X X^T + c (X X^T)^2) X with the quintic tuples; transposed back;
//   p <- p (1 - lr wd) - lr * scale(rows, cols) * extra * X.
// The parameters Muon does not take (1-D, embeddings) get AdamW's step, bit for bit the step a
// plain AdamW gives them.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "step/muon.hpp"
#include "step/optimizer.hpp"

using namespace tessera;

namespace {

using Mat = std::vector<double>;  // row-major

Mat matmul(const Mat& a, const Mat& b, int64_t n, int64_t k, int64_t m) {  // (n,k) x (k,m)
  Mat c(size_t(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < m; ++j)
        c[size_t(i * m + j)] += a[size_t(i * k + p)] * b[size_t(p * m + j)];
  return c;
}
Mat transpose(const Mat& a, int64_t r, int64_t c) {
  Mat t(a.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[size_t(j * r + i)] = a[size_t(i * c + j)];
  return t;
}

// Newton-Schulz from the definition (quintic tuples, cycled), in double.
Mat newton_schulz(Mat x, int64_t r, int64_t c, int steps, bool simple) {
  const double q[5][3] = {{4.0848, -6.8946, 2.9270},
                          {3.9505, -6.3029, 2.6377},
                          {3.7418, -5.5913, 2.3037},
                          {2.8769, -3.1427, 1.2046},
                          {2.8366, -3.0525, 1.2012}};
  const bool tall = r > c;
  if (tall) x = transpose(x, r, c), std::swap(r, c);
  double n2 = 0;
  for (double v : x) n2 += v * v;
  const double inv = 1.0 / std::max(std::sqrt(n2), 1e-7);
  for (double& v : x) v *= inv;
  for (int k = 0; k < steps; ++k) {
    const double a = simple ? 3.4445 : q[k % 5][0], b = simple ? -4.7750 : q[k % 5][1],
                 cc = simple ? 2.0315 : q[k % 5][2];
    const Mat A = matmul(x, transpose(x, r, c), r, c, r);
    const Mat A2 = matmul(A, A, r, r, r);
    Mat B(A.size());
    for (size_t i = 0; i < A.size(); ++i) B[i] = b * A[i] + cc * A2[i];
    const Mat BX = matmul(B, x, r, r, c);
    for (size_t i = 0; i < x.size(); ++i) x[i] = a * x[i] + BX[i];
  }
  return tall ? transpose(x, r, c) : x;
}

struct Matrix {
  int64_t offset, rows, cols;
};

// A store of: q/k/v [3, 2, 4, 8] (three 8 x 8 matrices, or one 24 x 8), fc1 [16, 8] (tall),
// fc2 [8, 16] (wide), a norm [8] and an embedding [10, 8] (AdamW).
std::vector<ParamSpec> specs() {
  std::vector<ParamSpec> s;
  auto add = [&](const char* name, Shape shape, bool decay) {
    ParamSpec p;
    p.name = name;
    p.global_shape = p.local_shape = shape;
    p.weight_decay = decay;
    s.push_back(p);
  };
  add("wte", {10, 8}, true);
  add("layers.0.attn.qkv.weight", {3, 2, 4, 8}, true);
  add("layers.0.ln1.weight", {8}, false);
  add("layers.0.mlp.fc1.weight", {16, 8}, true);
  add("layers.0.mlp.fc2.weight", {8, 16}, true);
  return s;
}

struct Case {
  bool nesterov = false, split_qkv = true, simple = false;
  std::string scale = "spectral";
  double extra = 1.0, beta = 0.9;
  int steps = 5;
};

// Runs `iters` steps of Muon + AdamW on the CPU backend and of the reference; returns the worst
// relative difference of a Muon matrix's total change, and checks AdamW's parameters bitwise.
double run(const Case& cs, int iters, const Case* reference = nullptr) {
  const Case& rc = reference ? *reference : cs;  // what the reference computes
  auto be = make_cpu_backend();
  ParamStore ps(specs(), be->allocator());
  ParamStore plain(specs(), be->allocator());  // AdamW alone: its 1-D and embedding steps
  const int64_t n = ps.numel();
  std::mt19937 gen(59);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> p0(static_cast<size_t>(n)), g(p0.size());
  for (float& v : p0) v = 0.1f * nd(gen);
  be->copy_from_host(ps.flat_params(), p0.data());
  be->copy_from_host(plain.flat_params(), p0.data());
  TrainConfig::Muon opt;
  opt.momentum = cs.beta;
  opt.nesterov = cs.nesterov;
  opt.split_qkv = cs.split_qkv;
  opt.scale_mode = cs.scale;
  opt.extra_scale = cs.extra;
  opt.ns_steps = cs.steps;
  opt.coefficients = cs.simple ? "simple" : "quintic";
  LocalCommunicator tp;
  AdamW adam(ps, *be, 0.9, 0.95, 1e-8), adam_plain(plain, *be, 0.9, 0.95, 1e-8);
  Muon muon(ps, *be, opt, tp, adam.exp_avg());
  std::vector<bool> skip;
  for (const ParamSpec& s : ps.specs()) skip.push_back(is_muon_param(s));
  adam.skip_params(skip);
  // The reference's matrices, from the definition of the split.
  const ParamSpec& qkv = ps.spec("layers.0.attn.qkv.weight");
  std::vector<Matrix> ms;
  if (cs.split_qkv)
    for (int i = 0; i < 3; ++i) ms.push_back({qkv.flat_offset + i * 64, 8, 8});
  else
    ms.push_back({qkv.flat_offset, 24, 8});
  ms.push_back({ps.spec("layers.0.mlp.fc1.weight").flat_offset, 16, 8});
  ms.push_back({ps.spec("layers.0.mlp.fc2.weight").flat_offset, 8, 16});
  EXPECT_EQ(muon.matrices().size(), ms.size());
  std::vector<double> ref(p0.begin(), p0.end()), mom(p0.size(), 0.0);
  const double lr = 0.02, wd = 0.1, clip = 0.5;
  for (int it = 0; it < iters; ++it) {
    for (float& v : g) v = nd(gen);
    be->copy_from_host(ps.flat_grads(), g.data());
    be->copy_from_host(plain.flat_grads(), g.data());
    muon.step(lr, wd, clip);
    adam.step(lr, wd, clip);
    adam_plain.step(lr, wd, clip);
    for (const Matrix& mx : ms) {
      const int64_t k = mx.rows * mx.cols;
      Mat u(static_cast<size_t>(k));
      for (int64_t i = 0; i < k; ++i) {
        const size_t j = size_t(mx.offset + i);
        const double gi = double(g[j]) * clip;
        mom[j] = rc.beta * mom[j] + (1 - rc.beta) * gi;
        u[size_t(i)] = rc.nesterov ? (1 - rc.beta) * gi + rc.beta * mom[j] : mom[j];
      }
      const Mat o = newton_schulz(u, mx.rows, mx.cols, rc.steps, rc.simple);
      const double r = double(mx.rows), c = double(mx.cols);
      const double s = (rc.scale == "spectral"        ? std::sqrt(std::max(r, c))
                        : rc.scale == "unit_rms_norm" ? std::sqrt(r / c)
                                                      : std::sqrt(std::max(1.0, r / c))) *
                       rc.extra;
      for (int64_t i = 0; i < k; ++i) {
        double& p = ref[size_t(mx.offset + i)];
        p = p * (1 - lr * wd) - lr * s * o[size_t(i)];
      }
    }
  }
  std::vector<float> got(p0.size()), want(p0.size());
  be->copy_to_host(got.data(), ps.flat_params());
  be->copy_to_host(want.data(), plain.flat_params());
  double worst = 0;
  for (const Matrix& mx : ms)
    for (int64_t i = 0; i < mx.rows * mx.cols; ++i) {
      const size_t j = size_t(mx.offset + i);
      const double change = ref[j] - p0[j], diff = double(got[j]) - ref[j];
      worst = std::max(worst, std::abs(diff) / std::max(std::abs(change), 1e-3));
    }
  for (const char* name : {"wte", "layers.0.ln1.weight"}) {  // AdamW's, bit for bit
    const ParamSpec& s = ps.spec(name);
    for (int64_t i = 0; i < s.numel(); ++i)
      EXPECT_EQ(got[size_t(s.flat_offset + i)], want[size_t(s.flat_offset + i)])
          << name << " " << i;
  }
  return worst;
}

}  // namespace

TEST(Muon, OneStepIsTheDefinition) {
  EXPECT_LT(run(Case{}, 1), 2e-4);
}

TEST(Muon, SeveralStepsWithEveryOptionAreTheDefinition) {
  Case nesterov;
  nesterov.nesterov = true;
  nesterov.beta = 0.95;
  EXPECT_LT(run(nesterov, 4), 2e-4);
  Case together;  // q, k and v as one 24 x 8 matrix (tall: the transposed iteration)
  together.split_qkv = false;
  together.scale = "unit_rms_norm";
  EXPECT_LT(run(together, 3), 2e-4);
  Case simple;
  simple.simple = true;
  simple.steps = 7;
  simple.scale = "shape_scaling";
  simple.extra = 0.2;
  EXPECT_LT(run(simple, 3), 2e-4);
}

TEST(Muon, TheComparisonCanFail) {
  // The same check against a reference of other settings misses by far more than its tolerance.
  Case nesterov;
  nesterov.nesterov = true;
  EXPECT_GT(run(Case{}, 2, &nesterov), 1e-2);
  Case simple;
  simple.simple = true;
  EXPECT_GT(run(Case{}, 1, &simple), 1e-2);
  Case unit;
  unit.scale = "unit_rms_norm";
  EXPECT_GT(run(Case{}, 1, &unit), 1e-2);
}

TEST(Muon, CoefficientsAndScalesAreMegatrons) {
  double a = 0, b = 0, c = 0;
  muon_coefficients("quintic", 6, a, b, c);  // cycled: step 6 is step 1's tuple
  EXPECT_DOUBLE_EQ(a, 3.9505);
  EXPECT_DOUBLE_EQ(c, 2.6377);
  muon_coefficients("simple", 3, a, b, c);
  EXPECT_DOUBLE_EQ(b, -4.7750);
  EXPECT_DOUBLE_EQ(muon_scale("spectral", 8, 32), std::sqrt(32.0));
  EXPECT_DOUBLE_EQ(muon_scale("unit_rms_norm", 8, 32), 0.5);
  EXPECT_DOUBLE_EQ(muon_scale("shape_scaling", 8, 32), 1.0);
  EXPECT_DOUBLE_EQ(muon_scale("shape_scaling", 32, 8), 2.0);
}

TEST(Muon, PlansMegatronsMatrices) {
  std::vector<ParamSpec> s = specs();
  ParamSpec router;
  router.name = "layers.0.mlp.router.weight";
  router.global_shape = router.local_shape = {4, 8};
  router.weight_decay = true;
  s.push_back(router);
  ParamSpec bias;  // a fused projection's bias: several dimensions, no decay, AdamW's
  bias.name = "layers.0.attn.qkv.bias";
  bias.global_shape = bias.local_shape = {3, 2, 4};
  s.push_back(bias);
  ParamSpec lm;
  lm.name = "lm_head";
  lm.weight_decay = true;  // decays, but the output layer stays on AdamW
  lm.global_shape = lm.local_shape = {10, 8};
  s.push_back(lm);
  const auto split = plan_muon_matrices(s, 1, true);
  ASSERT_EQ(split.size(), 6u);  // q, k, v, fc1, fc2, the router; not wte, lm_head, norm, bias
  EXPECT_EQ(split[0].name, "layers.0.attn.qkv.weight:q");
  EXPECT_EQ(split[2].rows, 8);
  EXPECT_EQ(split[5].name, "layers.0.mlp.router.weight");
  EXPECT_EQ(plan_muon_matrices(s, 1, false).size(), 4u);
}

// Same-shaped matrices iterate together (one batched GEMM per product): q, k and v of the
// layer; different shapes, cuts or Gram sides apart; a batch holds at most kMuonBatchElements
// elements of whole matrices; the scratch estimate grows with the largest batch.
TEST(Muon, BatchesSameShapedMatricesUpToTheCap) {
  const auto split = plan_muon_matrices(specs(), 1, true);
  std::vector<const MuonMatrix*> all;
  for (const MuonMatrix& m : split) all.push_back(&m);
  const auto batches = muon_batches(all, 1, "duplicated");
  ASSERT_EQ(batches.size(), 3u);  // q k v; fc1; fc2
  EXPECT_EQ(batches[0].size(), 3u);
  EXPECT_EQ(batches[0][2]->name, "layers.0.attn.qkv.weight:v");
  MuonMatrix big;
  big.rows = 4096, big.cols = 6144;  // 24 Mi elements: two in a batch, not three
  big.global_rows = big.rows, big.global_cols = big.cols;
  MuonMatrix cut = big;  // the same piece, but a column-cut matrix's at TP2
  cut.split = MuonMatrix::Split::Cols;
  cut.global_cols = 2 * big.cols;
  std::vector<const MuonMatrix*> bigs{&big, &cut, &big, &big};
  const auto b2 = muon_batches(bigs, 2, "duplicated");
  ASSERT_EQ(b2.size(), 3u);
  EXPECT_EQ(b2[0].size(), 2u);  // big, big (the cut one apart)
  EXPECT_EQ(b2[1].size(), 1u);
  EXPECT_EQ(b2[1][0], &cut);
  EXPECT_EQ(b2[2].size(), 1u);
  TrainConfig::Muon opt;
  opt.matmul_prec = "high";
  const double one = muon_scratch_bytes({big}, 1, opt, true);
  EXPECT_DOUBLE_EQ(muon_scratch_bytes({big, big}, 1, opt, true), 2 * one);
}

// Megatron's routing (issue 71 point 7; megatron/core/optimizer/emerging_optimizers.py): the
// scalar optimizer takes the word embedding and the output layer (is_embedding_or_output_parameter)
// and what is not 2-D; the learned position embedding, like every other matrix, is Muon's.
TEST(Muon, RoutesParametersAsMegatron) {
  auto spec = [](const char* name, Shape shape, bool decay) {
    ParamSpec p;
    p.name = name;
    p.global_shape = p.local_shape = shape;
    p.weight_decay = decay;
    return p;
  };
  EXPECT_TRUE(is_muon_param(spec("wpe", {32, 8}, true)));
  EXPECT_TRUE(is_muon_param(spec("layers.0.mlp.fc1.weight", {16, 8}, true)));
  EXPECT_TRUE(is_muon_param(spec("mtp.0.eh_proj.weight", {8, 16}, true)));
  EXPECT_FALSE(is_muon_param(spec("wte", {10, 8}, true)));
  EXPECT_FALSE(is_muon_param(spec("lm_head", {10, 8}, true)));
  EXPECT_FALSE(is_muon_param(spec("layers.0.ln1.weight", {8}, false)));
  EXPECT_FALSE(is_muon_param(spec("layers.0.attn.qkv.bias", {3, 2, 4}, false)));
}
