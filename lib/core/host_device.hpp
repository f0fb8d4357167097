// host_device.hpp: TESSERA_HD marks the small functions that the CPU code and the CUDA kernels
// share (dropout masks, RoPE frequencies, ALiBi slopes): __host__ __device__ under nvcc, inline
// elsewhere.
#pragma once

#if defined(__CUDACC__)
#define TESSERA_HD __host__ __device__ __forceinline__
#else
#define TESSERA_HD inline
#endif
