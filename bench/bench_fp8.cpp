// bench_fp8: where an FP8 linear layer's time goes on the GPU, pass by pass, at the 1.3B config's
// four GEMM shapes (micro-batch 8 x seq 2048 = 16,384 tokens; hidden 2048): the bf16 GEMM, the
// amax of the input, the FP8 forward (quantizations + cuBLASLt's FP8 GEMM) and the backwards of
// both, each the mean of `reps` runs after a warm-up, with the bytes or FLOPs they move and the
// rate that gives. bench_gpu_train's --breakdown shows the same phases inside a training step;
// this separates them (issue 37: FP8 1.3B at 0.97x bf16 on the H200, 2026-11-28, where 1.34x was
// predicted). Usage: bench_fp8 [reps=20] [tokens=16384]
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

#include "backend/backend.hpp"
#include "core/timer.hpp"
#ifdef TESSERA_HAVE_CUDA
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"
#endif

using namespace tessera;

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const int64_t N = argc > 2 ? std::atoll(argv[2]) : 16384;
  if (reps < 1 || N < 16 || N % 16 != 0) {
    std::fprintf(stderr,
                 "bench_fp8: reps must be >= 1 and tokens a multiple of 16 (got %d, %lld)\n", reps,
                 (long long)N);
    return 2;
  }
#ifndef TESSERA_HAVE_CUDA
  std::fprintf(stderr, "bench_fp8: this build has no CUDA backend\n");
  return 2;
#else
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_fp8: no CUDA device is visible; run it on the GPU machine\n");
    return 2;
  }
  cuda::set_device(0);
  auto be = make_cuda_backend();
  std::printf("bench_fp8: %s, %lld tokens, %d repetitions, bf16 activations and weights\n",
              cuda::device_description(0).c_str(), (long long)N, reps);
  std::mt19937 gen(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto device_random = [&](Shape s, float sd, DType dt) {
    Tensor h(s);
    for (int64_t i = 0; i < h.numel(); ++i) h.f32()[i] = sd * nd(gen);
    Tensor f(s, DType::F32, be->allocator()), d(s, dt, be->allocator());
    be->copy_from_host(f, h.raw());
    be->cast(d, f);
    return d;
  };
  // Mean seconds of fn over reps runs, after one warm-up run.
  auto time_it = [&](const std::function<void()>& fn) {
    fn();
    be->synchronize();
    Timer t;
    for (int i = 0; i < reps; ++i) fn();
    be->synchronize();
    return t.seconds() / reps;
  };
  struct Shape3 {
    const char* name;
    int64_t IC, OC;
  };
  const Shape3 shapes[] = {
      {"qkv", 2048, 6144}, {"proj", 2048, 2048}, {"fc1", 2048, 8192}, {"fc2", 8192, 2048}};
  std::printf("%-5s %-34s %10s %12s\n", "gemm", "pass", "ms", "rate");
  for (const Shape3& sh : shapes) {
    const int64_t IC = sh.IC, OC = sh.OC;
    const double flops = 2.0 * N * IC * OC;
    Tensor x = device_random({N, IC}, 1.f, DType::BF16);
    Tensor w = device_random({OC, IC}, 0.02f, DType::BF16);
    Tensor dy = device_random({N, OC}, 1e-3f, DType::BF16);
    Tensor y({N, OC}, DType::BF16, be->allocator()), dx({N, IC}, DType::BF16, be->allocator());
    Tensor dw({OC, IC}, DType::F32, be->allocator()), amax({1}, DType::F32, be->allocator());
    be->zero(dw);
    be->zero(amax);
    Tensor sx({1}, DType::F32, be->allocator()), sw({1}, DType::F32, be->allocator()),
        sg({1}, DType::F32, be->allocator());
    // Current scales from the tensors' amaxes (what the tensorwise recipe computes each step).
    be->fp8_amax(amax, x, false);
    be->fp8_current_scale(sx, amax, Fp8Format::E4M3);
    be->fp8_amax(amax, w, false);
    be->fp8_current_scale(sw, amax, Fp8Format::E4M3);
    be->fp8_amax(amax, dy, false);
    be->fp8_current_scale(sg, amax, Fp8Format::E5M2);
    const Backend::Fp8Operand ox{&sx, Fp8Format::E4M3}, ow{&sw, Fp8Format::E4M3},
        og{&sg, Fp8Format::E5M2};
    auto row = [&](const char* pass, double sec, double work, const char* unit) {
      std::printf("%-5s %-34s %10.3f %9.1f %s\n", sh.name, pass, sec * 1e3, work / sec / 1e12,
                  unit);
    };
    const double xbytes = 2.0 * N * IC, gbytes = 2.0 * N * OC;
    row("bf16 forward GEMM", time_it([&] { be->matmul_forward(y, x, w, nullptr); }), flops,
        "TFLOP/s");
    row("amax of the input (read)", time_it([&] { be->fp8_amax(amax, x, true); }), xbytes, "TB/s");
    row("amax of the output gradient", time_it([&] { be->fp8_amax(amax, dy, true); }), gbytes,
        "TB/s");
    row("FP8 forward (quantize x, w + GEMM)",
        time_it([&] { be->fp8_matmul_forward(y, x, w, nullptr, ox, ow); }), flops, "TFLOP/s");
    row("bf16 backward (dgrad + wgrad)",
        time_it([&] { be->matmul_backward(&dx, dw, nullptr, dy, x, w); }), 2 * flops, "TFLOP/s");
    row("FP8 backward (3 quantizes + 2 GEMMs)",
        time_it([&] { be->fp8_matmul_backward(&dx, dw, nullptr, dy, x, w, og, ox, ow); }),
        2 * flops, "TFLOP/s");
    row("FP8 wgrad only (2 quantizes + GEMM)",
        time_it([&] { be->fp8_matmul_backward(nullptr, dw, nullptr, dy, x, w, og, ox, ow); }),
        flops, "TFLOP/s");
  }
  return 0;
#endif
}
