// test_cuda_ops.cpp: every CUDA op against the CPU reference on random inputs with odd sizes, in
// each compute dtype (f32, bf16, f16: the CPU reference computes the same dtypes in f32 and rounds
// on store), multi-head and grouped-query attention, ALiBi, and the Llama-family ops (RMSNorm,
// SwiGLU, RoPE). Tolerances, relative to the largest reference value: f32 1e-5 (1e-4 for attention
// backward), bf16 2e-2, f16 4e-3. Outputs are poisoned with NaN before the call and must be fully
// written. Each test skips itself where no CUDA device is visible.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include "backend/backend.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"

using namespace tessera;

namespace tessera {
// Test names and messages say "bf16", not the enum's bytes.
void PrintTo(DType d, std::ostream* os) {
  *os << dtype_name(d);
}
}  // namespace tessera

namespace {

class CudaOpsBase {
 protected:
  bool start() {
    if (cuda::device_count() == 0) return false;
    cuda::set_device(0);
    cpu_ = make_cpu_backend();
    gpu_ = make_cuda_backend();
    return true;
  }
  Tensor rand(Shape s, float scale = 1.f) {
    Tensor t(std::move(s));
    std::normal_distribution<float> d(0.f, scale);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(g_);
    return t;
  }
  // A host tensor of dtype d holding f rounded to d.
  Tensor as(DType d, const Tensor& f) {
    Tensor t(f.shape(), d);
    cpu_->cast(t, f);
    return t;
  }
  Tensor ids(Shape s, int hi) {
    Tensor t(std::move(s), DType::I32);
    std::uniform_int_distribution<int> d(0, hi - 1);
    for (int64_t i = 0; i < t.numel(); ++i) t.i32()[i] = d(g_);
    return t;
  }
  Tensor dev(const Tensor& h) {
    Tensor d(h.shape(), h.dtype(), cuda::device_allocator());
    gpu_->copy_from_host(d, h.raw());
    return d;
  }
  Tensor poisoned(Shape s, DType dt = DType::F32) {  // all bits set: NaN in f32, bf16 and f16
    Tensor d(std::move(s), dt, cuda::device_allocator());
    std::vector<unsigned char> h(d.nbytes(), 0xff);
    gpu_->copy_from_host(d, h.data());
    return d;
  }
  Tensor host(const Tensor& d) {
    Tensor h(d.shape(), d.dtype());
    gpu_->copy_to_host(h.raw(), d);
    return h;
  }
  Tensor widened(const Tensor& h) {
    Tensor f(h.shape());
    cpu_->cast(f, h);
    return f;
  }
  // |gpu - cpu| <= tol * max|cpu| for every element, cpu not all zero, gpu fully written.
  void expect_close(const Tensor& gpu_dev, const Tensor& cpu_host, double tol, const char* what) {
    const Tensor gpu = widened(host(gpu_dev)), cpu = widened(cpu_host);
    ASSERT_EQ(gpu.numel(), cpu.numel()) << what;
    double m = 0;
    for (int64_t i = 0; i < cpu.numel(); ++i) m = std::max(m, (double)std::fabs(cpu.f32()[i]));
    ASSERT_GT(m, 0.0) << what << ": the reference is all zeros";
    for (int64_t i = 0; i < cpu.numel(); ++i) {
      ASSERT_FALSE(std::isnan(gpu.f32()[i])) << what << "[" << i << "] not written";
      ASSERT_NEAR(gpu.f32()[i], cpu.f32()[i], tol * m) << what << "[" << i << "]";
    }
  }
  std::mt19937 g_{42};
  std::unique_ptr<Backend> cpu_, gpu_;
};

class CudaOps : public CudaOpsBase, public ::testing::Test {
 protected:
  void SetUp() override {
    if (!start()) GTEST_SKIP() << "no CUDA device visible";
  }
};

// The ops whose activations take the compute dtype, in every dtype.
class CudaOpsDtype : public CudaOpsBase, public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!start()) GTEST_SKIP() << "no CUDA device visible";
  }
  DType d() const { return GetParam(); }
  double tol(double f32_tol) const {
    return d() == DType::F32 ? f32_tol : d() == DType::BF16 ? 2e-2 : 4e-3;
  }
  Tensor rnd(Shape s, float scale = 1.f) { return as(d(), rand(std::move(s), scale)); }
  bool repeatable_ = true;  // the backward gives the same bits twice (not cuDNN's with atomics)
  // One attention case against the CPU: the forward, then the backward from the CPU's forward
  // outputs (only the backward compared) or, as in training, from the GPU's own.
  struct AttentionCase {
    int64_t B, T, H, hd;
    int64_t G = 0;  // key/value heads (grouped-query attention); 0: H
  };
  // `drop`: attention dropout (the CPU and the GPU draw the same mask). `alibi`: ALiBi's bias.
  // `docs` > 0: documents inside the samples of 1 to `docs` tokens (the first visible key per row,
  // the same table on both backends).
  void check_attention(const AttentionCase& c, bool backward_from_gpu_forward,
                       const AttentionDropout* drop = nullptr,
                       const AttentionAlibi* alibi = nullptr, int docs = 0) {
    SCOPED_TRACE("B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " H " +
                 std::to_string(c.H) + " hd " + std::to_string(c.hd) + " G " + std::to_string(c.G) +
                 (drop ? " dropout" : "") +
                 (alibi ? " alibi heads from " + std::to_string(alibi->head_begin) + " of " +
                              std::to_string(alibi->heads_total)
                        : ""));
    const int64_t B = c.B, T = c.T, H = c.H, hd = c.hd, G = c.G > 0 ? c.G : c.H;
    const int64_t C3 = (H + 2 * G) * hd;
    const DType dt = d();
    Tensor qkv = rnd({B, T, C3}), dout = rnd({B, T, H * hd});
    Tensor out({B, T, H * hd}, dt), lse({B, H, T}), dqkv({B, T, C3}, dt);
    Tensor kb_host({B * T}, DType::I32), kb_dev;
    AttentionDocuments host_docs, dev_docs;
    const AttentionDocuments *hdocs = nullptr, *ddocs = nullptr;
    if (docs > 0) {
      std::mt19937 g(static_cast<unsigned>(T + docs));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0, start = 0, len = 1 + int64_t(g() % docs); t < T; ++t) {
          if (t - start == len) start = t, len = 1 + int64_t(g() % docs);
          kb_host.i32()[b * T + t] = static_cast<int32_t>(start);
        }
      kb_dev = dev(kb_host);
      host_docs.key_begin = &kb_host;
      dev_docs.key_begin = &kb_dev;
      hdocs = &host_docs;
      ddocs = &dev_docs;
    }
    cpu_->attention_forward(out, lse, qkv, H, drop, c.G, alibi, hdocs);
    cpu_->attention_backward(dqkv, dout, qkv, out, lse, H, drop, c.G, alibi, hdocs);
    Tensor qd = dev(qkv), od = poisoned({B, T, H * hd}, dt), ld = poisoned({B, H, T}),
           dd = dev(dout);
    gpu_->attention_forward(od, ld, qd, H, drop, c.G, alibi, ddocs);
    expect_close(od, out, tol(1e-5), "attention out");
    expect_close(ld, lse, dt == DType::F32 ? 1e-5 : 1e-3, "attention lse (f32)");
    Tensor dqd = poisoned({B, T, C3}, dt);
    const Tensor ob = backward_from_gpu_forward ? od : dev(out),
                 lb = backward_from_gpu_forward ? ld : dev(lse);
    gpu_->attention_backward(dqd, dd, qd, ob, lb, H, drop, c.G, alibi, ddocs);
    expect_close(dqd, dqkv, tol(1e-4), "attention dqkv");
    if (G < H && repeatable_) {  // the group sums have one owner each: the same bits again
      const Tensor first = host(dqd);
      gpu_->attention_backward(dqd, dd, qd, ob, lb, H, drop, c.G, alibi, ddocs);
      const Tensor again = host(dqd);
      EXPECT_EQ(std::memcmp(first.raw(), again.raw(), first.nbytes()), 0)
          << "the grouped-query backward is deterministic";
    }
  }
};

}  // namespace

// Attention dropout 0.1 in every dtype: the tensor-core kernels (bf16/f16, head dims 64, 128) and
// the one-thread-per-row kernels (f32, head dim 48) against the CPU, the same mask.
TEST_P(CudaOpsDtype, AttentionDropoutMatchesCpu) {
  gpu_->set_attention_backend(AttentionBackend::Flash, false);  // Tessera's kernels
  AttentionDropout drop;
  drop.spec = make_dropout_spec(0.1, 99, 12, 4, DropoutKind::Attention, 640);
  drop.head_begin = 4;
  drop.heads_total = 8;
  check_attention({2, 256, 4, 64}, true, &drop);
  check_attention({1, 200, 4, 128}, true, &drop);
  check_attention({1, 70, 4, 48}, true, &drop);
}

// Grouped-query attention (G key/value heads < H query heads, G = 1 multi-query) against the CPU:
// bf16 and f16 at head dims 64 and 128 take the tensor-core kernels, f32 the tiled scalar ones
// (head dims 32, 64, 128) and head dim 40 the one-thread-per-row ones; T not a multiple of the
// tiles. Then training shapes (Llama-like 8 heads over 2 groups) and dropout (the mask of each
// query head inside the dK/dV loop over the group).
TEST_P(CudaOpsDtype, GqaAttentionMatchesCpu) {
  gpu_->set_attention_backend(AttentionBackend::Flash, false);  // Tessera's kernels
  for (const AttentionCase c : {AttentionCase{2, 131, 4, 64, 2}, AttentionCase{1, 100, 4, 128, 1},
                                AttentionCase{2, 67, 6, 32, 3}, AttentionCase{1, 45, 4, 40, 2}})
    check_attention(c, false);
  check_attention({2, 1024, 8, 64, 2}, true);
  check_attention({1, 2048, 8, 128, 2}, true);
  AttentionDropout drop;
  drop.spec = make_dropout_spec(0.1, 99, 12, 4, DropoutKind::Attention, 640);
  drop.head_begin = 8;
  drop.heads_total = 16;
  check_attention({2, 256, 8, 64, 2}, true, &drop);
  check_attention({1, 150, 4, 128, 1}, true, &drop);
  check_attention({1, 70, 4, 48, 2}, true, &drop);
}

