// bench_attention: causal attention forward and backward on one GPU through the CUDA backend (the
// kernels training uses), at the two anchor shapes, printing ms and TFLOP/s next to the
// figures PyTorch's scaled_dot_product_attention reached on an H100 (bench/attention_peer.py
// measures those in the same run where PyTorch is installed).
//
// FLOPs (FlashAttention's convention for causal attention): forward 4*B*H*T^2*D / 2, backward
// 2.5 times the forward.
//
// Each shape runs under --attention-backend flash (Tessera's tensor-core kernels) and fused
// (cuDNN's fused attention, backend/cuda/cudnn_attention.*), each line followed by which kernels
// ran and why; `--attention-backend X` times only X.
//
// Usage: bench_attention [--attention-backend X] [--dropout P] [--kv-heads G] [--packed L]
// [reps=20]
//                        [dtype=bf16|fp16]
//                        [B H T D ...: more shapes]
// With --dropout, each shape is timed again with attention dropout P (the mask drawn in the
// kernels), and the cost printed against the run without. With --kv-heads, grouped-query attention
// with G key/value heads (G divides H; the FLOPs are those of H heads, K and V read in place); the
// peer figures stay those of multi-head attention at the same shape. With --packed L, each shape is
// also a packed batch of documents (lengths drawn uniformly from 1 to 2L - 1, seeded; each row
// attends only to its own document, as --sft and --reset-attention-mask give): the FLOPs the
// tensor-core kernels skip (counted tile by tile as their schedule skips them: the forward's
// 16-row warps against 64-key tiles, the same rule as the dQ kernel's) are printed for every shape
// without a GPU, and on one the packed batch is timed under the flash kernels against the causal
// run.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/documents.hpp"
#include "core/timer.hpp"

#ifdef TESSERA_HAVE_CUDA
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"
#endif

using namespace tessera;

namespace {

struct Case {
  int64_t B, H, T, D;
  double fa2_fwd, fa2_bwd, cudnn_fwd, cudnn_bwd;  // TFLOP/s on an H100 (issue 12); 0 = none
};

// A packed batch's first visible key per row (B*T): documents of 1 to 2L - 1 tokens.
std::vector<int32_t> packed_key_begin(int64_t B, int64_t T, int64_t L) {
  std::mt19937 g(40);
  std::uniform_int_distribution<int64_t> len(1, 2 * L - 1);
  std::vector<int32_t> kb(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0, start = 0, n = len(g); t < T; ++t) {
      if (t - start == n) start = t, n = len(g);
      kb[static_cast<size_t>(b * T + t)] = static_cast<int32_t>(start);
    }
  return kb;
}

// Tiles of 16 query rows x 64 keys the forward kernel computes (flash_attention_tc.cuh: blocks of
// 128 rows start at the tile of their smallest first key; a warp skips tiles after its last row
// and before its smallest first key), with the documents (kb) and without (causal alone).
struct TileCount {
  double docs = 0, causal = 0, useful = 0;  // useful: the documents' own causal scores
};
TileCount count_tiles(const std::vector<int32_t>& kb, int64_t B, int64_t T) {
  constexpr int64_t Br = 128, Bc = 64, Wr = 16;
  TileCount c;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* k = kb.data() + b * T;
    for (int64_t t = 0; t < T; ++t) c.useful += double(t - k[t] + 1);
    for (int64_t q0 = 0; q0 < T; q0 += Br) {
      const int64_t rows = std::min(Br, T - q0), kend = std::min(T, q0 + Br);
      const int64_t bmin = *std::min_element(k + q0, k + q0 + rows);
      for (int64_t r0 = q0; r0 < q0 + rows; r0 += Wr) {
        const int64_t wmin = *std::min_element(k + r0, k + std::min(r0 + Wr, T));
        for (int64_t k0 = 0; k0 < kend; k0 += Bc) {
          if (k0 > r0 + Wr - 1) continue;
          c.causal += 1;
          if (k0 >= (bmin / Bc) * Bc && k0 + Bc - 1 >= wmin) c.docs += 1;
        }
      }
    }
  }
  c.useful /= double(Wr * Bc);  // in tiles' worth of scores
  return c;
}

}  // namespace

