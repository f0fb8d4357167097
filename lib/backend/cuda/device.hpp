// device.hpp: CUDA devices and device memory, usable from code compiled without nvcc.
#pragma once

#include <string>

#include "core/tensor.hpp"

namespace tessera::cuda {

// GPUs visible to this process; 0 when there is no driver or no device (never throws).
int device_count();
// "NVIDIA H100 80GB HBM3, 79.1 GiB, sm_90" for device `index`.
std::string device_description(int index);
// Makes `index` current for this thread.
void set_device(int index);

// Device memory from cudaMalloc; out-of-memory names the request and the free memory.
Allocator& device_allocator();

// Copies between host and device tensors of the same dtype and size.
void copy_to_device(Tensor& dst, const Tensor& src);
void copy_to_host(Tensor& dst, const Tensor& src);

}  // namespace tessera::cuda
