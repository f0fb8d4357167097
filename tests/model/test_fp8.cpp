// test_fp8.cpp: FP8 (docs/training.md, "FP8"): the conversion against an independent float64
// rounding and (where the CUDA headers are) cuda_fp8.h's own host conversion; the scaling recipes
// (Transformer Engine's delayed update, tensorwise's edge cases); one FP8 linear layer's forward
// and backward on the CPU backend against a float64 reference of the recipe; and training with
// FP8: deterministic, learning, and far from the run without it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cpu/fp8.hpp"
#include "core/fp8.hpp"
#include "data/dataset.hpp"
#include "model/gpt.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

#if __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#define TESSERA_TEST_CUDA_FP8 1
#endif

using namespace tessera;

namespace {

// The non-negative finite values of a format with their codes, ascending (codes 0..max).
std::vector<std::pair<double, int>> grid(Fp8Format f) {
  const int mbits = f == Fp8Format::E4M3 ? 3 : 2, bias = f == Fp8Format::E4M3 ? 7 : 15;
  const int max_code = f == Fp8Format::E4M3 ? 0x7E : 0x7B;
  std::vector<std::pair<double, int>> g;
  for (int c = 0; c <= max_code; ++c) {
    const int e = c >> mbits, m = c & ((1 << mbits) - 1);
    const double v = e == 0 ? std::ldexp(double(m), 1 - bias - mbits)
                            : std::ldexp(1.0 + double(m) / (1 << mbits), e - bias);
    g.push_back({v, c});
  }
  return g;
}

// Independent rounding in double: the nearest grid value, ties to the even code, saturating to
// the largest; NaN stays NaN.
double reference_fp8(double x, Fp8Format f) {
  static const std::vector<std::pair<double, int>> g4 = grid(Fp8Format::E4M3),
                                                   g5 = grid(Fp8Format::E5M2);
  const auto& g = f == Fp8Format::E4M3 ? g4 : g5;
  if (std::isnan(x)) return x;
  const double a = std::fabs(x);
  double r;
  if (a >= g.back().first) {
    r = g.back().first;
  } else {
    const auto hi = std::lower_bound(g.begin(), g.end(), std::make_pair(a, -1));
    const auto lo = hi == g.begin() ? hi : hi - 1;
    const double dl = a - lo->first, dh = hi->first - a;
    r = dl < dh ? lo->first : dh < dl ? hi->first : ((lo->second & 1) == 0 ? lo : hi)->first;
  }
  return std::signbit(x) ? -r : r;
}

// Floats to check: a stride through every bit pattern, and around every FP8 value and midpoint.
std::vector<float> sweep() {
  std::vector<float> xs;
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 4093)
    xs.push_back(fp8_bits_float(uint32_t(u)));
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    const auto g = grid(f);
    for (size_t i = 0; i < g.size(); ++i) {
      std::vector<double> points{g[i].first};
      if (i + 1 < g.size()) points.push_back((g[i].first + g[i + 1].first) / 2);
      for (double p : points) {
        float x = static_cast<float>(p);
        for (float y : {std::nextafter(x, 0.0f), x, std::nextafter(x, 1e30f)}) {
          xs.push_back(y);
          xs.push_back(-y);
        }
      }
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, inf, -inf, std::nanf(""), -std::nanf(""), 1e-45f, 460.0f, 464.0f,
                  480.0f, 57344.0f, 61440.0f, 1e38f})
    xs.push_back(x);
  return xs;
}

}  // namespace

