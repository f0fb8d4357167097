// cuda_check.hpp: CUDA_CHECK and CUBLAS_CHECK name the failing call, file and line.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "core/error.hpp"

namespace tessera::detail {
inline std::string describe_cuda(cudaError_t e) {
  return std::string("CUDA error ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}
inline std::string describe_cublas(cublasStatus_t s) {
  return std::string("cuBLAS error ") + cublasGetStatusName(s) + ": " + cublasGetStatusString(s);
}
}  // namespace tessera::detail

#define CUDA_CHECK(expr) TESSERA_CHECK_CALL(expr, cudaSuccess, ::tessera::detail::describe_cuda)
#define CUBLAS_CHECK(expr) \
  TESSERA_CHECK_CALL(expr, CUBLAS_STATUS_SUCCESS, ::tessera::detail::describe_cublas)