// ALiBi against the CPU in every dtype: bf16 and f16 at head dims 64 and 128 take the tensor-core
// kernels' ALiBi instances, f32 the tiled scalar ones (head dims 32, 64, 128), head dims 40 and 48
// (and dropout outside the tensor-core kernels) the one-thread-per-row ones; T not a multiple of
// the tiles, multi-head and grouped-query, then dropout and training shapes. The heads are those of
// a tensor-parallel rank past the first: rank 1 of 2 of 8 heads (slopes 2^-5 .. 2^-8) and rank 2
// of 3 of 12 heads (12 is no power of two: slopes 2^-0.5 .. 2^-3.5, steep).
TEST_P(CudaOpsDtype, AlibiAttentionMatchesCpu) {
  gpu_->set_attention_backend(AttentionBackend::Flash, false);  // Tessera's kernels
  const AttentionAlibi mild{4, 8}, steep{8, 12};
  for (const AttentionCase c : {AttentionCase{2, 131, 4, 64}, AttentionCase{1, 100, 4, 128, 2},
                                AttentionCase{2, 67, 4, 32, 1}, AttentionCase{1, 45, 4, 40, 2}}) {
    check_attention(c, false, nullptr, &mild);
    check_attention(c, false, nullptr, &steep);
  }
  check_attention({2, 1024, 4, 64, 2}, true, nullptr, &mild);
  check_attention({1, 2048, 4, 128}, true, nullptr, &steep);
  AttentionDropout drop;
  drop.spec = make_dropout_spec(0.1, 99, 12, 4, DropoutKind::Attention, 640);
  drop.head_begin = 8;
  drop.heads_total = 12;
  check_attention({2, 256, 4, 64, 2}, true, &drop, &steep);
  check_attention({1, 150, 4, 128, 1}, true, &drop, &steep);
  check_attention({1, 70, 4, 48, 2}, true, &drop, &steep);
}

// Documents inside the samples (--reset-attention-mask, --sft) on the tensor-core kernels, under
// --attention-backend auto (which must take them, not cuDNN) and flash: short documents, ones
// spanning the 128-row blocks, at the training shapes, with grouped-query attention, ALiBi and
// dropout, against the CPU with the same table. f32 (no tensor-core kernels) is one refusal.
TEST_P(CudaOpsDtype, DocumentsAttentionMatchesCpu) {
  if (d() == DType::F32) {
    try {
      check_attention({1, 64, 2, 64}, false, nullptr, nullptr, 9);
      ADD_FAILURE() << "documents in f32 on the GPU should be refused";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("bf16 or fp16 at head dim 64 or 128"), std::string::npos)
          << e.what();
    }
    return;
  }
  const AttentionAlibi alibi{4, 8};
  AttentionDropout drop;
  drop.spec = make_dropout_spec(0.1, 99, 12, 4, DropoutKind::Attention, 640);
  drop.head_begin = 4;
  drop.heads_total = 8;
  for (AttentionBackend be : {AttentionBackend::Auto, AttentionBackend::Flash}) {
    gpu_->set_attention_backend(be, false);
    check_attention({2, 131, 4, 64}, false, nullptr, nullptr, 7);
    check_attention({2, 1024, 4, 64, 2}, true, nullptr, nullptr, 300);
    check_attention({1, 2048, 2, 128}, true, nullptr, nullptr, 700);
  }
  check_attention({2, 1024, 4, 64, 2}, true, nullptr, &alibi, 200);
  check_attention({1, 333, 4, 128, 1}, true, &drop, &alibi, 150);
}

// RMSNorm (forward, the fused residual add, backward with accumulated dinp and dweight) at a
// Llama-like width and at an awkward one.
TEST_P(CudaOpsDtype, RmsNormMatchesCpu) {
  for (const auto& [N, C] : std::vector<std::pair<int64_t, int64_t>>{{1024, 2048}, {23, 77}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " C " + std::to_string(C));
    Tensor x = rnd({N, C}), w = rnd({C}), dy = rnd({N, C}), a = rnd({N, C});
    Tensor y({N, C}, d()), r({N});
    cpu_->rmsnorm_forward(y, r, x, w, 1e-6);
    Tensor yd = poisoned({N, C}, d()), rd = poisoned({N}), xd = dev(x), wd = dev(w);
    gpu_->rmsnorm_forward(yd, rd, xd, wd, 1e-6);
    expect_close(yd, y, tol(1e-5), "rmsnorm out");
    expect_close(rd, r, 1e-5, "rmsnorm rstd (f32)");
    // Accumulated gradients: dinp onto a residual gradient, dweight onto what is there.
    Tensor base = rnd({N, C}), dw = rand({C});
    Tensor dx(base.shape(), d());
    std::memcpy(dx.raw(), base.raw(), base.nbytes());
    Tensor dxd = dev(base), dwd = dev(dw), dyd = dev(dy);
    cpu_->rmsnorm_backward(dx, dw, dy, x, w, r);
    gpu_->rmsnorm_backward(dxd, dwd, dyd, xd, wd, rd);
    expect_close(dxd, dx, tol(1e-5), "rmsnorm dinp (accumulated)");
    expect_close(dwd, dw, d() == DType::F32 ? 1e-5 : 1e-3, "rmsnorm dweight (f32, accumulated)");
    // The fused residual add + RMSNorm equals add then rmsnorm.
    Tensor s2({N, C}, d()), y2({N, C}, d()), r2({N});
    cpu_->add_rmsnorm_forward(s2, y2, r2, a, x, w, 1e-6);
    Tensor s2d = poisoned({N, C}, d()), y2d = poisoned({N, C}, d()), r2d = poisoned({N}),
           ad = dev(a);
    gpu_->add_rmsnorm_forward(s2d, y2d, r2d, ad, xd, wd, 1e-6);
    expect_close(s2d, s2, tol(1e-7), "fused residual sum");
    expect_close(y2d, y2, tol(1e-5), "fused rmsnorm out");
    expect_close(r2d, r2, 1e-5, "fused rmsnorm rstd (f32)");
  }
}

// SwiGLU forward and backward at a Llama-like MLP width (F = 2816 per rank) and an odd one.
TEST_P(CudaOpsDtype, SwigluMatchesCpu) {
  for (const auto& [N, F] : std::vector<std::pair<int64_t, int64_t>>{{1024, 2816}, {19, 77}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " F " + std::to_string(F));
    Tensor x = rnd({N, 2 * F}, 2.f), dy = rnd({N, F});
    Tensor y({N, F}, d()), dx({N, 2 * F}, d());
    cpu_->swiglu_forward(y, x);
    cpu_->swiglu_backward(dx, x, dy);
    Tensor xd = dev(x), dyd = dev(dy), yd = poisoned({N, F}, d()), dxd = poisoned({N, 2 * F}, d());
    gpu_->swiglu_forward(yd, xd);
    gpu_->swiglu_backward(dxd, xd, dyd);
    expect_close(yd, y, tol(1e-5), "swiglu out");
    expect_close(dxd, dx, tol(1e-5), "swiglu dinp (overwritten)");
    if (F % 8 != 0) continue;
    // The same rows from views one element off 16-byte alignment take the element kernels: the
    // 16-byte kernels' results bit for bit.
    Tensor xb = dev(rnd({N * 2 * F + 1})), dyb = dev(rnd({N * F + 1})),
           yb = poisoned({N * F + 1}, d()), dxb = poisoned({N * 2 * F + 1}, d());
    Tensor xv = xb.view(1, {N, 2 * F}), dyv = dyb.view(1, {N, F}), yv = yb.view(1, {N, F}),
           dxv = dxb.view(1, {N, 2 * F});
    gpu_->copy_from_host(xv, x.raw());
    gpu_->copy_from_host(dyv, dy.raw());
    gpu_->swiglu_forward(yv, xv);
    gpu_->swiglu_backward(dxv, xv, dyv);
    EXPECT_EQ(std::memcmp(host(yv).raw(), host(yd).raw(), host(yd).nbytes()), 0)
        << "swiglu out: element and 16-byte kernels";
    EXPECT_EQ(std::memcmp(host(dxv).raw(), host(dxd).raw(), host(dxd).nbytes()), 0)
        << "swiglu dinp: element and 16-byte kernels";
  }
}

// Squared ReLU (--squared-relu) forward and backward (in place, as the model calls it) at a
// training-like width and an odd one.
TEST_P(CudaOpsDtype, SquaredReluMatchesCpu) {
  for (const auto& [N, F] : std::vector<std::pair<int64_t, int64_t>>{{1024, 3072}, {19, 77}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " F " + std::to_string(F));
    Tensor x = rnd({N, F}, 2.f), dy = rnd({N, F});
    Tensor y({N, F}, d()), dx({N, F}, d());
    cpu_->squared_relu_forward(y, x);
    std::memcpy(dx.raw(), dy.raw(), dy.nbytes());
    cpu_->squared_relu_backward(dx, x, dx);
    Tensor xd = dev(x), yd = poisoned({N, F}, d()), dxd = dev(dy);
    gpu_->squared_relu_forward(yd, xd);
    gpu_->squared_relu_backward(dxd, xd, dxd);
    expect_close(yd, y, tol(1e-6), "squared relu out");
    expect_close(dxd, dx, tol(1e-6), "squared relu dinp (in place)");
  }
}

