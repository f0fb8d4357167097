// error.hpp: Tessera's error type and the check macros every external call goes through.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tessera {

// Thrown for every failure; the message is one line that says what, where and what to do.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A bad configuration value or a bad command line: apps report it once and exit with code 2.
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what) : Error(what) {}
};

// Bad input that every rank of the job learned at the same point of a collective (one rank read a
// bad sample, all agreed to stop): each rank may end cleanly, exit 2, with the first rank's words.
class AgreedConfigError : public ConfigError {
 public:
  explicit AgreedConfigError(const std::string& what) : ConfigError(what) {}
};

// Builds "<expr> failed at <file>:<line>: <detail>" and throws Error.
[[noreturn]] void throw_check_failure(const char* expr, const char* file, int line,
                                      const std::string& detail);

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace tessera

// TESSERA_CHECK(cond, msg...): an internal precondition; msg pieces are streamed together.
#define TESSERA_CHECK(cond, ...)                                              \
  do {                                                                        \
    if (!(cond))                                                              \
      ::tessera::throw_check_failure(#cond, __FILE__, __LINE__,               \
                                     ::tessera::detail::concat(__VA_ARGS__)); \
  } while (0)

// TESSERA_CHECK_CALL(expr, ok, describe): runs a C library call returning a status code and throws
// naming the expression, file, line and describe(status) when it is not `ok`. The per-library
// macros are built on it: CUDA_CHECK/CUBLAS_CHECK (backend/cuda/cuda_check.hpp), MPI_CHECK and
// NCCL_CHECK (comm/), HDF5_CHECK (core/hdf5_check.hpp).
#define TESSERA_CHECK_CALL(expr, ok, describe)                                              \
  do {                                                                                      \
    auto tessera_status_ = (expr);                                                          \
    if (tessera_status_ != (ok))                                                            \
      ::tessera::throw_check_failure(#expr, __FILE__, __LINE__, describe(tessera_status_)); \
  } while (0)
