// test_fp8_emu.cpp: FP8's kernels (lib/backend/cuda/fp8.cuh), their exact source, on the host warp
// emulator (warp_emu.hpp) against the CPU emulation (backend/cpu/fp8.hpp), bit for bit: the
// two-stage amax (with NaN, accumulate, a partial last block) and quantize-and-transpose of f32
// and bf16 tensors in both formats, on shapes that are not multiples of the 64 x 64 tile (8-element
// accesses where the widths allow, single ones at ragged edges) and with more row tiles than the
// grid's rows (the kernel's row loop). On a GPU, test_cuda_ops runs the same kernels through the
// backend.
#define TESSERA_WARP_EMU 1
#include "backend/warp_emu.hpp"
// (warp_emu.hpp first: mma.cuh's emulated primitives use it.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/fp8.hpp"
#include "backend/cuda/fp8.cuh"

using namespace tessera;

namespace {

template <typename T>
std::vector<T> random_tensor(int64_t n, float sd, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<T> v(static_cast<size_t>(n));
  for (T& e : v) e = tc::from_f32<T>(nd(g));
  return v;
}

template <typename T>
float run_amax(const std::vector<T>& x, float start, bool accumulate) {
  const int64_t n = int64_t(x.size()), blocks = fp8k::amax_blocks(n);
  std::vector<float> partial(static_cast<size_t>(blocks), std::nanf(""));
  const int64_t chunk = fp8k::amax_chunk(n);
  tc::emu::launch(
      int(blocks), 1, fp8k::kThreads, fp8k::kThreads / 32 * sizeof(float), [&](char* sh) {
        fp8k::amax_partial(partial.data(), x.data(), n, chunk, reinterpret_cast<float*>(sh));
      });
  float amax = start;
  tc::emu::launch(1, 1, fp8k::kThreads, fp8k::kThreads / 32 * sizeof(float), [&](char* sh) {
    fp8k::amax_final(&amax, partial.data(), n > 0 ? blocks : 0, accumulate,
                     reinterpret_cast<float*>(sh));
  });
  return amax;
}

template <typename T>
void check_quantize(int64_t rows, int64_t cols, Fp8Format f, int64_t grid_rows) {
  const std::vector<T> x = random_tensor<T>(rows * cols, 3.f, unsigned(rows * 131 + cols));
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = tc::to_f32(x[i]);
  const float scale = cpu::fp8_current_scale(cpu::fp8_amax(xf.data(), int64_t(xf.size())), f);
  const int64_t ldt = (rows + 15) / 16 * 16;  // the backend's fp8_padded
  std::vector<uint8_t> q(x.size(), 0xAA), qt(size_t(cols * ldt), 0xAA);
  float scale_inv = std::nanf("");
  const int64_t col_tiles = (cols + fp8k::kTile - 1) / fp8k::kTile;
  tc::emu::launch(int(col_tiles), int(grid_rows), fp8k::kThreads, fp8k::kTileBytes, [&](char* sh) {
    fp8k::quantize_tiles(x.data(), rows, cols, &scale, f, q.data(), qt.data(), ldt, &scale_inv,
                         int64_t(tc::block_y()), grid_rows, reinterpret_cast<uint8_t*>(sh));
  });
  EXPECT_EQ(scale_inv, 1.0f / scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t want = fp8_from_float(xf[size_t(r * cols + c)] * scale, f);
      ASSERT_EQ(int(q[size_t(r * cols + c)]), int(want)) << r << "," << c;
      ASSERT_EQ(int(qt[size_t(c * ldt + r)]), int(want)) << "transposed " << r << "," << c;
    }
  for (int64_t c = 0; c < cols; ++c)  // the padding: zeros, every byte written
    for (int64_t r = rows; r < ldt; ++r)
      ASSERT_EQ(int(qt[size_t(c * ldt + r)]), 0) << "padding " << r << "," << c;
  // The CPU emulation's dequantized values are these codes over the scale.
  std::vector<float> deq(x.size());
  cpu::fp8_quantize_dequantize(deq.data(), xf.data(), int64_t(xf.size()), scale, f);
  for (size_t i = 0; i < x.size(); i += 97)
    EXPECT_EQ(deq[i], fp8_to_float(q[i], f) * (1.0f / scale));
}

}  // namespace

TEST(Fp8Emu, AmaxMatchesTheCpuInTwoStages) {
  // Large tensors: at most kMaxAmaxBlocks blocks of whole warps' strides covering every element.
  for (int64_t n : {int64_t(300000), int64_t(1) << 31}) {
    const int64_t chunk = fp8k::amax_chunk(n), blocks = fp8k::amax_blocks(n);
    EXPECT_LE(blocks, fp8k::kMaxAmaxBlocks);
    EXPECT_EQ(chunk % fp8k::kThreads, 0);
    EXPECT_GE(chunk * blocks, n);
    EXPECT_LT(chunk * (blocks - 1), n);
  }
  for (int64_t n : {1, 255, 256, 3000}) {  // one block, a partial one, several
    std::vector<float> x = random_tensor<float>(n, 2.f, unsigned(n));
    EXPECT_EQ(run_amax(x, 0.f, false), cpu::fp8_amax(x.data(), n)) << n;
    EXPECT_EQ(run_amax(x, 1e6f, true), 1e6f) << n;  // accumulate keeps a larger one
    EXPECT_EQ(run_amax(x, 1e6f, false), cpu::fp8_amax(x.data(), n)) << n;  // else overwrites
    x[size_t(n / 2)] = std::nanf("");
    EXPECT_TRUE(std::isinf(run_amax(x, 0.f, false))) << n;  // NaN counts as inf, as on the CPU
  }
  const std::vector<__nv_bfloat16> b = random_tensor<__nv_bfloat16>(5000, 1.f, 9);
  std::vector<float> bf(b.size());
  for (size_t i = 0; i < b.size(); ++i) bf[i] = tc::to_f32(b[i]);
  EXPECT_EQ(run_amax(b, 0.f, false), cpu::fp8_amax(bf.data(), int64_t(bf.size())));
}

TEST(Fp8Emu, QuantizeAndTransposeAreTheCpuConversion) {
  check_quantize<float>(70, 45, Fp8Format::E4M3, 3);  // partial tiles both ways, padded to 80
  check_quantize<float>(5, 48, Fp8Format::E5M2, 1);   // an expert's block of 5 rows: 16
  check_quantize<float>(64, 96, Fp8Format::E5M2, 1);  // one grid row, two tiles each
  check_quantize<__nv_bfloat16>(33, 130, Fp8Format::E4M3, 2);
  check_quantize<__nv_bfloat16>(96, 32, Fp8Format::E5M2, 5);    // more grid rows than tiles
  check_quantize<__nv_bfloat16>(130, 200, Fp8Format::E4M3, 2);  // 8-wide accesses, partial tiles
  check_quantize<float>(77, 64, Fp8Format::E5M2, 1);            // f32 in two 16-byte loads
}