// RoPE on a GQA qkv (8 query and 2 key/value heads of 128, rotary_percent 0.5: 64 features
// rotate), positions r % seq_len and from a position tensor (generation-like, up to 4096), the
// latter again with Llama 3's frequency scaling (base 500000, factor 8) and then with interleaved
// pairs (--rotary-interleaved), then the inverse rotation. The value heads and the features past
// rot_dim must come back untouched.
TEST_P(CudaOpsDtype, RopeMatchesCpu) {
  RopeSpec spec;
  spec.heads = 8;
  spec.kv_heads = 2;
  spec.head_dim = 128;
  spec.rot_dim = 64;
  spec.base = 10000;
  spec.seq_len = 300;
  const int64_t N = 600, C3 = (spec.heads + 2 * spec.kv_heads) * spec.head_dim;
  Tensor pos = ids({N}, 4096);
  for (const int variant : {0, 1, 2, 3}) {
    const bool with_positions = variant > 0;
    if (variant == 2) {
      spec.base = 500000;
      spec.scaling.factor = 8;
    }
    if (variant == 3) spec.interleaved = true;  // --rotary-interleaved: pairs (2i, 2i+1)
    SCOPED_TRACE(variant == 0   ? "r % seq_len"
                 : variant == 1 ? "positions tensor"
                 : variant == 2 ? "llama3 scaling"
                                : "interleaved pairs");
    const Tensor x = rnd({N, C3});
    Tensor y(x.shape(), d());
    std::memcpy(y.raw(), x.raw(), x.nbytes());
    Tensor yd = dev(x), posd = dev(pos);
    const Tensor* p = with_positions ? &pos : nullptr;
    const Tensor* pd = with_positions ? &posd : nullptr;
    cpu_->rope(y, spec, p, false);
    gpu_->rope(yd, spec, pd, false);
    expect_close(yd, y, tol(1e-5), "rope");
    const Tensor got = host(yd);
    const size_t es = dtype_size(d());
    const char *g = static_cast<const char*>(got.raw()), *in = static_cast<const char*>(x.raw());
    const int64_t rotated = spec.heads + spec.kv_heads, v0 = rotated * spec.head_dim;
    for (int64_t r = 0; r < N; ++r) {  // bit for bit the input
      ASSERT_EQ(std::memcmp(g + (r * C3 + v0) * es, in + (r * C3 + v0) * es,
                            spec.kv_heads * spec.head_dim * es),
                0)
          << "value heads of row " << r;
      for (int64_t h = 0; h < rotated; ++h) {
        const int64_t at = r * C3 + h * spec.head_dim + spec.rot_dim;
        ASSERT_EQ(std::memcmp(g + at * es, in + at * es, (spec.head_dim - spec.rot_dim) * es), 0)
            << "features past rot_dim of row " << r << " head " << h;
      }
    }
    cpu_->rope(y, spec, p, true);
    gpu_->rope(yd, spec, pd, true);
    expect_close(yd, y, tol(1e-5), "rope inverse");
    expect_close(yd, x, tol(1e-5), "rope inverse undoes rope");
  }
}

// Hidden dropout: every element as the CPU draws it, with a row offset (sequence parallelism).
TEST_P(CudaOpsDtype, HiddenDropoutMatchesCpu) {
  const DropoutSpec dr = make_dropout_spec(0.1, 5, 3, 2, DropoutKind::MlpOut, 17);
  const int64_t rows = 96, C = 771;  // C not a multiple of 4: groups straddle rows
  Tensor x = rnd({rows, C}), y({rows, C}, d());
  cpu_->dropout(y, x, dr, 32, 64);
  Tensor xd = dev(x), yd = poisoned({rows, C}, d());
  gpu_->dropout(yd, xd, dr, 32, 64);
  const Tensor got = host(yd);
  EXPECT_EQ(std::memcmp(got.raw(), y.raw(), y.nbytes()), 0) << "the same mask and rounding";
  gpu_->dropout(xd, xd, dr, 32, 64);  // in place
  const Tensor again = host(xd);
  EXPECT_EQ(std::memcmp(again.raw(), y.raw(), y.nbytes()), 0) << "in place";
}

TEST_P(CudaOpsDtype, CastRoundsLikeTheCpu) {
  Tensor f = rand({1001}, 100.f);
  Tensor h(f.shape(), d()), hd = poisoned({1001}, d()), fd = dev(f);
  cpu_->cast(h, f);
  gpu_->cast(hd, fd);
  const Tensor back = host(hd);
  EXPECT_EQ(std::memcmp(back.raw(), h.raw(), h.nbytes()), 0) << "round to nearest even";
}

TEST_P(CudaOpsDtype, MatmulForwardBackward) {
  const int64_t N = 37, IC = 29, OC = 51;
  Tensor x = rnd({N, IC}), w = rnd({OC, IC}), b = rnd({OC}), dy = rnd({N, OC});
  Tensor y({N, OC}, d());
  cpu_->matmul_forward(y, x, w, &b);
  Tensor yd = poisoned({N, OC}, d()), xd = dev(x), wd = dev(w), bd = dev(b);
  gpu_->matmul_forward(yd, xd, wd, &bd);
  expect_close(yd, y, tol(1e-5), "matmul out");
  // Parameter gradients are f32 and accumulate onto what is there.
  Tensor dx({N, IC}, d()), dw = rand({OC, IC}), db = rand({OC});
  Tensor dwd = dev(dw), dbd = dev(db);
  cpu_->matmul_backward(&dx, dw, &db, dy, x, w);
  Tensor dxd = poisoned({N, IC}, d()), dyd = dev(dy);
  gpu_->matmul_backward(&dxd, dwd, &dbd, dyd, xd, wd);
  expect_close(dxd, dx, tol(1e-5), "dinp");
  expect_close(dwd, dw, d() == DType::F32 ? 1e-5 : 1e-4, "dweight (f32)");
  expect_close(dbd, db, d() == DType::F32 ? 1e-5 : 1e-4, "dbias (f32)");
}

// The MLP's fc2 backward through its GELU at a training shape (GPT-2 124M's MLP over 2048
// tokens): in bf16/f16 the GELU's derivative in cuBLASLt's DGELU epilogue (the product rounded
// once, the CPU's twice: within the dtype's tolerance), f32 the GEMM and the GELU kernel; the
// weight and bias gradients accumulate as matmul_backward's. Also at a shape the epilogue does
// not take (widths not multiples of 8): the composed path.
TEST_P(CudaOpsDtype, MatmulGeluBackwardMatchesCpu) {
  for (const auto& [N, FF, C] : {std::make_tuple(int64_t(2048), int64_t(3072), int64_t(768)),
                                 std::make_tuple(int64_t(37), int64_t(29), int64_t(51))}) {
    SCOPED_TRACE("N " + std::to_string(N) + " FF " + std::to_string(FF) + " C " +
                 std::to_string(C));
    Tensor pre = rnd({N, FF}), act({N, FF}, d()), w = rnd({C, FF}, 0.05f), dy = rnd({N, C});
    cpu_->gelu_forward(act, pre);
    Tensor dpre({N, FF}, d()), dw = rand({C, FF}), db = rand({C});
    Tensor dwd = dev(dw), dbd = dev(db);
    cpu_->matmul_gelu_backward(dpre, dw, &db, dy, act, w, pre);
    Tensor dpred = poisoned({N, FF}, d());
    gpu_->matmul_gelu_backward(dpred, dwd, &dbd, dev(dy), dev(act), dev(w), dev(pre));
    expect_close(dpred, dpre, tol(1e-5), "dpre");
    expect_close(dwd, dw, d() == DType::F32 ? 1e-5 : 1e-4, "fc2 dweight (f32)");
    expect_close(dbd, db, d() == DType::F32 ? 1e-5 : 1e-4, "fc2 dbias (f32)");
  }
}

// The MLP's fc1 with its GELU as generation runs it: one decode row and a 64-row prefill of
// GPT-2 124M (768 -> 3072), with and without the bias. In bf16/f16 cuBLASLt's GELU_BIAS / GELU
// epilogue (the GELU of the f32 product, rounded once; the CPU rounds the product first), f32 the
// GEMM and the GELU kernel; a width not a multiple of 8 takes the composed path.
TEST_P(CudaOpsDtype, MatmulGeluForwardMatchesCpu) {
  for (const auto& [N, C, FF] : {std::make_tuple(int64_t(1), int64_t(768), int64_t(3072)),
                                 std::make_tuple(int64_t(64), int64_t(768), int64_t(3072)),
                                 std::make_tuple(int64_t(37), int64_t(29), int64_t(51))}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE("N " + std::to_string(N) + " C " + std::to_string(C) + " FF " +
                   std::to_string(FF) + (with_bias ? " bias" : " no bias"));
      Tensor x = rnd({N, C}), w = rnd({FF, C}, 0.05f), b = rnd({FF});
      Tensor y({N, FF}, d()), pre({N, FF}, d());
      cpu_->matmul_gelu_forward(y, pre, x, w, with_bias ? &b : nullptr);
      Tensor bd = dev(b), yd = poisoned({N, FF}, d()), pred = poisoned({N, FF}, d());
      gpu_->matmul_gelu_forward(yd, pred, dev(x), dev(w), with_bias ? &bd : nullptr);
      expect_close(yd, y, tol(1e-5), "gelu(x w^T + b)");
    }
  }
}

// A training shape (GPT-2's QKV projection over 2048 tokens), aligned: in bf16 and f16 the
// forward takes the cuBLASLt bias epilogue; again with bias and weight views 8 bytes off alignment,
// which take the bias-fill + GEMM path. Both must match the CPU.
TEST_P(CudaOpsDtype, MatmulBiasAtTrainingShape) {
  const int64_t N = 2048, IC = 768, OC = 2304;
  Tensor x = rnd({N, IC}), w = rnd({OC, IC}, 0.05f), b = rnd({OC});
  Tensor y({N, OC}, d());
  cpu_->matmul_forward(y, x, w, &b);
  Tensor yd = poisoned({N, OC}, d()), xd = dev(x), wd = dev(w), bd = dev(b);
  gpu_->matmul_forward(yd, xd, wd, &bd);
  expect_close(yd, y, tol(1e-5), "matmul out (aligned)");
  Tensor wb = rnd({OC * IC + OC + 8}, 0.05f);  // weight and bias views at element offset 4
  Tensor wv = wb.view(4, {OC, IC}), bv = wb.view(4 + OC * IC, {OC});
  Tensor y2({N, OC}, d());
  cpu_->matmul_forward(y2, x, wv, &bv);
  Tensor wbd = dev(wb), y2d = poisoned({N, OC}, d());
  Tensor wvd = wbd.view(4, {OC, IC}), bvd = wbd.view(4 + OC * IC, {OC});
  gpu_->matmul_forward(y2d, xd, wvd, &bvd);
  expect_close(y2d, y2, tol(1e-5), "matmul out (misaligned views)");
}

