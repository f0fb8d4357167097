// test_cuda_device.cpp: device discovery, the device allocator and host<->device copies. Skips
// itself where no GPU is visible (this is a CUDA build on a machine that may have none).
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "backend/cuda/cublas_library.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"

using namespace tessera;

namespace {
bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(library) != std::string::npos) return true;
  return false;
}
// Before any test runs: a program that links the CUDA backend does not load cuBLAS at start.
const bool kCublasLtAtStart = mapped("libcublasLt.so");
const bool kCublasAtStart = mapped("libcublas.so");
}  // namespace

// cuBLAS and cuBLASLt load on the backend's first call (backend/cuda/cublas_library.cpp): their
// start-up cost (0.5 s of CPU) is not paid by CPU runs, the tools and the tests. Every function the
// backend calls resolves in the toolkit's libraries (no GPU needed for that).
TEST(CublasLibrary, LoadedOnFirstUseNotAtStart) {
  EXPECT_FALSE(kCublasLtAtStart) << "libcublasLt was mapped before main";
  EXPECT_FALSE(kCublasAtStart) << "libcublas was mapped before main";
  ASSERT_GE(cuda::cublas_functions().size(), 20u);
  for (const auto& [lib, name] : cuda::cublas_functions())
    EXPECT_NE(cuda::cublas_symbol(lib, name), nullptr) << name;
  EXPECT_TRUE(mapped("libcublasLt.so"));
  EXPECT_TRUE(mapped("libcublas.so"));
  try {
    cuda::cublas_symbol(cuda::CublasLib::Lt, "cublasLtNoSuchFunction");
    FAIL() << "a missing function resolved";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("found no cublasLtNoSuchFunction in libcublasLt.so."),
              std::string::npos)
        << e.what();
  }
}

TEST(CudaDevice, CountNeverThrows) {
  const int n = cuda::device_count();
  EXPECT_GE(n, 0);
  if (n == 0) GTEST_SKIP() << "no CUDA device visible";
  EXPECT_FALSE(cuda::device_description(0).empty());
}

TEST(CudaDevice, RoundTripThroughDeviceMemory) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  cuda::set_device(0);
  Tensor host({1001});
  for (int i = 0; i < 1001; ++i) host.f32()[i] = 0.5f * i - 3.f;
  Tensor dev({1001}, DType::F32, cuda::device_allocator());
  EXPECT_EQ(dev.device(), Device::CUDA);
  cuda::copy_to_device(dev, host);
  Tensor back = Tensor::zeros({1001});
  cuda::copy_to_host(back, dev);
  for (int i = 0; i < 1001; ++i) ASSERT_EQ(back.f32()[i], host.f32()[i]);
}

TEST(CudaDevice, OutOfMemoryNamesTheRequest) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  try {
    Tensor huge({int64_t(1) << 42}, DType::F32, cuda::device_allocator());  // 16 TiB
    FAIL() << "a 16 TiB allocation succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of GPU memory"), std::string::npos) << e.what();
  }
}

// ---- NCCL over the world communicator (one rank here; the MPI tests cover the groups) -----------

#include <mpi.h>

#include "comm/nccl/nccl_communicator.hpp"

TEST(Nccl, AllReduceOnDeviceTensors) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) MPI_Init(nullptr, nullptr);
  cuda::set_device(0);
  auto be = make_cuda_backend();
  auto comm = make_nccl_communicator(MPI_COMM_WORLD, be->stream());
  Tensor host({37});
  for (int i = 0; i < 37; ++i) host.f32()[i] = float(i);
  Tensor dev({37}, DType::F32, cuda::device_allocator());
  be->copy_from_host(dev, host.raw());
  comm->all_reduce(dev, ReduceOp::Sum);
  Tensor back = Tensor::zeros({37});
  be->copy_to_host(back.raw(), dev);
  for (int i = 0; i < 37; ++i) ASSERT_EQ(back.f32()[i], float(i * comm->size()));
}
