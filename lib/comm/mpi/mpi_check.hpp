// mpi_check.hpp: MPI_CHECK names the failing MPI call, file, line and MPI's own error string.
#pragma once

#include <mpi.h>

#include <string>

#include "core/error.hpp"

namespace tessera::detail {
inline std::string describe_mpi(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  // Open MPI aborts MPI_Error_string outside MPI_Init..MPI_Finalize.
  if (!initialized || finalized) return "MPI error code " + std::to_string(code);
  char msg[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string("MPI error: ") + msg;
}
}  // namespace tessera::detail

#define MPI_CHECK(expr) TESSERA_CHECK_CALL(expr, MPI_SUCCESS, ::tessera::detail::describe_mpi)