TEST(Fp8Conversion, RoundsToNearestEvenAndSaturatesLikeAFloat64Reference) {
  int64_t checked = 0;
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2})
    for (float x : sweep()) {
      const double want = reference_fp8(x, f);
      const float got = fp8_to_float(fp8_from_float(x, f), f);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << x;
        ASSERT_EQ(fp8_from_float(x, f), 0x7F) << x;
      } else {
        ASSERT_EQ(double(got), want) << "x " << x << " format " << int(f);
        ASSERT_EQ(std::signbit(got), std::signbit(x)) << x;
      }
      ++checked;
    }
  EXPECT_GT(checked, 2000000);
  EXPECT_EQ(fp8_from_float(448.0f, Fp8Format::E4M3), 0x7E);
  EXPECT_EQ(fp8_from_float(1e9f, Fp8Format::E4M3), 0x7E);
  EXPECT_EQ(fp8_from_float(-1e9f, Fp8Format::E5M2), 0xFB);
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::E4M3), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::E5M2), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(fp8_to_float(0x7C, Fp8Format::E5M2)));
}

#ifdef TESSERA_TEST_CUDA_FP8
TEST(Fp8Conversion, BitForBitCudaFp8HostConversion) {
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    const __nv_fp8_interpretation_t k = f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
    for (float x : sweep())
      ASSERT_EQ(int(fp8_from_float(x, f)), int(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, k)))
          << "x " << x << " (bits " << std::hex << fp8_bits_float(x) << ") format " << int(f);
  }
}
#endif

TEST(Fp8Scaling, CurrentScaleAndItsEdgeCases) {
  EXPECT_EQ(cpu::fp8_current_scale(2.0f, Fp8Format::E4M3), 224.0f);
  EXPECT_EQ(cpu::fp8_current_scale(3.0f, Fp8Format::E5M2), 57344.0f / 3.0f);
  EXPECT_EQ(cpu::fp8_current_scale(0.0f, Fp8Format::E4M3), 1.0f);
  EXPECT_EQ(cpu::fp8_current_scale(std::numeric_limits<float>::infinity(), Fp8Format::E4M3), 1.0f);
  EXPECT_EQ(cpu::fp8_current_scale(1e-44f, Fp8Format::E4M3), std::numeric_limits<float>::max());
  const std::vector<float> x{1.0f, -7.5f, std::nanf(""), 2.0f};
  EXPECT_TRUE(std::isinf(cpu::fp8_amax(x.data(), 4)));
  EXPECT_EQ(cpu::fp8_amax(x.data(), 2), 7.5f);
}

TEST(Fp8Scaling, DelayedUpdateFollowsTransformerEngine) {
  auto be = make_cpu_backend();
  // Two tensors (E4M3, E5M2), history 3, the max algorithm, margin 1.
  Tensor history = Tensor::zeros({3, 2}), scale({2}), amax({2}), fmax({2});
  scale.f32()[0] = scale.f32()[1] = 1.0f;
  fmax.f32()[0] = 448.0f;
  fmax.f32()[1] = 57344.0f;
  const float steps[4][2] = {{4.0f, 8.0f}, {2.0f, 0.0f}, {1.0f, 1.0f}, {0.5f, 1.0f}};
  // The amax a step's scale comes from: the maximum of the last 3 steps' (TE's rotating window);
  // tensor 1's first step had none yet (8 then, so its scale moves then), and an amax of 0 keeps
  // the scale.
  const float want_amax[4][2] = {{4, 8}, {4, 8}, {4, 8}, {2, 1}};
  for (int s = 0; s < 4; ++s) {
    amax.f32()[0] = steps[s][0];
    amax.f32()[1] = steps[s][1];
    be->fp8_delayed_update(history, scale, amax, fmax, false, 1);
    EXPECT_EQ(scale.f32()[0], 448.0f / want_amax[s][0] / 2) << "step " << s;
    EXPECT_EQ(scale.f32()[1], 57344.0f / want_amax[s][1] / 2) << "step " << s;
    EXPECT_EQ(amax.f32()[0], 0.0f);
    EXPECT_EQ(history.f32()[0], 0.0f);  // row 0 cleared for the next step
  }
  // most_recent: only this step's amax; 0 keeps the previous scale.
  Tensor h1 = Tensor::zeros({1, 1}), s1({1}), a1({1}), m1({1});
  s1.f32()[0] = 1.0f;
  m1.f32()[0] = 448.0f;
  a1.f32()[0] = 16.0f;
  be->fp8_delayed_update(h1, s1, a1, m1, true, 0);
  EXPECT_EQ(s1.f32()[0], 28.0f);
  a1.f32()[0] = 0.0f;
  be->fp8_delayed_update(h1, s1, a1, m1, true, 0);
  EXPECT_EQ(s1.f32()[0], 28.0f);
}

