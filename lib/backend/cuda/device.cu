// device.cu: device discovery, the device allocator and host<->device copies.
#include <cstdio>

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

void set_device(int index) {
  CUDA_CHECK(cudaSetDevice(index));
}

namespace {
class DeviceAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 256);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "out of device memory: needed %.3f GiB, %.3f GiB free of %.3f GiB; reduce "
                    "--micro-batch-size or use more tensor/pipeline parallelism",
                    bytes / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0);
      throw Error(buf);
    }
    return p;
  }
  void deallocate(void* p, size_t) override { cudaFree(p); }
  Device device() const override { return Device::CUDA; }
};
}  // namespace

Allocator& device_allocator() {
  static DeviceAllocator alloc;
  return alloc;
}

void copy_to_device(Tensor& dst, const Tensor& src) {
  TESSERA_CHECK(dst.device() == Device::CUDA && src.device() == Device::CPU &&
                    dst.nbytes() == src.nbytes() && dst.dtype() == src.dtype(),
                "copy_to_device needs a device destination and a host source of equal size");
  CUDA_CHECK(cudaMemcpy(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyHostToDevice));
}

void copy_to_host(Tensor& dst, const Tensor& src) {
  TESSERA_CHECK(dst.device() == Device::CPU && src.device() == Device::CUDA &&
                    dst.nbytes() == src.nbytes() && dst.dtype() == src.dtype(),
                "copy_to_host needs a host destination and a device source of equal size");
  CUDA_CHECK(cudaMemcpy(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDeviceToHost));
}

}  // namespace tessera::cuda