TEST_P(CudaOpsDtype, LayerNormGeluAdd) {
  const int64_t N = 23, C = 77;
  Tensor x = rnd({N, C}), w = rnd({C}), b = rnd({C}), dy = rnd({N, C});
  Tensor y({N, C}, d()), m({N}), r({N});
  cpu_->layernorm_forward(y, m, r, x, w, b, 1e-5);
  Tensor yd = poisoned({N, C}, d()), md = poisoned({N}), rd = poisoned({N}), xd = dev(x),
         wd = dev(w), bd = dev(b);
  gpu_->layernorm_forward(yd, md, rd, xd, wd, bd, 1e-5);
  expect_close(yd, y, tol(1e-5), "layernorm out");
  expect_close(md, m, 1e-5, "mean (f32)");
  expect_close(rd, r, 1e-5, "rstd (f32)");
  Tensor base = rnd({N, C});
  Tensor dx(base.shape(), d());
  std::memcpy(dx.raw(), base.raw(), base.nbytes());
  Tensor dw = Tensor::zeros({C}), db = Tensor::zeros({C});
  cpu_->layernorm_backward(dx, dw, db, dy, x, w, m, r);
  Tensor dxd = dev(base), dwd = dev(Tensor::zeros({C})), dbd = dev(Tensor::zeros({C})),
         dyd = dev(dy);
  gpu_->layernorm_backward(dxd, dwd, dbd, dyd, xd, wd, md, rd);
  expect_close(dxd, dx, tol(1e-5), "layernorm dinp (accumulated)");
  expect_close(dwd, dw, d() == DType::F32 ? 1e-5 : 1e-3, "layernorm dweight (f32)");
  expect_close(dbd, db, d() == DType::F32 ? 1e-5 : 1e-3, "layernorm dbias (f32)");
  Tensor g({N, C}, d()), gd = poisoned({N, C}, d());
  cpu_->gelu_forward(g, x);
  gpu_->gelu_forward(gd, xd);
  expect_close(gd, g, tol(1e-6), "gelu");
  cpu_->gelu_backward(g, x, dy);
  gpu_->gelu_backward(gd, xd, dyd);
  expect_close(gd, g, tol(1e-6), "gelu backward");
  Tensor s({N, C}, d()), sd = poisoned({N, C}, d());
  cpu_->add(s, x, dy);
  gpu_->add(sd, xd, dyd);
  expect_close(sd, s, tol(1e-7), "add");
  // The fused residual add + LayerNorm equals add then layernorm.
  Tensor s2({N, C}, d()), y2({N, C}, d()), m2({N}), r2({N});
  cpu_->add_layernorm_forward(s2, y2, m2, r2, x, dy, w, b, 1e-5);
  Tensor s2d = poisoned({N, C}, d()), y2d = poisoned({N, C}, d()), m2d = poisoned({N}),
         r2d = poisoned({N});
  gpu_->add_layernorm_forward(s2d, y2d, m2d, r2d, xd, dyd, wd, bd, 1e-5);
  expect_close(s2d, s2, tol(1e-7), "fused residual sum");
  expect_close(y2d, y2, tol(1e-5), "fused layernorm out");
  expect_close(r2d, r2, d() == DType::F32 ? 1e-5 : 1e-3, "fused rstd");
}

TEST_P(CudaOpsDtype, AttentionForwardBackward) {
  gpu_->set_attention_backend(AttentionBackend::Flash, false);  // Tessera's kernels
  // hd 5: the generic kernels; 32, 64, 128: the tiled ones, with T not a multiple of the tiles.
  for (const AttentionCase c : {AttentionCase{2, 67, 3, 5}, AttentionCase{2, 100, 2, 32},
                                AttentionCase{1, 131, 2, 64}, AttentionCase{1, 70, 1, 128}})
    check_attention(c, false);
}

// Training shapes: the tensor-core kernels in bf16 and f16 (and the scalar ones in f32) at
// T 1024 and 2048, head dims 64 and 128, batch > 1, fresh random inputs and poisoned outputs.
// Tolerances as above, relative to the largest reference value (bf16 2e-2, f16 4e-3).
TEST_P(CudaOpsDtype, AttentionAtTrainingShapes) {
  gpu_->set_attention_backend(AttentionBackend::Flash, false);  // Tessera's kernels
  for (const AttentionCase c : {AttentionCase{2, 1024, 4, 64}, AttentionCase{2, 2048, 2, 128}})
    check_attention(c, true);
}

// cuDNN's fused attention (--attention-backend fused) at the training shapes, multi-head and
// grouped-query, head dims 64 and 128, with and without --deterministic-mode: against the CPU
// (forward, lse, and the backward from the GPU's own forward, as in training), then against
// Tessera's flash kernels on the same device inputs; the deterministic backward twice gives the
// same bits. On sm_90 (the H100/H200 this is measured on) cuDNN must run these shapes: a refusal
// fails there and skips elsewhere, with cuDNN's reason. f32 is refused with a reason.
TEST_P(CudaOpsDtype, FusedAttentionMatchesCpuAndFlash) {
  gpu_->set_attention_backend(AttentionBackend::Fused, false);
  AttentionCall call;
  call.dtype = d();
  call.batch = 2;
  call.seq = 1024;
  call.heads = call.kv_heads = 4;
  call.head_dim = 64;
  if (d() == DType::F32) {
    try {
      gpu_->attention_plan(call);
      ADD_FAILURE() << "fused accepted f32";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("bf16 or f16"), std::string::npos) << e.what();
    }
    return;
  }
  std::string plan;
  try {
    plan = gpu_->attention_plan(call);
  } catch (const ConfigError& e) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    if (major != 9) GTEST_SKIP() << e.what();
    FAIL() << e.what();
  }
  std::printf("fused attention: %s\n", plan.c_str());
  EXPECT_NE(plan.find("cuDNN fused attention"), std::string::npos) << plan;
  for (bool det : {false, true}) {
    SCOPED_TRACE(det ? "deterministic" : "atomics");
    gpu_->set_attention_backend(AttentionBackend::Fused, det);
    repeatable_ = det;
    check_attention(AttentionCase{2, 1024, 4, 64}, true);
    check_attention(AttentionCase{2, 2048, 8, 128, 2}, true);
  }
  repeatable_ = true;
  // Fused against flash on the same inputs (grouped-query, head dim 128).
  const int64_t B = 2, T = 1024, H = 8, G = 2, hd = 128, C3 = (H + 2 * G) * hd;
  const Tensor qkv = dev(rnd({B, T, C3})), dout = dev(rnd({B, T, H * hd}));
  Tensor out[2], lse[2], dqkv[2];
  const AttentionBackend which[2] = {AttentionBackend::Flash, AttentionBackend::Fused};
  for (int i = 0; i < 2; ++i) {
    gpu_->set_attention_backend(which[i], true);
    out[i] = poisoned({B, T, H * hd}, d());
    lse[i] = poisoned({B, H, T});
    dqkv[i] = poisoned({B, T, C3}, d());
    gpu_->attention_forward(out[i], lse[i], qkv, H, nullptr, G);
    gpu_->attention_backward(dqkv[i], dout, qkv, out[i], lse[i], H, nullptr, G);
  }
  expect_close(out[1], host(out[0]), tol(1e-5), "fused vs flash out");
  expect_close(lse[1], host(lse[0]), 1e-3, "fused vs flash lse");
  expect_close(dqkv[1], host(dqkv[0]), tol(1e-4), "fused vs flash dqkv");
}

// --attention-backend auto: cuDNN where it runs the call, and Tessera's kernels with the reason
// where it does not (attention dropout, ALiBi, f32); flash, unfused and local as named.
TEST_P(CudaOpsDtype, AttentionBackendChoiceIsSaid) {
  AttentionCall call;
  call.dtype = d();
  call.batch = 2;
  call.seq = 512;
  call.heads = 4;
  call.kv_heads = 2;
  call.head_dim = 64;
  gpu_->set_attention_backend(AttentionBackend::Auto, false);
  const std::string plain = gpu_->attention_plan(call);
  std::printf("auto, %s: %s\n", dtype_name(d()), plain.c_str());
  if (d() == DType::F32) {
    EXPECT_NE(plain.find("generic kernels"), std::string::npos) << plain;
  }
  call.dropout = true;
  const std::string dropped = gpu_->attention_plan(call);
  EXPECT_NE(dropped.find("attention dropout is on"), std::string::npos) << dropped;
  EXPECT_EQ(dropped.find("cuDNN fused attention"), std::string::npos) << dropped;
  call.dropout = false;
  call.alibi = true;
  EXPECT_NE(gpu_->attention_plan(call).find("ALiBi is on"), std::string::npos);
  call.alibi = false;
  gpu_->set_attention_backend(AttentionBackend::Unfused, false);
  EXPECT_NE(gpu_->attention_plan(call).find("generic kernels"), std::string::npos);
  gpu_->set_attention_backend(AttentionBackend::Flash, false);
  EXPECT_NE(gpu_->attention_plan(call).find(d() == DType::F32 ? "generic" : "flash kernels"),
            std::string::npos);
  call.dropout = true;  // fused with dropout: an error naming the reason
  gpu_->set_attention_backend(AttentionBackend::Fused, false);
  try {
    gpu_->attention_plan(call);
    ADD_FAILURE() << "fused accepted attention dropout";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--attention-backend fused: "), std::string::npos);
  }
}

// The embedding backward at a training shape (GPT-2's C, 8192 tokens, a vocabulary shard, many
// repeats, ids of other shards): bitwise equal to the CPU, which adds each row's tokens in the same
// order; a misaligned view of the gradient takes the scalar-load path.
TEST_P(CudaOpsDtype, EmbeddingBackwardAtTrainingShape) {
  const int64_t N = 8192, C = 768, V = 25000, begin = 12000;
  Tensor id = ids({N}, 50257), dy = rnd({N, C});
  for (int64_t i = 0; i < N; i += 7) id.i32()[i] = 13000;  // a very frequent token
  Tensor dt = rand({V, C}), dtd = dev(dt), idd = dev(id), dyd = dev(dy);
  cpu_->embedding_backward(dt, dy, id, begin);
  gpu_->embedding_backward(dtd, dyd, idd, begin);
  const Tensor got = host(dtd);
  EXPECT_EQ(std::memcmp(got.raw(), dt.raw(), dt.nbytes()), 0) << "embedding backward, 16-byte path";
  Tensor big = rand({V * C + 1}), bigd = dev(big);
  Tensor view = big.view(1, {V, C}), viewd = bigd.view(1, {V, C});
  cpu_->embedding_backward(view, dy, id, begin);
  gpu_->embedding_backward(viewd, dyd, idd, begin);
  const Tensor got2 = host(bigd);
  EXPECT_EQ(std::memcmp(got2.raw(), big.raw(), big.nbytes()), 0)
      << "embedding backward, scalar path";
}