namespace {

struct LinearCase {
  int64_t N = 48, IC = 32, OC = 64;
  std::vector<float> x, w, b, dout;
  explicit LinearCase(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, int64_t k, float s) {
      v.resize(static_cast<size_t>(k));
      for (float& e : v) e = s * n(rng);
    };
    fill(x, N * IC, 1.5f);
    fill(w, OC * IC, 0.02f);
    fill(b, OC, 0.1f);
    fill(dout, N * OC, 1e-4f);
  }
};

Tensor host(const std::vector<float>& v, Shape s) {
  Tensor t(std::move(s));
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

// The float64 reference of one tensorwise-scaled tensor: scale = fp8_max / amax in f32,
// q = fp8(float(x * scale)), the value q / scale.
std::vector<double> reference_dequantized(const std::vector<float>& x, Fp8Format f) {
  double amax = 0;
  for (float v : x) amax = std::max(amax, std::fabs(double(v)));
  const float scale = fp8_max(f) / static_cast<float>(amax);
  std::vector<double> r;
  for (float v : x) r.push_back(reference_fp8(double(v * scale), f) / double(scale));
  return r;
}

float tensorwise_scale(const std::vector<float>& x, Fp8Format f) {
  return cpu::fp8_current_scale(cpu::fp8_amax(x.data(), int64_t(x.size())), f);
}

}  // namespace

TEST(Fp8Linear, ForwardAndBackwardMatchAFloat64ReferenceOfTheRecipe) {
  auto be = make_cpu_backend();
  const LinearCase c(7);
  const int64_t N = c.N, IC = c.IC, OC = c.OC;
  const Fp8Format e4 = Fp8Format::E4M3, e5 = Fp8Format::E5M2;  // hybrid
  Tensor x = host(c.x, {N, IC}), w = host(c.w, {OC, IC}), b = host(c.b, {OC}),
         dout = host(c.dout, {N, OC});
  Tensor sx({1}), sw({1}), sg({1});
  sx.f32()[0] = tensorwise_scale(c.x, e4);
  sw.f32()[0] = tensorwise_scale(c.w, e4);
  sg.f32()[0] = tensorwise_scale(c.dout, e5);
  const Backend::Fp8Operand ox{&sx, e4}, ow{&sw, e4}, og{&sg, e5};
  Tensor out({N, OC}), plain({N, OC});
  be->fp8_matmul_forward(out, x, w, &b, ox, ow);
  be->matmul_forward(plain, x, w, &b);
  Tensor dx({N, IC}), dw = Tensor::zeros({OC, IC}), db = Tensor::zeros({OC});
  be->fp8_matmul_backward(&dx, dw, &db, dout, x, w, og, ox, ow);

  const std::vector<double> xq = reference_dequantized(c.x, e4),
                            wq = reference_dequantized(c.w, e4),
                            gq = reference_dequantized(c.dout, e5);
  double worst = 0, worst_plain = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = c.b[o], mag = std::fabs(c.b[o]);
      for (int64_t i = 0; i < IC; ++i) {
        s += xq[n * IC + i] * wq[o * IC + i];
        mag += std::fabs(xq[n * IC + i] * wq[o * IC + i]);
      }
      worst = std::max(worst, std::fabs(out.f32()[n * OC + o] - s) / mag);
      worst_plain = std::max(worst_plain, std::fabs(plain.f32()[n * OC + o] - s) / mag);
    }
  EXPECT_LT(worst, 2e-6) << "FP8 forward against the float64 reference";
  // Not a test that cannot tell: without FP8 the output is far from the reference.
  EXPECT_GT(worst_plain, 1e-3) << "the f32 GEMM is as close as the FP8 one";

  // dgrad from the quantized gradient and weight; wgrad from the quantized gradient and input;
  // dbias from the unquantized gradient.
  double worst_dx = 0, worst_dw = 0, worst_db = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < IC; ++i) {
      double s = 0, mag = 0;
      for (int64_t o = 0; o < OC; ++o) {
        s += gq[n * OC + o] * wq[o * IC + i];
        mag += std::fabs(gq[n * OC + o] * wq[o * IC + i]);
      }
      worst_dx = std::max(worst_dx, std::fabs(dx.f32()[n * IC + i] - s) / mag);
    }
  for (int64_t o = 0; o < OC; ++o) {
    for (int64_t i = 0; i < IC; ++i) {
      double s = 0, mag = 0;
      for (int64_t n = 0; n < N; ++n) {
        s += gq[n * OC + o] * xq[n * IC + i];
        mag += std::fabs(gq[n * OC + o] * xq[n * IC + i]);
      }
      worst_dw = std::max(worst_dw, std::fabs(dw.f32()[o * IC + i] - s) / mag);
    }
    double s = 0, mag = 0;
    for (int64_t n = 0; n < N; ++n) {
      s += c.dout[n * OC + o];
      mag += std::fabs(c.dout[n * OC + o]);
    }
    worst_db = std::max(worst_db, std::fabs(db.f32()[o] - s) / mag);
  }
  EXPECT_LT(worst_dx, 2e-6);
  EXPECT_LT(worst_dw, 2e-6);
  EXPECT_LT(worst_db, 1e-6);
}

