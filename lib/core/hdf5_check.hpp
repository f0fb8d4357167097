// hdf5_check.hpp: HDF5_CHECK for HDF5 C calls, which return a negative value on failure.
#pragma once

#include <hdf5.h>

#include "core/error.hpp"

namespace tessera::detail {
inline std::string describe_hdf5(long long status) {
  return "HDF5 call returned " + std::to_string(status) +
         "; check that the file exists, is complete and is not open elsewhere";
}
}  // namespace tessera::detail

#define HDF5_CHECK(expr)                                                                        \
  do {                                                                                          \
    auto tessera_h5_ = (expr);                                                                  \
    if (tessera_h5_ < 0)                                                                        \
      ::tessera::throw_check_failure(#expr, __FILE__, __LINE__,                                 \
                                     ::tessera::detail::describe_hdf5((long long)tessera_h5_)); \
  } while (0)