TEST_P(CudaOpsDtype, EmbeddingsAndCrossEntropy) {
  const int64_t N = 19, C = 33, V = 41, begin = 10;
  Tensor table = rnd({V, C}), id = ids({N}, 60), dy = rnd({N, C});
  Tensor y({N, C}, d()), yd = poisoned({N, C}, d()), td = dev(table), idd = dev(id);
  cpu_->embedding_forward(y, id, table, begin);
  gpu_->embedding_forward(yd, idd, td, begin);
  expect_close(yd, y, 0, "embedding");
  Tensor dt = Tensor::zeros({V, C}), dtd = dev(Tensor::zeros({V, C})), dyd = dev(dy);
  cpu_->embedding_backward(dt, dy, id, begin);
  gpu_->embedding_backward(dtd, dyd, idd, begin);
  expect_close(dtd, dt, 1e-6, "embedding backward (f32)");
  Tensor wpe = rnd({40, C}), seq = rnd({1, N, C}), seqd = dev(seq), wped = dev(wpe);
  cpu_->position_embedding_forward(seq, wpe);
  gpu_->position_embedding_forward(seqd, wped);
  expect_close(seqd, seq, tol(1e-6), "position embedding");
  Tensor dwpe = Tensor::zeros({40, C}), dwped = dev(Tensor::zeros({40, C}));
  cpu_->position_embedding_backward(dwpe, seq);
  gpu_->position_embedding_backward(dwped, seqd);
  expect_close(dwped, dwpe, 1e-5, "position embedding backward (f32)");
  // Cross-entropy over a shard with padding columns and an ignored row.
  Tensor logits = rnd({N, V}, 3.f), targets = ids({N}, 50);
  targets.i32()[4] = -1;
  const int64_t valid = 35, col = 7;
  Tensor mx({N}), se({N}), tl({N}), loss({N});
  Tensor lgd = dev(logits), tgd = dev(targets), mxd = poisoned({N}), sed = poisoned({N}),
         tld = poisoned({N}), lossd = poisoned({N});
  cpu_->xent_row_max(mx, logits, valid);
  cpu_->xent_row_sums(se, tl, logits, mx, targets, valid, col);
  cpu_->xent_loss_and_grad(loss, logits, mx, se, tl, targets, valid, col, 0.25f);
  gpu_->xent_row_max(mxd, lgd, valid);
  gpu_->xent_row_sums(sed, tld, lgd, mxd, tgd, valid, col);
  gpu_->xent_loss_and_grad(lossd, lgd, mxd, sed, tld, tgd, valid, col, 0.25f);
  expect_close(lossd, loss, 1e-5, "losses (f32)");
  expect_close(lgd, logits, tol(1e-5), "dlogits");
}

// The MoE ops on the device (moe.cu) against the host reference at a Mixtral-like routing (8
// experts, top 2, capacity 1.0 so some slots drop) with 16-byte rows (C 256) and element rows
// (C 100): routing (experts, rows, counts exact; weights 1e-6), scores, permutation both ways, and
// the router's backward with the load-balancing and z-loss terms.
// DeepSeek-V3's router at its shape (256 experts in 8 groups, the best 4 groups by the sum of
// their top 2, the top 8; sigmoid scores plus the aux-loss-free bias for the choice, weights
// renormalized and scaled by 2.5): the device's choice equals the CPU's (a choice score within an
// ulp of another may swap: at most 1% of tokens), weights within 1e-6 where they agree.
TEST_F(CudaOps, DeepSeekRouterMatchesCpu) {
  const int64_t N = 512, E = 256, K = 8;
  MoERouting r;
  r.experts = static_cast<int>(E);
  r.topk = static_cast<int>(K);
  r.sigmoid = true;
  r.scaling = 2.5;
  r.groups = 8;
  r.group_topk = 4;
  r.group_score = 2;
  for (int e = 0; e < E; ++e) r.expert_bias.push_back(0.05f * std::sin(0.37f * e));
  const Tensor logits = rand({N, E}, 2.f);
  Tensor ex({N, K}, DType::I32), w({N, K}), row({N, K}, DType::I32);
  std::vector<int64_t> routed, kept, routed_d, kept_d;
  cpu_->moe_route(ex, w, row, logits, r, N, routed, kept);
  Tensor lgd = dev(logits), exd = poisoned({N, K}, DType::I32), wd = poisoned({N, K}),
         rowd = poisoned({N, K}, DType::I32);
  gpu_->moe_route(exd, wd, rowd, lgd, r, N, routed_d, kept_d);
  const Tensor exh = host(exd), wh = host(wd);
  int differ = 0;
  for (int64_t n = 0; n < N; ++n) {
    bool same = true;
    for (int64_t k = 0; k < K; ++k) same &= exh.i32()[n * K + k] == ex.i32()[n * K + k];
    differ += !same;
    if (same)
      for (int64_t k = 0; k < K; ++k)
        EXPECT_NEAR(wh.f32()[n * K + k], w.f32()[n * K + k], 1e-6) << n;
  }
  EXPECT_LE(differ, N / 100) << "tokens whose experts differ";
  // Every chosen expert lies in one of the token's 4 groups.
  for (int64_t n = 0; n < N; ++n) {
    std::set<int> groups;
    for (int64_t k = 0; k < K; ++k) groups.insert(exh.i32()[n * K + k] / 32);
    EXPECT_LE(groups.size(), 4u) << n;
  }
}

TEST_P(CudaOpsDtype, MoeOpsMatchCpu) {
  for (const int64_t C : {256, 100}) {
    SCOPED_TRACE("C " + std::to_string(C));
    const int64_t N = 512, E = 8, K = 2, group = 128;
    MoERouting r;
    r.experts = static_cast<int>(E);
    r.topk = static_cast<int>(K);
    r.capacity_factor = 1.0;
    const Tensor logits = rand({N, E}, 2.f);
    Tensor ex({N, K}, DType::I32), w({N, K}), row({N, K}, DType::I32);
    std::vector<int64_t> routed, kept, routed_d, kept_d;
    const int64_t R = cpu_->moe_route(ex, w, row, logits, r, group, routed, kept);
    Tensor lgd = dev(logits), exd = poisoned({N, K}, DType::I32), wd = poisoned({N, K}),
           rowd = poisoned({N, K}, DType::I32);
    const int64_t Rd = gpu_->moe_route(exd, wd, rowd, lgd, r, group, routed_d, kept_d);
    ASSERT_EQ(Rd, R);
    EXPECT_EQ(routed_d, routed);
    EXPECT_EQ(kept_d, kept);
    const Tensor exh = host(exd), rowh = host(rowd);
    ASSERT_EQ(std::memcmp(exh.raw(), ex.raw(), ex.nbytes()), 0) << "experts (dropped: -1 - e)";
    ASSERT_EQ(std::memcmp(rowh.raw(), row.raw(), row.nbytes()), 0) << "rows";
    expect_close(wd, w, 1e-6, "routing weights");

    std::vector<double> sums, sums_d;
    double lse = 0, lse_d = 0;
    cpu_->moe_router_stats(logits, r, group, sums, lse);
    gpu_->moe_router_stats(lgd, r, group, sums_d, lse_d);
    ASSERT_EQ(sums_d.size(), sums.size());
    for (size_t i = 0; i < sums.size(); ++i) EXPECT_NEAR(sums_d[i], sums[i], 1e-4) << i;
    EXPECT_NEAR(lse_d, lse, 1e-5 * lse);

    const Tensor x = rnd({N, C}), out = rnd({R, C}), dy = rnd({N, C});
    Tensor xp({R, C}, d()), y({N, C}, d()), dout({R, C}, d()), dw({N, K}), dx({N, C}, d());
    cpu_->moe_permute(xp, x, row);
    cpu_->moe_unpermute(y, out, row, w);
    cpu_->moe_unpermute_backward(dout, dw, dy, out, row, w);
    cpu_->moe_permute_backward(dx, dout, row);
    Tensor xpd = poisoned({R, C}, d()), yd = poisoned({N, C}, d()), doutd = poisoned({R, C}, d()),
           dwd = poisoned({N, K}), dxd = poisoned({N, C}, d()), xd = dev(x), outd = dev(out),
           dyd = dev(dy);
    gpu_->moe_permute(xpd, xd, rowd);
    gpu_->moe_unpermute(yd, outd, rowd, wd);
    gpu_->moe_unpermute_backward(doutd, dwd, dyd, outd, rowd, wd);
    gpu_->moe_permute_backward(dxd, doutd, rowd);
    expect_close(xpd, xp, 0.0, "permuted rows (a copy)");
    expect_close(yd, y, tol(1e-6), "unpermuted output");
    expect_close(doutd, dout, tol(1e-6), "permuted gradient");
    expect_close(dwd, dw, d() == DType::F32 ? 1e-5 : 1e-3, "routing weights' gradient (f32)");
    expect_close(dxd, dx, tol(1e-6), "input gradient");

    const Tensor dwr = rand({N, K});
    std::vector<double> aux(static_cast<size_t>(N / group * E));
    for (size_t i = 0; i < aux.size(); ++i) aux[i] = 0.01 * static_cast<double>(i % 7);
    Tensor dz({N, E}), dzd = poisoned({N, E}), dwrd = dev(dwr);
    cpu_->moe_router_backward(dz, logits, ex, w, dwr, r, group, aux, 1e-3);
    gpu_->moe_router_backward(dzd, lgd, exd, wd, dwrd, r, group, aux, 1e-3);
    expect_close(dzd, dz, 1e-5, "router logits' gradient (f32)");
  }
}

// The experts' grouped GEMMs (cublasGemmGroupedBatchedEx): groups of different row counts (one
// empty) forward and backward against the CPU's GEMMs; dweight accumulates onto what it holds.
// The last group uses the first one's weight and gradient, as an expert's blocks from two sending
// ranks do under expert parallelism: both contributions must land (no race in one grouped call).
TEST_P(CudaOpsDtype, GroupedMatmulMatchesCpu) {
  const int64_t IC = 192, OC = 320;
  const std::vector<int64_t> rows = {37, 0, 256, 5, 64};
  const std::vector<size_t> owner = {0, 1, 2, 3, 0};  // whose weight and weight gradient
  std::vector<Tensor> x, w, dy, y, dx, dw, xd, wd, dyd, yd, dxd, dwd;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    x.push_back(rnd({r, IC}));
    w.push_back(rnd({OC, IC}, 0.1f));
    dy.push_back(rnd({r, OC}));
    y.emplace_back(Shape{r, OC}, d());
    dx.emplace_back(Shape{r, IC}, d());
    dw.push_back(rand({OC, IC}));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    xd.push_back(dev(x[i]));
    wd.push_back(dev(w[i]));
    dyd.push_back(dev(dy[i]));
    yd.push_back(poisoned({rows[i], OC}, d()));
    dxd.push_back(poisoned({rows[i], IC}, d()));
    dwd.push_back(dev(dw[i]));
  }
  std::vector<Backend::GroupedGemm> fc, fg, bc, bg;
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t o = owner[i];
    fc.push_back({&y[i], nullptr, &x[i], nullptr, &w[o]});
    fg.push_back({&yd[i], nullptr, &xd[i], nullptr, &wd[o]});
    bc.push_back({&dx[i], &dw[o], &x[i], &dy[i], &w[o]});
    bg.push_back({&dxd[i], &dwd[o], &xd[i], &dyd[i], &wd[o]});
  }
  cpu_->grouped_matmul_forward(fc);
  gpu_->grouped_matmul_forward(fg);
  cpu_->grouped_matmul_backward(bc);
  gpu_->grouped_matmul_backward(bg);
  for (size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE("group " + std::to_string(i) + " rows " + std::to_string(rows[i]));
    if (rows[i] > 0) {
      expect_close(yd[i], y[i], tol(1e-5), "out");
      expect_close(dxd[i], dx[i], tol(1e-5), "dinp");
    }
    if (owner[i] == i)
      expect_close(dwd[i], dw[i], d() == DType::F32 ? 1e-5 : 1e-2, "dweight (f32, accumulated)");
  }
}