namespace {

std::vector<StepStats> train_tiny(const Fp8Config& fp8, int iters, float perturb = 0) {
  GPTConfig m = testing_util::small_gpt(32, 2, 32, 64, 3);
  TrainConfig t = testing_util::tiny_schedule();
  t.train_iters = iters;
  t.fp8 = fp8;
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
  Trainer tr(m, t, *be, *data);
  if (perturb != 0) {  // every weight of layer 1's fc1 moved by a relative `perturb`
    Tensor w = tr.model().params().param("layers.1.mlp.fc1.weight");
    for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] *= 1.0f + perturb;
    tr.sync_params();
  }
  return tr.train();
}

Fp8Config fp8_config(bool hybrid, Fp8Recipe recipe) {
  Fp8Config f;
  f.enabled = true;
  f.hybrid = hybrid;
  f.recipe = recipe;
  f.amax_history_len = 4;
  f.amax_most_recent = false;
  return f;
}

}  // namespace

TEST(Fp8Training, LearnsDeterministicallyAndFarFromTheF32Run) {
  const std::vector<StepStats> plain = train_tiny(Fp8Config{}, 30);
  for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    const Fp8Config f = fp8_config(true, r);
    const std::vector<StepStats> a = train_tiny(f, 30), b = train_tiny(f, 30);
    ASSERT_EQ(a.size(), 30u);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].loss, b[i].loss) << "iteration " << i + 1;  // bitwise, run to run
      EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << "iteration " << i + 1;
    }
    // The FP8 run learns as the f32 run does (within a few percent of its loss after 30 steps)...
    EXPECT_LT(a.back().loss, a.front().loss - 0.8);
    EXPECT_NEAR(a.back().loss, plain.back().loss, 0.05 * plain.back().loss);
    // ...and is not the f32 run: the first step's gradient norm differs by far more than f32
    // rounding (FP8's is ~1e-2 relative).
    const double d = std::fabs(a[0].grad_norm - plain[0].grad_norm) / plain[0].grad_norm;
    EXPECT_GT(d, 1e-4) << (r == Fp8Recipe::Delayed ? "delayed" : "tensorwise");
  }
}

