// bench_rates: Tessera's achieved per-op rates on this machine's backend, written as a rates file
// (configs/rates/*.ini, docs/planning.md "Rates") that the step-time predictor reads through a
// cluster file's `[gpu] rates` key (issue 57; issue 56 runs it on the lent GPU). It times the ops
// the training step runs, through the Backend interface at shapes of its own (not any bench's
// model): GEMMs forward and backward by the weight's smaller side, causal attention forward and
// backward, a memory-bound pass, the MoE experts' grouped GEMMs and the router.
//
// With --link, run under mpirun with 2 ranks: it times MPI all-reduces of 8 KiB and 1 MiB of
// floats between the two ranks and prints the fabric's latency and bandwidth for a cluster file's
// [intra-node] (the ring model's all-reduce of n = 2: bytes / bandwidth + 2 latencies).
//
// Usage: bench_rates [--device cpu|cuda] [--dtype f32|bf16] [--threads N] [--out FILE]
//        bench_rates --link   (under mpirun -np 2)
// Defaults: the CPU backend in f32 (bf16 on cuda), 1 thread, the file on stdout.
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/timer.hpp"
#include "runtime/select.hpp"

using namespace tessera;

namespace {

// The median of `reps` timed calls of `f` after one warm-up (seconds).
double median_seconds(Backend& be, int reps, const std::function<void()>& f) {
  f();
  be.synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    Timer timer;
    f();
    be.synchronize();
    t.push_back(timer.seconds());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Tensor random_tensor(Backend& be, Shape s, DType dtype, std::mt19937& gen) {
  std::normal_distribution<float> nd(0.f, 0.5f);
  Tensor h(s);
  for (int64_t i = 0; i < h.numel(); ++i) h.f32()[i] = nd(gen);
  Tensor f(s, DType::F32, be.allocator()), d(s, dtype, be.allocator());
  be.copy_from_host(f, h.raw());
  if (dtype == DType::F32) return f;
  be.cast(d, f);
  return d;
}

int link_mode() {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "bench_rates --link: run it with mpirun -np 2\n");
    return 2;
  }
  auto time_allreduce = [](int64_t n) {
    std::vector<float> buf(static_cast<size_t>(n), 1.f);
    std::vector<double> t;
    for (int i = 0; i < 21; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
      t.push_back(MPI_Wtime() - t0);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const int64_t small = 2048, large = int64_t(1) << 18;  // 8 KiB, 1 MiB of floats
  const double ts = time_allreduce(small), tl = time_allreduce(large);
  // all_reduce(n = 2) = bytes / bw + 2 lat (plan/predict.cpp's ring model).
  const double lat = ts / 2;
  const double bw = 4.0 * large / std::max(1e-9, tl - 2 * lat);
  if (rank == 0)
    std::printf(
        "# bench_rates --link: MPI all-reduce between 2 ranks, 8 KiB in %.1f us, 1 MiB in %.2f "
        "ms\n[intra-node]\nbandwidth-gbs = %.2f\nlatency-us = %.1f\n",
        ts * 1e6, tl * 1e3, bw / 1e9, lat * 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::string device = "cpu", dtype_arg, out_path;
  int threads = 1;
  bool link = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_rates: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--device")
      device = value();
    else if (a == "--dtype")
      dtype_arg = value();
    else if (a == "--threads")
      threads = std::atoi(value().c_str());
    else if (a == "--out")
      out_path = value();
    else if (a == "--link")
      link = true;
    else {
      std::fprintf(stderr,
                   "bench_rates: unknown argument '%s' (usage: bench_rates [--device cpu|cuda] "
                   "[--dtype f32|bf16] [--threads N] [--out FILE] | --link)\n",
                   a.c_str());
      return 2;
    }
  }
  if (link) {
    const int rc = link_mode();
    MPI_Finalize();
    return rc;
  }
  if (threads < 1) {
    std::fprintf(stderr, "bench_rates: --threads %d is out of range (>= 1)\n", threads);
    return 2;
  }
  omp_set_num_threads(threads);
  std::unique_ptr<Backend> be;
  DType dtype = DType::F32;
  try {
    be = make_backend(device, 0, 1, "");
    dtype = dtype_from_name(dtype_arg.empty() ? (device == "cpu" ? "f32" : "bf16") : dtype_arg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_rates: %s\n", e.what());
    return 2;
  }
  const bool gpu = device != "cpu";
  std::mt19937 gen(57);
  const int reps = gpu ? 20 : 5;
  std::string text;
  char line[512];
  auto emit = [&](const char* fmt, auto... v) {
    std::snprintf(line, sizeof line, fmt, v...);
    text += line;
  };
  // GEMMs: rows N of width w against a (4w, w) weight (the MLP's shape), forward and backward;
  // the rate of the three GEMMs together, 6 N w 4w FLOPs.
  const int64_t N = gpu ? 8192 : 1024;
  const std::vector<int64_t> widths = gpu ? std::vector<int64_t>{512, 1024, 2048, 4096, 8192}
                                          : std::vector<int64_t>{32, 64, 128, 256};
  std::string gemm;
  double best = 0;
  for (int64_t w : widths) {
    Tensor x = random_tensor(*be, {N, w}, dtype, gen),
           wt = random_tensor(*be, {4 * w, w}, dtype, gen);
    Tensor y = random_tensor(*be, {N, 4 * w}, dtype, gen), dx({N, w}, dtype, be->allocator());
    Tensor dw({4 * w, w}, DType::F32, be->allocator());
    be->zero(dw);
    const double f = median_seconds(*be, reps, [&] { be->matmul_forward(y, x, wt, nullptr); });
    const double b =
        median_seconds(*be, reps, [&] { be->matmul_backward(&dx, dw, nullptr, y, x, wt); });
    const double tflops = 6.0 * N * w * 4 * w / (f + b) / 1e12;
    best = std::max(best, tflops);
    gemm += (gemm.empty() ? "" : " ") + std::to_string(w) + ":" + std::to_string(tflops);
  }
  // Causal attention: forward 4 B H T^2 D / 2 FLOPs, backward 2.5 times that.
  const int64_t B = gpu ? 8 : 1, H = gpu ? 16 : 4, T = gpu ? 2048 : 256, D = gpu ? 128 : 16;
  Tensor qkv = random_tensor(*be, {B, T, 3 * H * D}, dtype, gen);
  Tensor att({B, T, H * D}, dtype, be->allocator()), lse({B, H, T}, DType::F32, be->allocator());
  Tensor datt = random_tensor(*be, {B, T, H * D}, dtype, gen),
         dqkv({B, T, 3 * H * D}, dtype, be->allocator());
  const double af = median_seconds(*be, reps, [&] { be->attention_forward(att, lse, qkv, H); });
  const double ab =
      median_seconds(*be, reps, [&] { be->attention_backward(dqkv, datt, qkv, att, lse, H); });
  const double attn = 4.0 * B * H * T * T * D / 2;
  // The element-wise passes of a layer and the head, together: the bytes the predictor counts for
  // them (the fewest each kernel moves: LayerNorm forward 2 x the elements, the residual add 3,
  // GELU forward 2 and backward 3, LayerNorm backward 3; cross-entropy 3 x the logits) over the
  // time they take. On a GPU they run at memory speed; on the CPU their arithmetic (tanh, exp,
  // the statistics) sets the rate, and this measures it.
  const int64_t R = gpu ? 16384 : 2048, C = gpu ? 4096 : 256, V = gpu ? 32768 : 2048;
  const double wb = double(dtype_size(dtype));
  Tensor h = random_tensor(*be, {R, C}, dtype, gen), h2 = random_tensor(*be, {R, C}, dtype, gen);
  Tensor o({R, C}, dtype, be->allocator()), dh({R, C}, dtype, be->allocator());
  Tensor mean({R}, DType::F32, be->allocator()), rstd({R}, DType::F32, be->allocator());
  Tensor lw = random_tensor(*be, {C}, dtype, gen), lb = random_tensor(*be, {C}, dtype, gen);
  Tensor dlw({C}, DType::F32, be->allocator()), dlb({C}, DType::F32, be->allocator());
  be->zero(dlw);
  be->zero(dlb);
  const double elementwise = median_seconds(*be, reps, [&] {
    be->layernorm_forward(o, mean, rstd, h, lw, lb, 1e-5);
    be->add(o, h, h2);
    be->gelu_forward(o, h);
    be->gelu_backward(dh, h, h2);
    be->layernorm_backward(dh, dlw, dlb, h2, h, lw, mean, rstd);
  });
  const int64_t xrows = gpu ? 8192 : 512;
  Tensor logits = random_tensor(*be, {xrows, V}, dtype, gen);
  Tensor rowmax({xrows}, DType::F32, be->allocator()), sumexp({xrows}, DType::F32, be->allocator());
  Tensor target_logit({xrows}, DType::F32, be->allocator()),
      losses({xrows}, DType::F32, be->allocator());
  std::vector<int32_t> host_targets(static_cast<size_t>(xrows));
  for (int64_t i = 0; i < xrows; ++i)
    host_targets[size_t(i)] = static_cast<int32_t>((i * 7919) % V);
  Tensor targets({xrows}, DType::I32, be->allocator());
  be->copy_from_host(targets, host_targets.data());
  Tensor fresh = random_tensor(*be, {xrows, V}, dtype, gen);
  const double xent = median_seconds(*be, reps, [&] {
    be->cast(logits, fresh);  // the pass overwrites the logits with their gradient
    be->xent_row_max(rowmax, logits, V);
    be->xent_row_sums(sumexp, target_logit, logits, rowmax, targets, V, 0);
    be->xent_loss_and_grad(losses, logits, rowmax, sumexp, target_logit, targets, V, 0, 1.f);
  });
  const double copy = median_seconds(*be, reps, [&] { be->cast(logits, fresh); });
  const double bytes = 13.0 * R * C * wb + 3.0 * xrows * V * wb;
  const double elementwise_tbs = bytes / (elementwise + std::max(0.0, xent - copy)) / 1e12;
  // A streaming pass (the optimizer's kind): out = a + b, 3 x the bytes of an element.
  const int64_t M = gpu ? (int64_t(64) << 20) : (int64_t(8) << 20);
  Tensor a = random_tensor(*be, {M}, dtype, gen), c = random_tensor(*be, {M}, dtype, gen);
  Tensor sum({M}, dtype, be->allocator());
  const double add = median_seconds(*be, reps, [&] { be->add(sum, a, c); });
  const double tbs = 3.0 * M * wb / add / 1e12;
  // MoE: 8 experts' grouped GEMMs (N / 8 rows each, width w, the MLP's 4w), and the router's
  // top-2 of 8 over N tokens.
  const int64_t E = 8, w = widths[widths.size() / 2], rows = N / E;
  std::vector<Tensor> gx, gw, gy;
  for (int e = 0; e < E; ++e) {
    gx.push_back(random_tensor(*be, {rows, w}, dtype, gen));
    gw.push_back(random_tensor(*be, {4 * w, w}, dtype, gen));
    gy.push_back(Tensor({rows, 4 * w}, dtype, be->allocator()));
  }
  std::vector<Backend::GroupedGemm> groups;
  for (int e = 0; e < E; ++e)
    groups.push_back({&gy[size_t(e)], nullptr, &gx[size_t(e)], nullptr, &gw[size_t(e)]});
  const double gg = median_seconds(*be, reps, [&] { be->grouped_matmul_forward(groups); });
  const double grouped = 2.0 * N * w * 4 * w / gg / 1e12;
  Tensor router_logits = random_tensor(*be, {N, E}, DType::F32, gen);
  Tensor expert({N, 2}, DType::I32, be->allocator()), weight({N, 2}, DType::F32, be->allocator());
  Tensor row({N, 2}, DType::I32, be->allocator());
  MoERouting routing;
  routing.experts = int(E);
  routing.topk = 2;
  std::vector<int64_t> routed, kept;
  const double route = median_seconds(*be, reps, [&] {
    be->moe_route(expert, weight, row, router_logits, routing, N, routed, kept);
  });
  const std::string what = backend_description(*be);
  emit("# %s: Tessera's achieved rates measured by bench_rates (--device %s, %s, %d thread%s);\n",
       what.c_str(), device.c_str(), dtype_name(dtype), threads, threads == 1 ? "" : "s");
  emit("# a rates file for a cluster file's [gpu] rates key (docs/planning.md, \"Rates\").\n");
  emit("# The peak below is the best GEMM rate measured (this machine's own, for MFU).\n");
  emit("gpu = %s\nbf16-tflops = %.6g\nhbm-tbs = %.6g\n", what.c_str(), best, tbs);
  emit("[gemm]\n# achieved TFLOP/s by the weight's smaller side (%lld rows; f32 on the CPU)\n",
       (long long)N);
  emit("bf16 = %s\n", gemm.c_str());
  emit("[attention]\n# causal, B%lld H%lld T%lld D%lld\n", (long long)B, (long long)H, (long long)T,
       (long long)D);
  emit("forward-tflops = %.6g\nbackward-tflops = %.6g\n", attn / af / 1e12, 2.5 * attn / ab / 1e12);
  emit("[memory]\n# streaming: out = a + b over %lld elements\ntbs = %.6g\n", (long long)M, tbs);
  emit(
      "# element-wise: LayerNorm, residual add, GELU forward and backward over %lld x %lld; "
      "cross-entropy over %lld x %lld\nelementwise-tbs = %.6g\n",
      (long long)R, (long long)C, (long long)xrows, (long long)V, elementwise_tbs);
  emit("[moe]\n# 8 experts' forward GEMMs of width %lld; top-2 of 8 routing of %lld tokens\n",
       (long long)w, (long long)N);
  emit("grouped-gemm-tflops = %.6g\nrouting-ns-per-token = %.6g\n", grouped, route / N * 1e9);
  if (out_path.empty()) {
    std::fputs(text.c_str(), stdout);
  } else {
    std::ofstream f(out_path);
    f << text;
    if (!f) {
      std::fprintf(stderr, "bench_rates: cannot write %s\n", out_path.c_str());
      return 2;
    }
    std::printf("bench_rates: wrote %s\n", out_path.c_str());
  }
  MPI_Finalize();
  return 0;
}
