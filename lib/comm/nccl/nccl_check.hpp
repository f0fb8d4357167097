// nccl_check.hpp: NCCL_CHECK names the failing NCCL call, file, line and NCCL's error string.
// Only included by code compiled in CUDA builds (nccl.h comes with the CUDA toolkit).
#pragma once

#include <nccl.h>

#include <string>

#include "core/error.hpp"

namespace tessera::detail {
inline std::string describe_nccl(ncclResult_t r) {
  return std::string("NCCL error: ") + ncclGetErrorString(r) + " (set NCCL_DEBUG=INFO for details)";
}
}  // namespace tessera::detail

#define NCCL_CHECK(expr) TESSERA_CHECK_CALL(expr, ncclSuccess, ::tessera::detail::describe_nccl)