TEST(Fp8Training, FirstAndLastLayersKeptOutOfFp8) {
  Fp8Config f = fp8_config(false, Fp8Recipe::Tensorwise);
  f.first_last_bf16 = true;  // 3 layers: only layer 1 in FP8
  GPTConfig m = testing_util::small_gpt(32, 2, 32, 64, 3);
  TrainConfig t = testing_util::tiny_schedule();
  t.train_iters = 1;
  t.fp8 = f;
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
  Trainer tr(m, t, *be, *data);
  ASSERT_NE(tr.model().fp8(), nullptr);
  EXPECT_FALSE(tr.model().fp8()->active(0));
  EXPECT_TRUE(tr.model().fp8()->active(1));
  EXPECT_FALSE(tr.model().fp8()->active(2));
  EXPECT_EQ(f.describe(3),
            "e4m3, tensorwise scaling; 1 of 3 layers in FP8 (first 1 and last 1 in the model's "
            "precision)");
  // One FP8 layer moves the first step off the f32 run, less than three do.
  const double plain = train_tiny(Fp8Config{}, 1)[0].grad_norm,
               all = train_tiny(fp8_config(false, Fp8Recipe::Tensorwise), 1)[0].grad_norm,
               middle = tr.train()[0].grad_norm;
  EXPECT_GT(std::fabs(middle - plain), 1e-6 * plain);
  EXPECT_NE(middle, all);
}

TEST(Fp8Training, ExpertsRunInFp8WithTheirOwnScalingState) {
  // A 2-layer MoE model (4 experts, top 2): with delayed scaling, one step records an amax for
  // the input, weight and output gradient of every expert's FC1 and FC2 that took tokens, so
  // their scales leave 1; every layer has 12 + 6 x 4 tensors.
  GPTConfig m = testing_util::small_gpt(32, 2, 32, 64, 2);
  m.num_experts = 4;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 32;
  m.moe_aux_loss_coeff = 0.01;
  m.validate();
  TrainConfig t = testing_util::tiny_schedule();
  t.train_iters = 1;
  t.fp8 = fp8_config(true, Fp8Recipe::Delayed);
  auto be = make_cpu_backend();
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
  Trainer tr(m, t, *be, *data);
  Fp8Scaling& f = *tr.model().fp8();
  ASSERT_EQ(f.per_layer(), fp8_state_columns(4));
  ASSERT_EQ(f.per_layer(), 36);
  ASSERT_EQ(f.tensors(), 72);
  const std::vector<StepStats> fp8 = tr.train();
  std::vector<float> scales(72);
  be->copy_to_host(scales.data(), f.scales());
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t j = 0; j < 36; ++j) {
      const float sc = scales[size_t(l * 36 + j)];
      EXPECT_TRUE(std::isfinite(sc) && sc > 0) << l << "," << j;
      // The dense FC1/FC2 slots (6..11) belong to the shared expert, which this model lacks.
      if (j >= 6 && j < 12)
        EXPECT_EQ(sc, 1.0f) << "layer " << l << " tensor " << j;
      else
        EXPECT_NE(sc, 1.0f) << "layer " << l << " tensor " << j;
    }
  // And FP8 moves the step: with tensorwise scaling the first gradient norm is far from f32's.
  auto first_grad_norm = [&](const Fp8Config& f) {
    TrainConfig ti = t;
    ti.fp8 = f;
    auto b = make_cpu_backend();
    auto d = make_mock_dataset(m.vocab_size, m.seq_length, t.seed);
    Trainer tr1(m, ti, *b, *d);
    return tr1.train()[0].grad_norm;
  };
  const double g32 = first_grad_norm(Fp8Config{});
  const double g8 = first_grad_norm(fp8_config(true, Fp8Recipe::Tensorwise));
  EXPECT_GT(std::fabs(g8 - g32) / g32, 1e-4) << g8 << " vs " << g32;
  EXPECT_TRUE(std::isfinite(fp8[0].grad_norm));
}