// FP8 (fp8.cu) against the CPU emulation, in bf16 as training runs it: the amax and the scales
// exactly (the same conversion and f32 arithmetic); the FP8 GEMMs (cuBLASLt, TN, fast accumulation
// in the forward) to the rounding of the output and of cuBLASLt's accumulation. Hybrid formats: the
// output gradient in E5M2. GPT-2's QKV shape at 2048 tokens, and a small one.
TEST_F(CudaOps, Fp8MatchesTheCpuEmulation) {
  for (const auto& [N, IC, OC] : {std::make_tuple(int64_t(2048), int64_t(768), int64_t(2304)),
                                  std::make_tuple(int64_t(48), int64_t(32), int64_t(64))}) {
    SCOPED_TRACE("N " + std::to_string(N) + " IC " + std::to_string(IC) + " OC " +
                 std::to_string(OC));
    const DType bf = DType::BF16;
    Tensor x = as(bf, rand({N, IC}, 1.5f)), w = as(bf, rand({OC, IC}, 0.05f)),
           b = as(bf, rand({OC}, 0.1f)), dy = as(bf, rand({N, OC}, 1e-3f));
    Tensor xd = dev(x), wd = dev(w), bd = dev(b), dyd = dev(dy);
    // amax and current scales, per operand, exactly.
    const Fp8Format fmt[3] = {Fp8Format::E4M3, Fp8Format::E4M3, Fp8Format::E5M2};
    const Tensor* hx[3] = {&x, &w, &dy};
    const Tensor* dx3[3] = {&xd, &wd, &dyd};
    Tensor amax[3], scale[3], amax_d[3], scale_d[3];
    for (int i = 0; i < 3; ++i) {
      amax[i] = Tensor({1});
      scale[i] = Tensor({1});
      amax_d[i] = poisoned({1});
      scale_d[i] = poisoned({1});
      cpu_->fp8_amax(amax[i], *hx[i], false);
      cpu_->fp8_current_scale(scale[i], amax[i], fmt[i]);
      gpu_->fp8_amax(amax_d[i], *dx3[i], false);
      gpu_->fp8_current_scale(scale_d[i], amax_d[i], fmt[i]);
      EXPECT_EQ(host(amax_d[i]).f32()[0], amax[i].f32()[0]) << "amax " << i;
      EXPECT_EQ(host(scale_d[i]).f32()[0], scale[i].f32()[0]) << "scale " << i;
    }
    const Backend::Fp8Operand cx{&scale[0], fmt[0]}, cw{&scale[1], fmt[1]}, cg{&scale[2], fmt[2]};
    const Backend::Fp8Operand gx{&scale_d[0], fmt[0]}, gw{&scale_d[1], fmt[1]},
        gg{&scale_d[2], fmt[2]};
    Tensor y({N, OC}, bf), yd = poisoned({N, OC}, bf);
    cpu_->fp8_matmul_forward(y, x, w, &b, cx, cw);
    gpu_->fp8_matmul_forward(yd, xd, wd, &bd, gx, gw);
    expect_close(yd, y, 1e-2, "fp8 forward (bf16, fast accumulation)");
    Tensor dxh({N, IC}, bf), dwh = rand({OC, IC}, 1e-3f), dbh = rand({OC}, 1e-3f);
    Tensor dxg = poisoned({N, IC}, bf), dwg = dev(dwh), dbg = dev(dbh);
    cpu_->fp8_matmul_backward(&dxh, dwh, &dbh, dy, x, w, cg, cx, cw);
    gpu_->fp8_matmul_backward(&dxg, dwg, &dbg, dyd, xd, wd, gg, gx, gw);
    expect_close(dxg, dxh, 1e-2, "fp8 dgrad (bf16)");
    // Hopper's FP8 tensor cores keep ~14 significant bits inside a k-block even without fast
    // accumulation (cuBLASLt promotes to f32 between blocks); the CPU sums exact f32 products.
    // Measured on the H200 (2026-11-28): 3.4e-5 of max 0.33 (1.0e-4 relative) at N 2048.
    expect_close(dwg, dwh, 1e-3, "fp8 wgrad (f32, accumulated)");
    expect_close(dbg, dbh, 1e-4, "dbias from the unquantized gradient (f32)");
  }
  // Delayed scaling's update: the same function on both sides, bit for bit.
  Tensor hist = rand({3, 5}, 2.f), sc = rand({5}, 1.f), am = rand({5}, 3.f), fm({5});
  for (int i = 0; i < 5; ++i) {
    fm.f32()[i] = i % 2 ? 57344.f : 448.f;
    am.f32()[i] = std::fabs(am.f32()[i]);
  }
  am.f32()[2] = 0.f;  // keeps its scale
  Tensor hd = dev(hist), sd = dev(sc), ad = dev(am), fd = dev(fm);
  for (bool recent : {false, true}) {
    cpu_->fp8_delayed_update(hist, sc, am, fm, recent, 1);
    gpu_->fp8_delayed_update(hd, sd, ad, fd, recent, 1);
    for (int i = 0; i < 15; ++i) EXPECT_EQ(host(hd).f32()[i], hist.f32()[i]) << "history " << i;
    for (int i = 0; i < 5; ++i) EXPECT_EQ(host(sd).f32()[i], sc.f32()[i]) << "scale " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOpsDtype,
                         ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(dtype_name(i.param));
                         });

// Context parallelism's ring ops against the CPU: a ring block's attention (a causal diagonal
// block and an earlier owner's, grouped-query), without dropout and ALiBi (bf16/f16: the
// tensor-core kernels' ring mode) and with them keyed by global positions (the host path), with
// documents spanning the chunks (the whole samples' tables: each query row's first key of the
// block on the device), its backward from the rows' final output and log-sum-exp, the
// log-sum-exp merge at a row offset and the column copies of the K/V heads.
TEST_P(CudaOpsDtype, RingAttentionOpsMatchCpu) {
  const int64_t B = 2, Tn = 64, H = 4, G = 2, hd = 64, cp = 2, W = (H + 2 * G) * hd,
                KW = 2 * G * hd;
  const DType dt = d();
  AttentionDropout drop;
  drop.spec = make_dropout_spec(0.1, 7, 3, 2, DropoutKind::Attention, 40);
  drop.head_begin = 4;
  drop.heads_total = 8;
  AttentionAlibi alibi;
  alibi.head_begin = 4;
  alibi.heads_total = 8;
  Tensor qkv = rnd({B, Tn, W}), kv = rnd({B, Tn, KW}), dout = rnd({B, Tn, H * hd});
  Tensor qd = dev(qkv), kd = dev(kv), dd = dev(dout);
  // Documents of the whole samples (cp*Tn positions): [0, 5), [5, 17), [17, end) in sample 0,
  // [0, 9), [9, end) in sample 1: every rank-1 row still sees a key of both blocks.
  Tensor kb({B * cp * Tn}, DType::I32);
  for (int64_t t = 0; t < cp * Tn; ++t) {
    kb.i32()[t] = t < 5 ? 0 : t < 17 ? 5 : 17;
    kb.i32()[cp * Tn + t] = t < 9 ? 0 : 9;
  }
  const Tensor kbd = dev(kb);
  AttentionDocuments host_docs, dev_docs;
  host_docs.key_begin = &kb;
  dev_docs.key_begin = &kbd;
  for (int pass = 0; pass < 6; ++pass) {
    const int step = pass % 2;
    const bool keyed = pass == 2 || pass == 3;  // dropout and ALiBi on
    const bool documents = pass >= 4;           // the tensor-core blocks with documents
    SCOPED_TRACE("ring step " + std::to_string(step) + (keyed ? ", dropout and ALiBi" : "") +
                 (documents ? ", documents" : ""));
    const CpStepBlock s = cp_step_block(1, cp, step, Tn / 2);
    Backend::RingBlock b =
        ring_block_spec(s, 1, cp, H, G, keyed ? &drop : nullptr, keyed ? &alibi : nullptr);
    Backend::RingBlock bd = b;  // the device's block: its own copy of the tables
    if (documents) {
      b.docs = &host_docs;
      bd.docs = &dev_docs;
    }
    Tensor out({B, b.nq, H * hd}, dt), lse({B, H, b.nq});
    cpu_->ring_block_forward(out, lse, qkv, kv, b);
    Tensor od = poisoned({B, b.nq, H * hd}, dt), ld = poisoned({B, H, b.nq});
    gpu_->ring_block_forward(od, ld, qd, kd, bd);
    expect_close(od, out, tol(1e-5), "ring block out");
    expect_close(ld, lse, 1e-4, "ring block lse");
    // The backward from a final output and log-sum-exp of all T rows (the diagonal's here).
    Tensor gout({B, Tn, H * hd}, dt), glse({B, H, Tn});
    const Backend::RingBlock diag =
        ring_block_spec(cp_step_block(1, cp, 0, Tn / 2), 1, cp, H, G, b.dropout, b.alibi, b.docs);
    cpu_->ring_block_forward(gout, glse, qkv, kv, diag);
    Tensor dq({B, Tn, W}, dt), dk({B, Tn, KW}, dt);
    cpu_->zero(dq);
    cpu_->zero(dk);
    // Both sides add onto the same zeroed gradients (copied before the CPU adds its part).
    Tensor dqd = dev(dq), dkd = dev(dk);
    cpu_->ring_block_backward(dq, dk, dout, qkv, kv, gout, glse, b);
    gpu_->ring_block_backward(dqd, dkd, dd, qd, kd, dev(gout), dev(glse), bd);
    expect_close(dqd, dq, tol(1e-4), "ring block dq");
    expect_close(dkd, dk, tol(1e-4), "ring block dkv");
    // The merge of this block's part into the running output.
    Tensor run = rnd({B, Tn, H * hd}), run_lse = rand({B, H, Tn});
    Tensor rund = dev(run), run_lsed = dev(run_lse);
    cpu_->attention_merge(run, run_lse, out, lse, b.q0);
    gpu_->attention_merge(rund, run_lsed, dev(out), dev(lse), b.q0);
    expect_close(rund, run, tol(1e-6), "merged out");
    expect_close(run_lsed, run_lse, 1e-6, "merged lse");
  }
  // K/V heads out of qkv, and back into a zeroed dqkv.
  Tensor kvd = poisoned({B, Tn, KW}, dt);
  gpu_->copy_columns(kvd, 0, qd, H * hd, KW);
  Tensor kvh({B, Tn, KW}, dt);
  cpu_->copy_columns(kvh, 0, qkv, H * hd, KW);
  EXPECT_EQ(std::memcmp(host(kvd).raw(), kvh.raw(), kvh.nbytes()), 0) << "copy_columns";
  // MLA's per-head assembly in one launch: each K head's first hd / 2 columns to the front of a
  // head twice as wide, and one block broadcast to every head (src stride 0).
  const int64_t NB = KW / hd, half = hd / 2;
  Tensor wide = rnd({B, Tn, NB * 2 * hd}), wided = dev(wide);
  cpu_->copy_column_blocks(wide, 0, 2 * hd, kvh, 0, hd, half, NB);
  cpu_->copy_column_blocks(wide, hd, 2 * hd, kvh, 3, 0, 5, NB);
  gpu_->copy_column_blocks(wided, 0, 2 * hd, kvd, 0, hd, half, NB);
  gpu_->copy_column_blocks(wided, hd, 2 * hd, kvd, 3, 0, 5, NB);
  EXPECT_EQ(std::memcmp(host(wided).raw(), wide.raw(), wide.nbytes()), 0) << "copy_column_blocks";
}

