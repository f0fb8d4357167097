// test_tensor.cpp: Tensor views, dtype conversions and the Philox RNG.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "core/dtype.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"

using namespace tessera;

TEST(Tensor, ShapeNumelAndViews) {
  Tensor t = Tensor::zeros({3, 4, 5});
  EXPECT_EQ(t.numel(), 60);
  EXPECT_EQ(t.nbytes(), 240u);
  float* p = t.f32();
  for (int i = 0; i < 60; ++i) p[i] = static_cast<float>(i);
  Tensor s = t.slice0(1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 4, 5}));
  EXPECT_EQ(s.f32()[0], 20.f);
  Tensor v = t.view(7, {2, 3});
  EXPECT_EQ(v.f32()[5], 12.f);
  v.f32()[0] = -1.f;  // views share storage
  EXPECT_EQ(p[7], -1.f);
  EXPECT_THROW(t.view(55, {2, 3}), Error);
  EXPECT_THROW(t.i32(), Error);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
}

TEST(Tensor, CopyAndFill) {
  Tensor a({5}), b({5});
  a.fill_(2.5f);
  b.copy_from(a);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(b.f32()[i], 2.5f);
  Tensor c({6});
  EXPECT_THROW(c.copy_from(a), Error);
}

// Megatron-FSDP's unit tensors (step/fsdp.hpp): no memory until bound; views made before the
// binding follow it, reading while unbound is an error naming FSDP, and owned storage refuses.
TEST(Tensor, UnboundStorageFollowsItsBinding) {
  Tensor unit = Tensor::unbound({6}, DType::F32, cpu_allocator());
  Tensor w = unit.view(2, {2, 2});  // a parameter's view, made once
  EXPECT_FALSE(unit.storage_bound());
  try {
    (void)w.f32();
    ADD_FAILURE() << "reading an unbound tensor did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP unit"), std::string::npos) << e.what();
  }
  Tensor a({6}), b({8});
  for (int i = 0; i < 6; ++i) a.f32()[i] = float(i);
  for (int i = 0; i < 8; ++i) b.f32()[i] = float(10 + i);
  unit.bind_storage(a);
  EXPECT_TRUE(w.storage_bound());
  EXPECT_EQ(w.f32()[0], 2.f);
  EXPECT_EQ(w.f32()[3], 5.f);
  unit.bind_storage(b);  // another buffer of the pool: the same view reads it
  EXPECT_EQ(w.f32()[0], 12.f);
  unit.unbind_storage();
  EXPECT_THROW((void)w.f32(), Error);
  EXPECT_THROW(unit.bind_storage(Tensor({5})), Error);  // too small
  EXPECT_THROW(a.bind_storage(b), Error);               // owns its memory
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(3.140625f)), 3.140625f);  // exactly representable
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: rounds to even (1.0)
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, F16KnownValues) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);                    // overflow to inf
  EXPECT_EQ(f32_to_f16(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x0001), 5.960464477539063e-08f);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  for (float x : {0.1f, -3.7f, 1234.5f, 6.1e-5f, 1e-7f}) {
    const float back = f16_to_f32(f32_to_f16(x));
    EXPECT_NEAR(back, x, std::fabs(x) * 1e-3 + 6e-8) << x;
  }
}

TEST(Rng, PhiloxKnownAnswers) {
  // Known-answer vectors of Philox4x32-10 from the Random123 distribution.
  EXPECT_EQ(philox4x32({0, 0, 0, 0}, 0, 0),
            (Philox4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(
      philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffu, 0xffffffffu),
      (Philox4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(
      philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u, 0x299f31d0u),
      (Philox4{0xd16cfe09u, 0x94fdcceBu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Rng, NormalHasUnitMoments) {
  CounterRng rng(42, stable_hash("x"));
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double z = rng.normal(i);
    s += z;
    s2 += z * z;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
  EXPECT_EQ(rng.normal(12345), CounterRng(42, stable_hash("x")).normal(12345));
  EXPECT_NE(rng.normal(12345), CounterRng(43, stable_hash("x")).normal(12345));
}

// ---- check macros -----------------------------------------------------------------------------

#include "comm/mpi/mpi_check.hpp"
#include "core/hdf5_check.hpp"

namespace {
int failing_mpi_call() {
  return MPI_ERR_COUNT;
}
herr_t failing_hdf5_call() {
  return -1;
}
}  // namespace

TEST(Errors, CheckMacrosNameExpressionFileAndLine) {
  try {
    MPI_CHECK(failing_mpi_call());
    FAIL() << "MPI_CHECK did not throw";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("failing_mpi_call()"), std::string::npos) << m;
    EXPECT_NE(m.find("test_tensor.cpp:"), std::string::npos) << m;
    EXPECT_NE(m.find("MPI error"), std::string::npos) << m;
  }
  try {
    HDF5_CHECK(failing_hdf5_call());
    FAIL() << "HDF5_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("failing_hdf5_call()"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(MPI_CHECK(MPI_SUCCESS));
  try {
    TESSERA_CHECK(1 + 1 == 3, "arithmetic is ", "broken");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("arithmetic is broken"), std::string::npos) << e.what();
  }
}

// ---- checksums ----------------------------------------------------------------------------------

#include "core/hash.hpp"

TEST(Hash, Xxh64KnownValues) {
  // Reference values from `xxhsum -H1` (xxHash 0.8.1).
  EXPECT_EQ(xxh64("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(xxh64("abc", 3), 0x44bc2cf5ad770999ull);
  const char* s = "The quick brown fox jumps over the lazy dog, then again and again!";
  EXPECT_EQ(xxh64(s, std::strlen(s)), 0xe2db77193fb44329ull);
}