namespace {

// An independent float64 GPT-2 forward with FP8 linear layers (tensorwise, or every scale 1:
// delayed scaling's first step), over whole (N, width) matrices so each GEMM input's amax is the
// whole micro-batch's: the loss of one FP8 forward, as docs/training.md specifies it.
using Mat = std::vector<double>;  // row-major

struct Fp8RefGpt {
  const GPTConfig& cfg;
  const std::map<std::string, std::vector<float>>& P;
  bool tensorwise;

  const std::vector<float>& p(const std::string& n) const { return P.at(n); }

  // The dequantized values of an f32 tensor (the model stores activations in f32: round first).
  static Mat quantized(const Mat& x, bool tensorwise) {
    float scale = 1.0f;
    if (tensorwise) {
      float amax = 0;
      for (double v : x) amax = std::max(amax, std::fabs(static_cast<float>(v)));
      scale = fp8_max(Fp8Format::E4M3) / amax;
    }
    Mat q(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      q[i] =
          reference_fp8(double(static_cast<float>(x[i]) * scale), Fp8Format::E4M3) / double(scale);
    return q;
  }
  // (N, in) x (out, in)^T + b, both operands quantized.
  Mat linear(const Mat& x, int64_t N, const std::string& w, const std::string& b) const {
    const std::vector<float>& W = p(w);
    const std::vector<float>& bias = p(b);
    const int64_t out = int64_t(bias.size()), in = int64_t(W.size()) / out;
    const Mat xq = quantized(x, tensorwise), wq = quantized(Mat(W.begin(), W.end()), tensorwise);
    Mat y(size_t(N * out));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < out; ++o) {
        double s = bias[size_t(o)];
        for (int64_t i = 0; i < in; ++i) s += xq[size_t(n * in + i)] * wq[size_t(o * in + i)];
        y[size_t(n * out + o)] = s;
      }
    return y;
  }
  Mat layernorm(const Mat& x, int64_t N, const std::string& name) const {
    const int64_t C = cfg.hidden_size;
    const std::vector<float>&w = p(name + ".weight"), &b = p(name + ".bias");
    Mat y(x.size());
    for (int64_t n = 0; n < N; ++n) {
      double m = 0, v = 0;
      for (int64_t c = 0; c < C; ++c) m += x[size_t(n * C + c)] / C;
      for (int64_t c = 0; c < C; ++c)
        v += (x[size_t(n * C + c)] - m) * (x[size_t(n * C + c)] - m) / C;
      for (int64_t c = 0; c < C; ++c)
        y[size_t(n * C + c)] =
            (x[size_t(n * C + c)] - m) / std::sqrt(v + cfg.layernorm_epsilon) * w[size_t(c)] +
            b[size_t(c)];
    }
    return y;
  }

