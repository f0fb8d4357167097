// device.hpp: CUDA devices and device memory, usable from code compiled without nvcc.
#pragma once

#include <string>

#include "core/tensor.hpp"

namespace tessera::cuda {

// GPUs visible to this process; 0 when there is no driver or no device (never throws).
int device_count();
// "NVIDIA H100 80GB HBM3, 79.1 GiB, sm_90" for device `index`.
std::string device_description(int index);
// GPU `index`'s name and total memory in bytes, without making it current.
std::string device_name(int index, size_t* total_bytes);
// Makes `index` current for this thread.
void set_device(int index);
int current_device();
// "0000:1B:00.0": tells apart the GPUs of a node whatever CUDA_VISIBLE_DEVICES each rank has.
std::string pci_bus_id(int index);
// Free and total bytes of the current device.
void memory_info(size_t* free_bytes, size_t* total_bytes);

// Device memory from cudaMalloc; out-of-memory names the buffer (AllocationLabel), the request
// and the free memory, and says what to change.
Allocator& device_allocator();
// Bytes held through device_allocator() now, and the most ever held at once.
size_t allocated_bytes();
size_t peak_allocated_bytes();
void reset_peak_allocated_bytes();  // the peak restarts from what is held now

// Queues a kernel on `stream` (a cudaStream_t) that spins for `us` microseconds: the test hooks'
// stream delays (core/test_hooks.hpp).
void sleep_on_stream(void* stream, int us);

// Copies between host and device tensors of the same dtype and size.
void copy_to_device(Tensor& dst, const Tensor& src);
void copy_to_host(Tensor& dst, const Tensor& src);

}  // namespace tessera::cuda