TEST_F(CudaOps, AdamWAndSumSquares) {
  const int64_t n = 100003;
  Tensor p = rand({n}), g = rand({n}), m = rand({n}, 0.1f), v = rand({n}, 0.1f);
  for (int64_t i = 0; i < n; ++i) v.f32()[i] = std::fabs(v.f32()[i]);
  Tensor pd = dev(p), gd = dev(g), md = dev(m), vd = dev(v);
  AdamWHyper h;
  h.lr = 1e-3;
  cpu_->adamw_step(p, g, m, v, h, 0.1, 7);
  gpu_->adamw_step(pd, gd, md, vd, h, 0.1, 7);
  expect_close(pd, p, 1e-6, "adamw param");
  expect_close(vd, v, 1e-6, "adamw v");
  const double a = cpu_->sum_squares(g), b = gpu_->sum_squares(gd);
  EXPECT_NEAR(b, a, 1e-9 * a);
  EXPECT_EQ(b, gpu_->sum_squares(gd)) << "the GPU norm is deterministic";
  // The fused AdamW over segments with different weight decay equals the per-range updates.
  {
    Tensor P = rand({5000}), G = rand({5000}), M = rand({5000}, 0.1f), Vv = rand({5000}, 0.1f);
    for (int64_t i = 0; i < 5000; ++i) Vv.f32()[i] = std::fabs(Vv.f32()[i]);
    Tensor Pd = dev(P), Gd = dev(G), Md = dev(M), Vd = dev(Vv);
    const std::vector<AdamWSegment> segs = {{0, 1200, 0.1}, {1200, 1300, 0.0}, {1300, 5000, 0.1}};
    cpu_->adamw_step_flat(P, G, M, Vv, segs, h, 3);
    gpu_->adamw_step_flat(Pd, Gd, Md, Vd, segs, h, 3);
    expect_close(Pd, P, 1e-6, "fused adamw param");
    expect_close(Md, M, 1e-6, "fused adamw m");
    // Mixed precision: the compute copy written in the same pass is cast()'s rounding of the
    // updated parameters, bit for bit, in bf16 and f16 (the CPU's default path: step, then cast).
    for (DType dt : {DType::BF16, DType::F16}) {
      Tensor P2 = dev(P), M2 = dev(M), V2 = dev(Vv), C2 = poisoned({5000}, dt);
      gpu_->adamw_step_flat(P2, Gd, M2, V2, segs, h, 4, &C2);
      Tensor want({5000}, dt, gpu_->allocator());
      gpu_->cast(want, P2);
      expect_close(C2, host(want), 0, "the compute copy from the AdamW pass");
      Tensor Pc = host(dev(P)), Mc = host(dev(M)), Vc = host(dev(Vv)), Cc({5000}, dt);
      cpu_->adamw_step_flat(Pc, G, Mc, Vc, segs, h, 4, &Cc);
      expect_close(P2, Pc, 1e-6, "adamw param (with the compute copy)");
      expect_close(C2, Cc, dt == DType::BF16 ? 8e-3 : 1e-3, "the compute copy against the CPU's");
    }
  }
  // The 16-byte path and the element path (a view 4 bytes off alignment) of the sum of squares.
  {
    Tensor big = rand({1 << 20});
    Tensor bd = dev(big);
    const Tensor odd = bd.view(1, {(1 << 20) - 3});
    const double want = cpu_->sum_squares(big.view(1, {(1 << 20) - 3}));
    EXPECT_NEAR(gpu_->sum_squares(odd), want, 1e-9 * want) << "misaligned view";
    EXPECT_NEAR(gpu_->sum_squares(bd), cpu_->sum_squares(big), 1e-9 * want) << "aligned";
  }
  const Tensor g2 = rand({777});
  const double both = gpu_->sum_squares_all({gd, dev(g2)});
  EXPECT_NEAR(both, a + cpu_->sum_squares(g2), 1e-9 * both);
  // Result validation's bucket check: sums collected on the device, read once; a restart forgets
  // the earlier ones, a NaN in any bucket shows.
  gpu_->collect_sum_squares(dev(g2), true);
  gpu_->collect_sum_squares(gd, true);
  gpu_->collect_sum_squares(dev(g2), false);
  EXPECT_EQ(gpu_->collected_sum_squares(), both) << "the same partials as sum_squares_all";
  Tensor bad = rand({300});
  bad.f32()[123] = std::numeric_limits<float>::quiet_NaN();
  gpu_->collect_sum_squares(dev(bad), false);
  EXPECT_TRUE(std::isnan(gpu_->collected_sum_squares()));
  gpu_->scale(gd, 0.5f);
  cpu_->scale(g, 0.5f);
  expect_close(gd, g, 0, "scale");
}

TEST_F(CudaOps, KvAttentionMatchesCpu) {
  const int64_t H = 2, hd = 7, Tmax = 20, slots = 3, rows = 9;
  Tensor qkv = rand({rows, 3 * H * hd});
  std::vector<Backend::KvSegment> segs = {{0, 0, 6, 0}, {2, 0, 2, 6}, {1, 0, 1, 8}};
  Tensor kc = Tensor::zeros({slots, H, Tmax, hd}), vc = Tensor::zeros({slots, H, Tmax, hd}),
         out({rows, H * hd});
  cpu_->kv_attention(out, qkv, kc, vc, segs, H);
  Tensor qd = dev(qkv), kcd = dev(Tensor::zeros({slots, H, Tmax, hd})),
         vcd = dev(Tensor::zeros({slots, H, Tmax, hd}));
  Tensor od = poisoned({rows, H * hd});
  gpu_->kv_attention(od, qd, kcd, vcd, segs, H);
  expect_close(od, out, 1e-5, "kv attention");
  expect_close(kcd, kc, 0, "k cache");
}

// Generation in bf16 and f16 at GPT-2 124M's shapes (12 heads of 64, a 1024-token cache): a
// prefill of 200 tokens in slot 0 and of 900 in slot 1 (the tensor-core training kernel), then a
// decode step of one token each (contexts 201 and 901: many splits) beside a 3-token prefill of
// slot 2 (flash-decoding), then a decode row beside a 100-token prefill in one call; and Llama's
// head dim 128 with GQA, with and without ALiBi. Against the CPU's f32 reference over the same
// rounded values.
TEST_F(CudaOps, KvAttentionBf16F16FlashDecodingMatchesCpu) {
  struct Run {
    DType dt;
    int64_t H, G, hd;
    double tol;
    bool alibi;
  };
  for (const Run& r :
       {Run{DType::BF16, 12, 12, 64, 2e-2, false}, Run{DType::F16, 12, 12, 64, 4e-3, false},
        Run{DType::BF16, 8, 2, 128, 2e-2, false}, Run{DType::F16, 8, 2, 128, 4e-3, true}}) {
    const AttentionAlibi alibi{8, 16};
    const AttentionAlibi* al = r.alibi ? &alibi : nullptr;
    const int64_t Tmax = 1024, slots = 3;
    Tensor kc = as(r.dt, Tensor::zeros({slots, r.G, Tmax, r.hd})),
           vc = as(r.dt, Tensor::zeros({slots, r.G, Tmax, r.hd}));
    Tensor kcd = dev(kc), vcd = dev(vc);
    // Step 1: two prefills (the tensor-core kernel); step 2: decode rows and a 3-token prompt (the
    // decode kernels); step 3: a decode row beside a 100-token prefill (one call, both paths).
    const std::vector<std::vector<Backend::KvSegment>> steps = {
        {{0, 0, 200, 0}, {1, 0, 900, 200}},
        {{0, 200, 1, 0}, {1, 900, 1, 1}, {2, 0, 3, 2}},
        {{0, 201, 1, 0}, {2, 0, 100, 1}}};
    for (const auto& segs : steps) {
      int64_t rows = 0;
      for (const auto& g : segs) rows += g.count;
      Tensor qkv = as(r.dt, rand({rows, (r.H + 2 * r.G) * r.hd}));
      Tensor out_t({rows, r.H * r.hd}, r.dt);
      cpu_->kv_attention(out_t, qkv, kc, vc, segs, r.H, r.G, al);
      Tensor qd = dev(qkv), od = poisoned({rows, r.H * r.hd}, r.dt);
      gpu_->kv_attention(od, qd, kcd, vcd, segs, r.H, r.G, al);
      expect_close(od, out_t, r.tol, "flash-decoding");
      expect_close(kcd, kc, 0, "k cache (compute dtype)");
      expect_close(vcd, vc, 0, "v cache (compute dtype)");
    }
  }
}

