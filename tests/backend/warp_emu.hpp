// warp_emu.hpp: runs CUDA kernel bodies written against lib/backend/cuda/mma.cuh on the host, one
// std::thread per CUDA thread. The warp-collective primitives (mma.sync, ldmatrix, shuffles) are
// emulated literally from the PTX ISA's fragment tables in mma.cuh: each lane publishes its
// operands in the warp's exchange slots, the warp meets at a barrier, each lane computes its own
// result from the slots, and the warp meets again before the slots are reused. __syncthreads is a
// block barrier, cp.async a synchronous copy. Blocks run one after another.
//
// What this proves without a GPU: every index, fragment layout, mask, tile bound, buffer switch
// and barrier placement of the kernels, given the PTX semantics as documented. What it cannot:
// timing, asynchronous-copy hazards (copies complete at once here), and anything about the hardware
// beyond the documented semantics. Include this before mma.cuh with TESSERA_WARP_EMU defined.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <vector_types.h>  // uint4 (CUDA toolkit, host header)

namespace tessera::tc::emu {

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  uint64_t gen_ = 0;
};

struct Warp {
  Barrier bar{32};
  const void* p[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
  float f[32];
};

struct Block {
  explicit Block(int threads) : bar(threads) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
  Barrier bar;
  std::vector<std::unique_ptr<Warp>> warps;
};

struct Self {
  int tid = 0, bx = 0, by = 0;
  Block* block = nullptr;
};
inline Self& self() {
  thread_local Self s;
  return s;
}
inline Warp& warp() {
  return *self().block->warps[self().tid / 32];
}
// atomicAdd on device memory: the old value (the threads of a block run concurrently here).
inline unsigned atomic_add(unsigned* p, unsigned v) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  const unsigned old = *p;
  *p = old + v;
  return old;
}
// ldmatrix and cp.async fault on addresses that are not 16-byte aligned; so does the emulator.
inline void require_aligned16(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    std::fprintf(stderr, "warp emulator: %s %p is not 16-byte aligned (thread %d)\n", what, p,
                 self().tid);
    std::abort();
  }
}

// Runs body(smem) for every thread of a (gx, gy) grid of blocks of `threads` threads, with
// `smem_bytes` of shared memory per block (filled with a NaN pattern, as uninitialised memory may
// hold anything).
// Blocks in order (y, then x), or the reverse order with `reverse` (what a kernel whose blocks
// meet through device memory must not depend on).
inline void launch(int gx, int gy, int threads, size_t smem_bytes,
                   const std::function<void(char*)>& body, bool reverse = false) {
  for (int k = 0; k < gx * gy; ++k) {
    const int at = reverse ? gx * gy - 1 - k : k, by = at / gx, bx = at % gx;
    {
      Block block(threads);
      std::vector<uint4> smem((smem_bytes + 15) / 16);
      if (!smem.empty()) std::memset(smem.data(), 0xff, smem.size() * 16);  // none: no pointer
      std::vector<std::thread> pool;
      pool.reserve(threads);
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          self() = Self{t, bx, by, &block};
          body(reinterpret_cast<char*>(smem.data()));
        });
      for (std::thread& th : pool) th.join();
    }
  }
}

}  // namespace tessera::tc::emu
