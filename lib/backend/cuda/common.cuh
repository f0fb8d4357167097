// common.cuh: what the CUDA op files (attention.cu, layernorm.cu, ...) share: f32 loads and
// rounded stores for every storage type, the dtype dispatch, argument checks, the launch geometry
// of elementwise kernels, fixed-order block reductions and the two-stage column sums. Activations
// and compute weights are f32, bf16 or f16 (kernels are templates over the storage type T and
// compute in f32); gradients of parameters, statistics and optimizer state are f32 (backend.hpp).
// Kernels favour determinism over speed where the two conflict: every reduction has one owner
// thread or a fixed order, so results do not change from run to run (exact resume needs this).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_check.hpp"
#include "core/tensor.hpp"

namespace tessera::cuda_ops {

constexpr int kThreads = 256;

// The largest power of two (up to 256) that divides the address: cuBLASLt's alignment preference
// (its heuristics assume 256 unless told, and an algorithm chosen so fails on a less aligned
// pointer with CUBLAS_STATUS_NOT_SUPPORTED).
inline uint32_t lt_alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}
// At least one block: an empty tensor launches one block whose threads all return (every kernel
// checks its bound), where a zero-size grid would be an invalid launch (launch audit,
// docs/kernels.md).
inline int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return b > 0 ? static_cast<int>(b) : 1;
}
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

inline int64_t rows_of(const Tensor& t) {
  return t.numel() / t.shape().back();
}
inline int64_t cols_of(const Tensor& t) {
  return t.shape().back();
}

inline void expect_device(const Tensor& t, const char* what) {
  TESSERA_CHECK(t.defined() && t.device() == Device::CUDA, what, " must be a CUDA tensor");
}

// f32 loads and rounded stores for every storage type.
__device__ __forceinline__ float ld(float x) {
  return x;
}
__device__ __forceinline__ float ld(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float ld(__half x) {
  return __half2float(x);
}
template <typename T>
__device__ __forceinline__ T to(float v);
template <>
__device__ __forceinline__ float to<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 to<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half to<__half>(float v) {
  return __float2half_rn(v);
}

// Calls f(T{}) with T the storage type of `d` (float, __nv_bfloat16 or __half).
template <typename F>
void dispatch(DType d, const char* what, F&& f) {
  switch (d) {
    case DType::F32:
      f(float{});
      return;
    case DType::BF16:
      f(__nv_bfloat16{});
      return;
    case DType::F16:
      f(__half{});
      return;
    default:
      throw Error(std::string(what) + ": the CUDA backend computes in f32, bf16 or f16, not " +
                  dtype_name(d));
  }
}
inline void expect_dtype(const Tensor& t, DType d, const char* what) {
  TESSERA_CHECK(t.dtype() == d, what, " is ", dtype_name(t.dtype()), ", expected ", dtype_name(d));
}
inline cudaDataType_t cuda_type(DType d) {
  return d == DType::F32 ? CUDA_R_32F : d == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

// Block-wide sum in a fixed order (warp shuffles, then warp 0), the result in every thread.
__device__ inline float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float t = 0.f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) t += shared[w];
    shared[32] = t;
  }
  __syncthreads();
  const float r = shared[32];
  __syncthreads();
  return r;
}
__device__ inline float block_max(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = -INFINITY;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) t = fmaxf(t, shared[w]);
    shared[32] = t;
  }
  __syncthreads();
  const float r = shared[32];
  __syncthreads();
  return r;
}

// Column sums over many rows in two deterministic stages (rowwise.cuh): each (column, chunk of
// rows) partial in row order (rowwise::column_partials, launched by each user), then each column's
// R partials part[r * C + c] added in a fixed order into out[c] by this function (defined in
// matmul.cu), for the bias gradient and the LayerNorm / RMSNorm parameters.
void sum_column_partials(float* out, const float* part, int64_t R, int64_t C, cudaStream_t s);

}  // namespace tessera::cuda_ops