  double loss(const std::vector<int>& ids, const std::vector<int>& targets, int B, int T) const {
    const int64_t C = cfg.hidden_size, H = cfg.num_attention_heads, hd = C / H, N = int64_t(B) * T;
    Mat x(size_t(N * C));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c)
        x[size_t(n * C + c)] = double(p("wte")[size_t(ids[size_t(n)] * C + c)]) +
                               double(p("wpe")[size_t((n % T) * C + c)]);
    for (int l = 0; l < cfg.num_layers; ++l) {
      const std::string pre = "layers." + std::to_string(l) + ".";
      const Mat qkv =
          linear(layernorm(x, N, pre + "ln1"), N, pre + "attn.qkv.weight", pre + "attn.qkv.bias");
      Mat att(size_t(N * C), 0.0);
      for (int b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int t = 0; t < T; ++t) {
            auto at = [&](int u, int which, int64_t e) {
              return qkv[size_t((int64_t(b) * T + u) * 3 * C + which * C + h * hd + e)];
            };
            std::vector<double> s(size_t(t + 1));
            double m = -1e300, z = 0;
            for (int u = 0; u <= t; ++u) {
              double d = 0;
              for (int64_t e = 0; e < hd; ++e) d += at(t, 0, e) * at(u, 1, e);
              s[size_t(u)] = d / std::sqrt(double(hd));
              m = std::max(m, s[size_t(u)]);
            }
            for (int u = 0; u <= t; ++u) z += std::exp(s[size_t(u)] - m);
            for (int u = 0; u <= t; ++u)
              for (int64_t e = 0; e < hd; ++e)
                att[size_t((int64_t(b) * T + t) * C + h * hd + e)] +=
                    std::exp(s[size_t(u)] - m) / z * at(u, 2, e);
          }
      const Mat y = linear(att, N, pre + "attn.proj.weight", pre + "attn.proj.bias");
      for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
      Mat f = linear(layernorm(x, N, pre + "ln2"), N, pre + "mlp.fc1.weight", pre + "mlp.fc1.bias");
      for (double& v : f)
        v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
      const Mat y2 = linear(f, N, pre + "mlp.fc2.weight", pre + "mlp.fc2.bias");
      for (size_t i = 0; i < x.size(); ++i) x[i] += y2[i];
    }
    const Mat h = layernorm(x, N, "lnf");
    double total = 0;
    int count = 0;
    for (int64_t n = 0; n < N; ++n) {
      if (targets[size_t(n)] < 0) continue;
      std::vector<double> logit(size_t(cfg.vocab_size));
      double m = -1e300, z = 0;
      for (int64_t v = 0; v < cfg.vocab_size; ++v) {
        double d = 0;
        for (int64_t c = 0; c < C; ++c) d += h[size_t(n * C + c)] * p("wte")[size_t(v * C + c)];
        logit[size_t(v)] = d;
        m = std::max(m, d);
      }
      for (double d : logit) z += std::exp(d - m);
      total += m + std::log(z) - logit[size_t(targets[size_t(n)])];
      ++count;
    }
    return total / count;
  }
};

}  // namespace

TEST(Fp8Model, OneFp8ForwardMatchesAFloat64Reference) {
  GPTConfig cfg = testing_util::small_gpt(32, 2, 16, 64, 2);
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel model(cfg, model_shard_for(cfg, 1, 0, 1, 0), *be, tp);
  model.init_parameters(7);
  // Every weight 8x its init (logits of a trained model's size, so FP8's error reaches the loss)
  // and biases and norm weights away from theirs.
  std::mt19937 g(3);
  std::normal_distribution<float> nd(0.f, 0.05f);
  std::map<std::string, std::vector<float>> P;
  for (const ParamSpec& s : model.params().specs()) {
    Tensor t = model.params().param(s);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = 8 * t.f32()[i] + nd(g);
    P[s.name] = std::vector<float>(t.f32(), t.f32() + t.numel());
  }
  const int B = 2, T = 16, N = B * T;
  std::mt19937 gi(11);
  std::uniform_int_distribution<int> d(0, 63);
  std::vector<int> ids(N), targets(N);
  for (int i = 0; i < N; ++i) ids[size_t(i)] = d(gi), targets[size_t(i)] = d(gi);
  targets[5] = -1;
  Activations a = model.make_activations(B, T);
  for (int i = 0; i < N; ++i)
    a.ids.i32()[i] = ids[size_t(i)], a.targets.i32()[i] = targets[size_t(i)];
  const double plain = model.forward(a, 1.0f) / (N - 1);
  for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    Fp8Config f = fp8_config(false, r);
    model.set_fp8(f);
    const double got = model.forward(a, 1.0f) / (N - 1);
    const double want = Fp8RefGpt{cfg, P, r == Fp8Recipe::Tensorwise}.loss(ids, targets, B, T);
    const char* what = r == Fp8Recipe::Tensorwise ? "tensorwise" : "delayed (scale 1)";
    EXPECT_NEAR(got, want, 1e-6 * want) << what;
    EXPECT_GT(std::fabs(plain - want), 1e2 * std::fabs(got - want) + 1e-4 * want) << what;
    std::printf("%s: FP8 loss %.9f, float64 reference %.9f, without FP8 %.9f\n", what, got, want,
                plain);
  }
  model.set_fp8(Fp8Config{});
}
