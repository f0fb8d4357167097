// cublas_library.cpp: cuBLAS and cuBLASLt loaded when the CUDA backend first calls them, not when a
// Tessera program starts.
//
// libcublasLt's static initializers take about 0.5 s of CPU in every process that links it (perf,
// 2026-12-01: 80 % of test_core's start-up), and every Tessera program linked it through the
// library, so `tessera-train --device cpu`, each rank of a CPU run and each GoogleTest case paid
// it (app.cli_errors: 150 starts, 90 s of its 130). Here the 20 cuBLAS functions the backend calls
// are defined with the headers' own prototypes (a mismatch is a compile error) and forward to the
// library's, found with dlopen/dlsym on the first call: only a process that makes the CUDA backend
// loads cuBLAS. The library is found like any other (LD_LIBRARY_PATH, this build's run path, the
// system's cache); scripts/gpu-run.sh puts PyTorch's cuBLAS on LD_LIBRARY_PATH.
#include "backend/cuda/cublas_library.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "core/error.hpp"

namespace tessera::cuda {
namespace {

const std::string& lib_name(CublasLib lib) {
  static const std::string blas = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR),
                           lt = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  return lib == CublasLib::Blas ? blas : lt;
}

void* handle(CublasLib lib) {
  static std::once_flag once[2];
  static void* h[2] = {nullptr, nullptr};
  static std::string err[2];
  const int i = lib == CublasLib::Blas ? 0 : 1;
  std::call_once(once[i], [&] {
    h[i] = dlopen(lib_name(lib).c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h[i]) {
      const char* e = dlerror();
      err[i] = e ? e : "unknown error";
    }
  });
  if (!h[i])
    throw Error("the CUDA backend cannot load " + lib_name(lib) + " (" + err[i] +
                "): put the CUDA toolkit's library folder (e.g. /usr/local/cuda/lib64) on "
                "LD_LIBRARY_PATH, or use --device cpu");
  return h[i];
}

}  // namespace

void* cublas_symbol(CublasLib lib, const char* name) {
  void* h = handle(lib);
  dlerror();
  void* f = dlsym(h, name);
  if (!f)
    throw Error(std::string("the CUDA backend found no ") + name + " in " + lib_name(lib) +
                ": this build needs cuBLAS " + std::to_string(CUBLAS_VER_MAJOR) +
                ".x (check LD_LIBRARY_PATH)");
  return f;
}

const std::vector<std::pair<CublasLib, const char*>>& cublas_functions() {
  static const std::vector<std::pair<CublasLib, const char*>> all = {
#define TESSERA_CUBLAS_NAME(lib, ret, name, params, args) {CublasLib::lib, #name},
#include "backend/cuda/cublas_functions.inc"
#undef TESSERA_CUBLAS_NAME
  };
  return all;
}

}  // namespace tessera::cuda

// The forwarding definitions, one per function of cublas_functions.inc.
#define TESSERA_CUBLAS_NAME(lib, ret, name, params, args)                                         \
  extern "C" ret name params {                                                                    \
    using Fn = ret(*) params;                                                                     \
    static const Fn f =                                                                           \
        reinterpret_cast<Fn>(tessera::cuda::cublas_symbol(tessera::cuda::CublasLib::lib, #name)); \
    return f args;                                                                                \
  }
#include "backend/cuda/cublas_functions.inc"
#undef TESSERA_CUBLAS_NAME
