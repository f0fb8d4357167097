// device.cu: device discovery, the device allocator and host<->device copies.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device.hpp"

namespace tessera::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string device_description(int index) {
  cudaDeviceProp p;
  CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s, %.1f GiB, sm_%d%d", p.name,
                p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), p.major, p.minor);
  return buf;
}

std::string device_name(int index, size_t* total_bytes) {
  cudaDeviceProp p;
  CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  *total_bytes = p.totalGlobalMem;
  return p.name;
}

void set_device(int index) {
  CUDA_CHECK(cudaSetDevice(index));
}

int current_device() {
  int d = 0;
  CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

std::string pci_bus_id(int index) {
  char buf[64] = {0};
  CUDA_CHECK(cudaDeviceGetPCIBusId(buf, sizeof buf - 1, index));
  return buf;
}

void memory_info(size_t* free_bytes, size_t* total_bytes) {
  CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

namespace {
std::atomic<size_t> g_allocated{0}, g_peak{0};

class DeviceAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 256);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      const std::string& what = AllocationLabel::current();
      char buf[512];
      std::snprintf(buf, sizeof buf,
                    "out of GPU memory allocating %s: needed %.3f GiB, %.3f GiB free of %.3f GiB "
                    "(%.3f GiB already held by Tessera); lower --micro-batch-size, or raise "
                    "--tensor-model-parallel-size / --pipeline-model-parallel-size (--dry-run "
                    "prints the estimate per rank)",
                    what.empty() ? "a buffer" : what.c_str(), bytes / 1073741824.0,
                    free_b / 1073741824.0, total_b / 1073741824.0,
                    g_allocated.load() / 1073741824.0);
      throw Error(buf);
    }
    const size_t now = g_allocated += bytes;
    size_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    return p;
  }
  void deallocate(void* p, size_t bytes) override {
    cudaFree(p);
    g_allocated -= bytes;
  }
  Device device() const override { return Device::CUDA; }
};
}  // namespace

size_t allocated_bytes() {
  return g_allocated.load();
}
size_t peak_allocated_bytes() {
  return g_peak.load();
}
void reset_peak_allocated_bytes() {
  g_peak = g_allocated.load();
}

Allocator& device_allocator() {
  static DeviceAllocator alloc;
  return alloc;
}

void copy_to_device(Tensor& dst, const Tensor& src) {
  TESSERA_CHECK(dst.device() == Device::CUDA && src.device() == Device::CPU &&
                    dst.nbytes() == src.nbytes() && dst.dtype() == src.dtype(),
                "copy_to_device needs a device destination and a host source of equal size");
  CUDA_CHECK(cudaDeviceSynchronize());  // after every stream's work (backends use their own)
  CUDA_CHECK(cudaMemcpy(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyHostToDevice));
}

void copy_to_host(Tensor& dst, const Tensor& src) {
  TESSERA_CHECK(dst.device() == Device::CPU && src.device() == Device::CUDA &&
                    dst.nbytes() == src.nbytes() && dst.dtype() == src.dtype(),
                "copy_to_host needs a host destination and a device source of equal size");
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDeviceToHost));
}

namespace {
__global__ void sleep_kernel(long long cycles_per_us, int us) {
  const long long end = clock64() + cycles_per_us * us;
  while (clock64() < end) {
  }
}
}  // namespace

void sleep_on_stream(void* stream, int us) {
  if (us <= 0) return;
  static const long long per_us = [] {
    int khz = 0, dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    return std::max(1LL, static_cast<long long>(khz) / 1000);
  }();
  sleep_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(per_us, us);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace tessera::cuda