// A decode step from a row table on the device (what a CUDA graph replays): table entries in
// another order than their slots and their rows, positions 0 to 900, the split plan made for the
// whole 1,024-token cache (most splits of the short rows empty), bf16 at GPT-2's shape and f16 with
// GQA and ALiBi; the caches and outputs against the CPU's kv_attention with one-token segments.
TEST_F(CudaOps, KvDecodeFromADeviceTableMatchesCpu) {
  struct Run {
    DType dt;
    int64_t H, G, hd;
    double tol;
    bool alibi;
  };
  for (const Run& r :
       {Run{DType::BF16, 12, 12, 64, 2e-2, false}, Run{DType::F16, 8, 2, 128, 4e-3, true}}) {
    const AttentionAlibi alibi{0, 8};
    const AttentionAlibi* al = r.alibi ? &alibi : nullptr;
    const int64_t Tmax = 1024, slots = 4;
    Tensor kc = as(r.dt, rand({slots, r.G, Tmax, r.hd})),
           vc = as(r.dt, rand({slots, r.G, Tmax, r.hd}));
    Tensor kcd = dev(kc), vcd = dev(vc);
    // (slot, position) of table entries 0..3; entry i is row 3 - i of qkv and out.
    const std::vector<std::pair<int, int>> rows = {{3, 900}, {0, 0}, {2, 37}, {1, 511}};
    std::vector<Backend::KvSegment> segs;
    std::vector<int32_t> table;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int32_t row = static_cast<int32_t>(rows.size() - 1 - i);
      segs.push_back({rows[i].first, rows[i].second, 1, row});
      for (int32_t v : {rows[i].first, rows[i].second, row}) table.push_back(v);
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    Tensor qkv = as(r.dt, rand({n, (r.H + 2 * r.G) * r.hd}));
    Tensor out_t({n, r.H * r.hd}, r.dt);
    cpu_->kv_attention(out_t, qkv, kc, vc, segs, r.H, r.G, al);
    Tensor td({n, 3}, DType::I32, gpu_->allocator());
    gpu_->copy_from_host(td, table.data());
    Tensor qd = dev(qkv), od = poisoned({n, r.H * r.hd}, r.dt);
    gpu_->kv_decode(od, qd, kcd, vcd, td, Tmax, r.H, r.G, al);
    expect_close(od, out_t, r.tol, "kv_decode");
    expect_close(kcd, kc, 0, "k cache (kv_decode)");
    expect_close(vcd, vc, 0, "v cache (kv_decode)");
  }
}

// Sampling on the device: GPT-2's vocabulary in 2 tensor-parallel pieces with padding (2 x 25,216
// columns for 50,257 tokens), 6 rows of greedy, top-k 1 and 40, top-p 0.9, temperature 0.7 and
// plain rows, 100 draws each: the same ids as the CPU's sample_token on the assembled rows. Logits
// with ties (rounded to 0.25) check the index order of equal logits.
TEST_F(CudaOps, SampleTokensMatchesTheCpu) {
  const int64_t P = 2, S = 6, Vl = 25216, V = 50257;
  for (bool ties : {false, true}) {
    Tensor pieces = rand({P, S, Vl}, 3.f);
    if (ties)
      for (int64_t e = 0; e < pieces.numel(); ++e)
        pieces.f32()[e] = std::round(pieces.f32()[e] * 4) / 4;
    Tensor dp = dev(pieces);
    std::vector<TokenSampling> how(S);
    how[0].temperature = 0;
    how[1].top_k = 1;
    how[2].top_k = 40;
    how[3].top_p = 0.9;
    how[4].temperature = 0.7;
    how[4].top_k = 100;
    how[4].top_p = 0.5;
    std::uniform_real_distribution<double> ud(0, 1);
    for (int draw = 0; draw < 100; ++draw) {
      for (TokenSampling& h : how) h.u = ud(g_);
      const std::vector<int32_t> want = cpu_->sample_tokens(pieces, P, S, V, how);
      const std::vector<int32_t> got = gpu_->sample_tokens(dp, P, S, V, how);
      ASSERT_EQ(got, want) << "draw " << draw << (ties ? " (ties)" : "");
    }
  }
}

// Generation with grouped-query attention: 6 query heads over 2 key/value heads, caches
// (slots, G, Tmax, hd); a second step appends to the first step's caches.
TEST_F(CudaOps, KvAttentionGqaMatchesCpu) {
  const int64_t H = 6, G = 2, hd = 16, Tmax = 40, slots = 3, rows = 11;
  Tensor kc = Tensor::zeros({slots, G, Tmax, hd}), vc = Tensor::zeros({slots, G, Tmax, hd});
  Tensor kcd = dev(kc), vcd = dev(vc);
  const std::vector<std::vector<Backend::KvSegment>> steps = {
      {{0, 0, 7, 0}, {2, 0, 3, 7}, {1, 0, 1, 10}}, {{0, 7, 1, 0}, {2, 3, 5, 1}, {1, 1, 5, 6}}};
  for (const auto& segs : steps) {
    Tensor qkv = rand({rows, (H + 2 * G) * hd}), out({rows, H * hd});
    cpu_->kv_attention(out, qkv, kc, vc, segs, H, G);
    Tensor qd = dev(qkv), od = poisoned({rows, H * hd});
    gpu_->kv_attention(od, qd, kcd, vcd, segs, H, G);
    expect_close(od, out, 1e-5, "kv attention (GQA)");
    expect_close(kcd, kc, 0, "k cache (GQA)");
    expect_close(vcd, vc, 0, "v cache (GQA)");
  }
}

// Generation with ALiBi and grouped-query attention: the bias of cached position j for the query
// at position pos0 + t, on rank 1 of 2 of 12 heads (slopes 2^-7, 2^-8 and the steep 2^-0.5 ..
// 2^-3.5); a second step appends to the first step's caches, so queries sit past position 0.
TEST_F(CudaOps, KvAttentionAlibiMatchesCpu) {
  const int64_t H = 6, G = 2, hd = 16, Tmax = 40, slots = 3, rows = 11;
  const AttentionAlibi alibi{6, 12};
  Tensor kc = Tensor::zeros({slots, G, Tmax, hd}), vc = Tensor::zeros({slots, G, Tmax, hd});
  Tensor kcd = dev(kc), vcd = dev(vc);
  const std::vector<std::vector<Backend::KvSegment>> steps = {
      {{0, 0, 7, 0}, {2, 0, 3, 7}, {1, 0, 1, 10}}, {{0, 7, 1, 0}, {2, 3, 5, 1}, {1, 1, 5, 6}}};
  for (const auto& segs : steps) {
    Tensor qkv = rand({rows, (H + 2 * G) * hd}), out({rows, H * hd});
    cpu_->kv_attention(out, qkv, kc, vc, segs, H, G, &alibi);
    Tensor qd = dev(qkv), od = poisoned({rows, H * hd});
    gpu_->kv_attention(od, qd, kcd, vcd, segs, H, G, &alibi);
    expect_close(od, out, 1e-5, "kv attention (ALiBi)");
    expect_close(kcd, kc, 0, "k cache (ALiBi)");
  }
}

// Backend::gemm (Muon's Newton-Schulz, step/muon.hpp): every transpose combination at a
// rectangular shape in f32 against the CPU's OpenBLAS, and with bf16 inputs (f32 accumulation)
// against the CPU product of the bf16-rounded inputs; beta accumulates.
TEST_F(CudaOps, GemmEveryTransposeF32AndBf16) {
  const int64_t M = 37, N = 53, K = 129;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a = rand(ta ? Shape{K, M} : Shape{M, K}),
                   b = rand(tb ? Shape{N, K} : Shape{K, N});
      Tensor c0 = rand({M, N});
      Tensor want(c0.shape());
      cpu_->cast(want, c0);
      cpu_->gemm(want, a, ta, b, tb, 0.5f, 1.f);
      Tensor got = dev(c0);
      gpu_->gemm(got, dev(a), ta, dev(b), tb, 0.5f, 1.f);
      expect_close(got, want, 1e-5, "gemm f32");
      // bf16 inputs: the reference multiplies the rounded values in f32.
      const Tensor ab = widened(as(DType::BF16, a)), bb = widened(as(DType::BF16, b));
      Tensor want16({M, N});
      cpu_->gemm(want16, ab, ta, bb, tb, 1.f, 0.f);
      Tensor got16 = poisoned({M, N});
      gpu_->gemm(got16, dev(as(DType::BF16, a)), ta, dev(as(DType::BF16, b)), tb, 1.f, 0.f);
      expect_close(got16, want16, 1e-4, "gemm bf16");
    }
}

// Backend::gemm on a batch (3-D: Muon's same-shaped matrices, one strided batched cuBLAS call):
// each matrix of the batch is the CPU's product of that matrix, f32 and bf16 inputs, beta
// accumulating, at a Newton-Schulz shape (the Gram matrix X X^T and B X).
TEST_F(CudaOps, GemmBatchedIsEachMatrix) {
  const int64_t L = 5, r = 48, c = 160;
  const Tensor x = rand({L, r, c});
  Tensor a0 = rand({L, r, r});
  Tensor want(a0.shape());
  cpu_->cast(want, a0);
  for (int64_t i = 0; i < L; ++i) {
    Tensor w = want.view(i * r * r, {r, r});
    cpu_->gemm(w, x.view(i * r * c, {r, c}), false, x.view(i * r * c, {r, c}), true, 1.f, 1.f);
  }
  Tensor got = dev(a0);
  const Tensor xd = dev(x);
  gpu_->gemm(got, xd, false, xd, true, 1.f, 1.f);
  expect_close(got, want, 1e-5, "batched gemm X X^T f32");
  const Tensor xb = widened(as(DType::BF16, x)), bb = widened(as(DType::BF16, rand({L, r, r})));
  Tensor want16({L, r, c});
  for (int64_t i = 0; i < L; ++i) {
    Tensor w = want16.view(i * r * c, {r, c});
    cpu_->gemm(w, bb.view(i * r * r, {r, r}), false, xb.view(i * r * c, {r, c}), false, 1.f, 0.f);
  }
  Tensor got16 = poisoned({L, r, c});
  gpu_->gemm(got16, dev(as(DType::BF16, bb)), false, dev(as(DType::BF16, xb)), false, 1.f, 0.f);
  expect_close(got16, want16, 1e-4, "batched gemm B X bf16");
}