int main(int argc0, char** argv0) {
  double dropout = 0;
  int64_t kv_heads = 0;  // 0: H (multi-head)
  int64_t packed = 0;    // --packed L: documents of mean length L
  bool packed_given = false;
  // Each case under Tessera's flash kernels and cuDNN's fused attention (--attention-backend X:
  // only X); the dropout lines are the flash kernels' (cuDNN's dropout is not Tessera's).
  std::vector<std::string> backends = {"flash", "fused"};
  std::vector<char*> args{argv0[0]};
  for (int i = 1; i < argc0; ++i) {
    if (std::string(argv0[i]) == "--dropout" && i + 1 < argc0)
      dropout = std::atof(argv0[++i]);
    else if (std::string(argv0[i]) == "--attention-backend" && i + 1 < argc0)
      backends = {argv0[++i]};
    else if (std::string(argv0[i]) == "--kv-heads" && i + 1 < argc0)
      kv_heads = std::atoll(argv0[++i]);
    else if (std::string(argv0[i]) == "--packed" && i + 1 < argc0)
      packed = std::atoll(argv0[++i]), packed_given = true;
    else
      args.push_back(argv0[i]);
  }
  const int argc = static_cast<int>(args.size());
  char** argv = args.data();
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const std::string dtype_arg = argc > 2 ? argv[2] : "bf16";
  std::vector<Case> cases = {{16, 12, 1024, 64, 159, 112, 225, 147},
                             {8, 16, 2048, 128, 260, 184, 450, 352}};
  if (argc > 3) {
    cases.clear();
    for (int i = 3; i + 3 < argc; i += 4)
      cases.push_back({std::atoll(argv[i]), std::atoll(argv[i + 1]), std::atoll(argv[i + 2]),
                       std::atoll(argv[i + 3]), 0, 0, 0, 0});
  }
  if (packed_given && packed < 1) {
    std::fprintf(stderr, "bench_attention: --packed takes a mean document length >= 1\n");
    return 2;
  }
  for (const Case& c : cases)
    if (packed > 0) {
      const TileCount n = count_tiles(packed_key_begin(c.B, c.T, packed), c.B, c.T);
      std::printf(
          "B%lld H%lld T%lld D%lld packed (documents of mean length %lld): the flash kernels "
          "compute %.1f%% of the causal run's score tiles (%.1f%% of the FLOPs saved; the "
          "documents' own scores are %.1f%% of the causal run's)\n",
          (long long)c.B, (long long)c.H, (long long)c.T, (long long)c.D, (long long)packed,
          100.0 * n.docs / n.causal, 100.0 * (1 - n.docs / n.causal), 100.0 * n.useful / n.causal);
    }
#ifndef TESSERA_HAVE_CUDA
  (void)reps;
  std::fprintf(stderr, "bench_attention: this build has no CUDA backend\n");
  return 2;
#else
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_attention: no CUDA device is visible; run it on the GPU machine\n");
    return 2;
  }
  DType dtype;
  try {
    dtype = dtype_from_name(dtype_arg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 2;
  }
  cuda::set_device(0);
  std::printf("bench_attention: %s, %s, causal, %d repetitions%s\n",
              cuda::device_description(0).c_str(), dtype_name(dtype), reps,
              std::getenv("TESSERA_ATTENTION") ? " (TESSERA_ATTENTION set)" : "");
  auto be = make_cuda_backend();
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const Case& c : cases) {
    const int64_t C = c.H * c.D, G = kv_heads > 0 ? kv_heads : c.H;
    if (c.H % G != 0) {
      std::fprintf(stderr, "bench_attention: --kv-heads %lld does not divide H %lld\n",
                   (long long)G, (long long)c.H);
      return 2;
    }
    const int64_t C3 = (c.H + 2 * G) * c.D;
    auto device_random = [&](Shape s) {
      Tensor h(s);
      for (int64_t i = 0; i < h.numel(); ++i) h.f32()[i] = nd(gen);
      Tensor f(s, DType::F32, be->allocator()), d(s, dtype, be->allocator());
      be->copy_from_host(f, h.raw());
      be->cast(d, f);
      return d;
    };
    Tensor qkv = device_random({c.B, c.T, C3});
    Tensor dout = device_random({c.B, c.T, C});
    Tensor out({c.B, c.T, C}, dtype, be->allocator());
    Tensor lse({c.B, c.H, c.T}, DType::F32, be->allocator());
    Tensor dqkv({c.B, c.T, C3}, dtype, be->allocator());
    // warm-up (and shared-memory attributes)
    double fwd = 0, bwd = 0;
    for (const std::string& name : backends) {
      const AttentionBackend ab = parse_attention_backend(name);
      be->set_attention_backend(ab, false);
      AttentionCall call;
      call.dtype = dtype;
      call.batch = c.B;
      call.seq = c.T;
      call.heads = c.H;
      call.kv_heads = G;
      call.head_dim = c.D;
      std::string plan;
      try {
        plan = be->attention_plan(call);
      } catch (const std::exception& e) {
        std::printf("B%lld H%lld G%lld T%lld D%lld %s: %s\n", (long long)c.B, (long long)c.H,
                    (long long)G, (long long)c.T, (long long)c.D, name.c_str(), e.what());
        continue;
      }
      be->attention_forward(out, lse, qkv, c.H, nullptr, G);
      be->attention_backward(dqkv, dout, qkv, out, lse, c.H, nullptr, G);
      be->synchronize();
      Timer tf;
      for (int i = 0; i < reps; ++i) be->attention_forward(out, lse, qkv, c.H, nullptr, G);
      be->synchronize();
      fwd = tf.seconds() / reps;
      Timer tb;
      for (int i = 0; i < reps; ++i)
        be->attention_backward(dqkv, dout, qkv, out, lse, c.H, nullptr, G);
      be->synchronize();
      bwd = tb.seconds() / reps;
      const double flops = 4.0 * c.B * c.H * double(c.T) * c.T * c.D / 2;
      std::printf(
          "B%lld H%lld G%lld T%lld D%lld %-5s: forward %.3f ms %.1f TFLOP/s | backward %.3f ms "
          "%.1f TFLOP/s",
          (long long)c.B, (long long)c.H, (long long)G, (long long)c.T, (long long)c.D,
          name.c_str(), fwd * 1e3, flops / fwd / 1e12, bwd * 1e3, 2.5 * flops / bwd / 1e12);
      if (c.fa2_fwd > 0)
        std::printf(" | H100 PyTorch SDPA flash %.0f / %.0f, cuDNN %.0f / %.0f TFLOP/s%s",
                    c.fa2_fwd, c.fa2_bwd, c.cudnn_fwd, c.cudnn_bwd, G < c.H ? " (multi-head)" : "");
      std::printf("\n  (%s)\n", plan.c_str());
    }
    be->set_attention_backend(AttentionBackend::Flash, false);
    if (packed > 0) {  // the packed batch under the flash kernels, against the causal run
      const std::vector<int32_t> kb = packed_key_begin(c.B, c.T, packed);
      Tensor kb_dev({c.B * c.T}, DType::I32, be->allocator());
      be->copy_from_host(kb_dev, kb.data());
      AttentionDocuments docs;
      docs.key_begin = &kb_dev;
      auto time = [&](const AttentionDocuments* d, double& f, double& bw) {
        be->attention_forward(out, lse, qkv, c.H, nullptr, G, nullptr, d);
        be->attention_backward(dqkv, dout, qkv, out, lse, c.H, nullptr, G, nullptr, d);
        be->synchronize();
        Timer tf;
        for (int i = 0; i < reps; ++i)
          be->attention_forward(out, lse, qkv, c.H, nullptr, G, nullptr, d);
        be->synchronize();
        f = tf.seconds() / reps;
        Timer tb;
        for (int i = 0; i < reps; ++i)
          be->attention_backward(dqkv, dout, qkv, out, lse, c.H, nullptr, G, nullptr, d);
        be->synchronize();
        bw = tb.seconds() / reps;
      };
      double cf = 0, cb = 0, pf = 0, pb = 0;
      time(nullptr, cf, cb);
      time(&docs, pf, pb);
      std::printf(
          "  packed (documents of mean length %lld), flash: forward %.3f ms (causal %.3f, "
          "%+.0f%%) | backward %.3f ms (causal %.3f, %+.0f%%)\n",
          (long long)packed, pf * 1e3, cf * 1e3, 100.0 * (pf / cf - 1), pb * 1e3, cb * 1e3,
          100.0 * (pb / cb - 1));
    }
    if (dropout > 0 && fwd > 0 && bwd > 0) {
      AttentionDropout drop;
      drop.spec = make_dropout_spec(dropout, 1234, 1, 0, DropoutKind::Attention, 0);
      drop.heads_total = c.H;
      be->attention_forward(out, lse, qkv, c.H, &drop, G);
      be->synchronize();
      Timer df;
      for (int i = 0; i < reps; ++i) be->attention_forward(out, lse, qkv, c.H, &drop, G);
      be->synchronize();
      const double dfwd = df.seconds() / reps;
      Timer db;
      for (int i = 0; i < reps; ++i)
        be->attention_backward(dqkv, dout, qkv, out, lse, c.H, &drop, G);
      be->synchronize();
      const double dbwd = db.seconds() / reps;
      std::printf("  with dropout %.2f: forward %.3f ms (%+.0f%%) | backward %.3f ms (%+.0f%%)\n",
                  dropout, dfwd * 1e3, 100.0 * (dfwd / fwd - 1), dbwd * 1e3,
                  100.0 * (dbwd / bwd - 1));
    }
  }
  return 0;
#endif
}
