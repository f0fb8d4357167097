// nvtx.hpp: NVTX ranges for Nsight Systems (docs/profiling.md). Header-only NVTX v3 from the CUDA
// toolkit: without a profiler attached a range costs a branch, and builds without the toolkit
// compile the ranges away.
#pragma once

#if defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define TESSERA_HAVE_NVTX 1
#endif
#endif

#include <cstdint>

namespace tessera {

// Pushes a named range for the lifetime of the object (one thread's nested ranges).
class NvtxRange {
 public:
#ifdef TESSERA_HAVE_NVTX
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
#else
  explicit NvtxRange(const char*) {}
#endif
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

// A range that may start and end in different scopes (e.g. the captured iterations), for
// nsys --capture-range=nvtx. Returns an id for nvtx_range_end.
#ifdef TESSERA_HAVE_NVTX
inline uint64_t nvtx_range_start(const char* name) {
  return nvtxRangeStartA(name);
}
inline void nvtx_range_end(uint64_t id) {
  nvtxRangeEnd(id);
}
#else
inline uint64_t nvtx_range_start(const char*) {
  return 0;
}
inline void nvtx_range_end(uint64_t) {}
#endif

}  // namespace tessera

#define TESSERA_NVTX_CAT2(a, b) a##b
#define TESSERA_NVTX_CAT(a, b) TESSERA_NVTX_CAT2(a, b)
// NVTX_RANGE("forward"): a range until the end of the enclosing scope.
#define NVTX_RANGE(name) ::tessera::NvtxRange TESSERA_NVTX_CAT(nvtx_range_, __LINE__)(name)
