// nvtx.hpp: NVTX ranges for Nsight Systems (docs/profiling.md). Header-only NVTX v3 from the CUDA
// toolkit: without a profiler attached a range costs a branch, and builds without the toolkit
// compile the ranges away. The test hook TESSERA_TEST_NVTX_LOG (core/test_hooks.hpp) writes the
// scoped ranges' names to a file in either build, so tests check them on the CPU.
#pragma once

#include "core/test_hooks.hpp"

#if defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define TESSERA_HAVE_NVTX 1
#endif
#endif

namespace tessera {

// Pushes a named range for the lifetime of the object (one thread's nested ranges).
class NvtxRange {
 public:
#ifdef TESSERA_HAVE_NVTX
  explicit NvtxRange(const char* name) {
    if (test_hooks::nvtx_log_on()) test_hooks::nvtx_log(name);
    nvtxRangePushA(name);
  }
  ~NvtxRange() {
    nvtxRangePop();
  }
#else
  explicit NvtxRange(const char* name) {
    if (test_hooks::nvtx_log_on()) test_hooks::nvtx_log(name);
  }
#endif
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

// A range opened and closed in different scopes of one thread (e.g. the profiled iterations),
// properly nested with the scoped ranges inside it; nsys --capture-range=nvtx can key on it.
#ifdef TESSERA_HAVE_NVTX
inline void nvtx_push(const char* name) {
  nvtxRangePushA(name);
}
inline void nvtx_pop() {
  nvtxRangePop();
}
#else
inline void nvtx_push(const char*) {}
inline void nvtx_pop() {}
#endif

}  // namespace tessera

#define TESSERA_NVTX_CAT2(a, b) a##b
#define TESSERA_NVTX_CAT(a, b) TESSERA_NVTX_CAT2(a, b)
// NVTX_RANGE("forward"): a range until the end of the enclosing scope.
#define NVTX_RANGE(name) ::tessera::NvtxRange TESSERA_NVTX_CAT(nvtx_range_, __LINE__)(name)
