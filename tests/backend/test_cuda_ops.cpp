// test_cuda_ops.cpp: every CUDA op against the CPU reference on random inputs with odd sizes
// (tolerance per op, fp32); outputs are poisoned with NaN before the call and must be fully
// written. Each test skips itself where no CUDA device is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "backend/backend.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"

using namespace tessera;

namespace {

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
    cuda::set_device(0);
    cpu_ = make_cpu_backend();
    gpu_ = make_cuda_backend();
  }
  Tensor rand(Shape s, float scale = 1.f) {
    Tensor t(std::move(s));
    std::normal_distribution<float> d(0.f, scale);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(g_);
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
  Tensor poisoned(Shape s) {  // all bits set: NaN in f32
    Tensor d(std::move(s), DType::F32, cuda::device_allocator());
    Tensor h(d.shape());
    std::memset(h.raw(), 0xff, h.nbytes());
    gpu_->copy_from_host(d, h.raw());
    return d;
  }
  Tensor host(const Tensor& d) {
    Tensor h(d.shape(), d.dtype());
    gpu_->copy_to_host(h.raw(), d);
    return h;
  }
  // |gpu - cpu| <= tol * max|cpu| for every element, cpu not all zero, gpu fully written.
  void expect_close(const Tensor& gpu_dev, const Tensor& cpu, double tol, const char* what) {
    const Tensor gpu = host(gpu_dev);
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

}  // namespace

TEST_F(CudaOps, MatmulForwardBackward) {
  const int64_t N = 37, IC = 29, OC = 51;
  Tensor x = rand({N, IC}), w = rand({OC, IC}), b = rand({OC}), dy = rand({N, OC});
  Tensor y({N, OC});
  cpu_->matmul_forward(y, x, w, &b);
  Tensor yd = poisoned({N, OC}), xd = dev(x), wd = dev(w), bd = dev(b);
  gpu_->matmul_forward(yd, xd, wd, &bd);
  expect_close(yd, y, 1e-5, "matmul out");
  Tensor dx({N, IC}), dw = Tensor::zeros({OC, IC}), db = Tensor::zeros({OC});
  cpu_->matmul_backward(&dx, dw, &db, dy, x, w);
  Tensor dxd = poisoned({N, IC}), dwd = dev(Tensor::zeros({OC, IC})),
         dbd = dev(Tensor::zeros({OC}));
  Tensor dyd = dev(dy);
  gpu_->matmul_backward(&dxd, dwd, &dbd, dyd, xd, wd);
  expect_close(dxd, dx, 1e-5, "dinp");
  expect_close(dwd, dw, 1e-5, "dweight");
  expect_close(dbd, db, 1e-5, "dbias");
}

TEST_F(CudaOps, LayerNormGeluAdd) {
  const int64_t N = 23, C = 77;
  Tensor x = rand({N, C}), w = rand({C}), b = rand({C}), dy = rand({N, C});
  Tensor y({N, C}), m({N}), r({N});
  cpu_->layernorm_forward(y, m, r, x, w, b, 1e-5);
  Tensor yd = poisoned({N, C}), md = poisoned({N}), rd = poisoned({N}), xd = dev(x), wd = dev(w),
         bd = dev(b);
  gpu_->layernorm_forward(yd, md, rd, xd, wd, bd, 1e-5);
  expect_close(yd, y, 1e-5, "layernorm out");
  expect_close(rd, r, 1e-5, "rstd");
  Tensor base = rand({N, C});
  Tensor dx = Tensor::zeros({N, C});
  dx.copy_from(base);
  Tensor dw = Tensor::zeros({C}), db = Tensor::zeros({C});
  cpu_->layernorm_backward(dx, dw, db, dy, x, w, m, r);
  Tensor dxd = dev(base), dwd = dev(Tensor::zeros({C})), dbd = dev(Tensor::zeros({C})),
         dyd = dev(dy);
  gpu_->layernorm_backward(dxd, dwd, dbd, dyd, xd, wd, md, rd);
  expect_close(dxd, dx, 1e-5, "layernorm dinp (accumulated)");
  expect_close(dwd, dw, 1e-5, "layernorm dweight");
  expect_close(dbd, db, 1e-5, "layernorm dbias");
  Tensor g({N, C}), gd = poisoned({N, C});
  cpu_->gelu_forward(g, x);
  gpu_->gelu_forward(gd, xd);
  expect_close(gd, g, 1e-6, "gelu");
  cpu_->gelu_backward(g, x, dy);
  gpu_->gelu_backward(gd, xd, dyd);
  expect_close(gd, g, 1e-6, "gelu backward");
  Tensor s({N, C}), sd = poisoned({N, C});
  cpu_->add(s, x, dy);
  gpu_->add(sd, xd, dyd);
  expect_close(sd, s, 1e-7, "add");
}

TEST_F(CudaOps, AttentionForwardBackward) {
  const int64_t B = 2, T = 67, H = 3, hd = 5;
  Tensor qkv = rand({B, T, 3 * H * hd}), dout = rand({B, T, H * hd});
  Tensor out({B, T, H * hd}), lse({B, H, T}), dqkv({B, T, 3 * H * hd});
  cpu_->attention_forward(out, lse, qkv, H);
  cpu_->attention_backward(dqkv, dout, qkv, out, lse, H);
  Tensor qd = dev(qkv), od = poisoned({B, T, H * hd}), ld = poisoned({B, H, T}), dd = dev(dout);
  gpu_->attention_forward(od, ld, qd, H);
  expect_close(od, out, 1e-5, "attention out");
  expect_close(ld, lse, 1e-5, "attention lse");
  Tensor dqd = poisoned({B, T, 3 * H * hd});
  gpu_->attention_backward(dqd, dd, qd, od, ld, H);
  expect_close(dqd, dqkv, 1e-4, "attention dqkv");
}

TEST_F(CudaOps, EmbeddingsAndCrossEntropy) {
  const int64_t N = 19, C = 33, V = 41, begin = 10;
  Tensor table = rand({V, C}), id = ids({N}, 60), dy = rand({N, C});
  Tensor y({N, C}), yd = poisoned({N, C}), td = dev(table), idd = dev(id);
  cpu_->embedding_forward(y, id, table, begin);
  gpu_->embedding_forward(yd, idd, td, begin);
  expect_close(yd, y, 0, "embedding");
  Tensor dt = Tensor::zeros({V, C}), dtd = dev(Tensor::zeros({V, C})), dyd = dev(dy);
  cpu_->embedding_backward(dt, dy, id, begin);
  gpu_->embedding_backward(dtd, dyd, idd, begin);
  expect_close(dtd, dt, 1e-6, "embedding backward");
  // Cross-entropy over a shard with padding columns and an ignored row.
  Tensor logits = rand({N, V}, 3.f), targets = ids({N}, 50);
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
  expect_close(lossd, loss, 1e-5, "losses");
  expect_close(lgd, logits, 1e-5, "dlogits");
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
