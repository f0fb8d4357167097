// backend.cpp: what every backend shares: host staging memory.
#include "backend/backend.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <string>

namespace tessera {

// Staging buffers are large (a checkpoint's state): 2 MiB aligned and advised as transparent huge
// pages, so filling them the first time takes 512 times fewer page faults.
void* Backend::alloc_host(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  void* p = nullptr;
  if (posix_memalign(&p, kHuge, bytes > 0 ? bytes : 1) != 0 || !p)
    throw Error("host allocation of " + std::to_string(bytes) + " bytes failed");
  if (bytes >= kHuge) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: ignored where unsupported
  return p;
}

void Backend::free_host(void* p) { std::free(p); }

}  // namespace tessera
