// warp_emu.hpp: runs CUDA kernel bodies written against lib/backend/cuda/mma.cuh on the host, each
// CUDA thread as a fiber (its own stack) on the launching thread. The warp-collective primitives
// (mma.sync, ldmatrix, shuffles) are emulated literally from the PTX ISA's fragment tables in
// mma.cuh: each lane publishes its operands in the warp's exchange slots, the warp meets at a
// barrier, each lane computes its own result from the slots, and the warp meets again before the
// slots are reused. __syncthreads is a block barrier, cp.async a synchronous copy. Blocks run one
// after another.
//
// Fibers, not one OS thread per CUDA thread (until 2026-12): a barrier is then a switch of a few
// nanoseconds on the same core instead of waking 32 or 256 threads through the kernel's scheduler
// on two cores, which made the emulator tests the slowest of the suite (docs/testing.md). The
// schedule is deterministic: a thread runs until it waits at a barrier, then the next thread in
// order runs; the last thread to reach a barrier runs on first, ahead of the others (a write
// without the barrier before it shows), and thread 0 runs to its first barrier before thread 1
// starts (a read without the barrier before it reads the NaN-filled shared memory). Threads that
// wait at a barrier which the others never reach (they returned, or wait at another one) end the
// test with a message naming the barrier, instead of hanging.
//
// What this proves without a GPU: every index, fragment layout, mask, tile bound, buffer switch
// and barrier placement of the kernels, given the PTX semantics as documented. What it cannot:
// timing, asynchronous-copy hazards (copies complete at once here), and anything about the hardware
// beyond the documented semantics. Include this before mma.cuh with TESSERA_WARP_EMU defined.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <vector_types.h>  // uint4 (CUDA toolkit, host header)

#if defined(__SANITIZE_ADDRESS__)
#define TESSERA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TESSERA_EMU_ASAN 1
#endif
#endif
#ifdef TESSERA_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__)
// The context switch of the System V x86-64 ABI: pushes the callee-saved registers on the current
// stack, stores the stack pointer in *from, loads `to` and pops the same registers from there. A
// new fiber's stack is laid out as if it had called this (fiber_stack_init below). Weak: each test
// binary may include this header from several files.
extern "C" void tessera_emu_switch(void** from, void* to);
asm(R"(
  .text
  .weak tessera_emu_switch
  .type tessera_emu_switch, @function
tessera_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tessera_emu_switch, .-tessera_emu_switch
)");
#endif

namespace tessera::tc::emu {

struct Block;
struct Self {
  int tid = 0, bx = 0, by = 0;
  Block* block = nullptr;
};

// The fibers of the block being run on this OS thread.
class Fibers {
 public:
  static constexpr size_t kStack = 512 * 1024;  // per CUDA thread; the page below it faults

  // Runs body for threads 0..n-1 of one block to the end of all of them.
  void run(int n, int bx, int by, Block* block, const std::function<void()>& body) {
    reserve(n);
    body_ = &body;
    live_ = n;
    idle_ = 0;
    for (int t = 0; t < n; ++t) {
      fibers_[t].self = Self{t, bx, by, block};
      fibers_[t].done = false;
      init(t);
    }
    Fibers* outer = current_;
    current_ = this;
    cur_ = 0;
    main_known_ = false;
    switch_in(&main_sp_, 0);
    current_ = outer;
  }
  // The running fiber waits: the next live fiber runs (round robin).
  void yield() {
    const int n = static_cast<int>(count_);
    int next = cur_;
    do next = (next + 1) % n;
    while (fibers_[next].done);
    if (next != cur_) switch_to(next);
  }
  // A waiting fiber found its barrier still closed: after more such wake-ups than there are live
  // fibers, with no arrival, barrier opening or exit in between, nobody can open it.
  void idle(const char* what) {
    if (++idle_ > 2 * static_cast<size_t>(live_) + 2) {
      std::fprintf(
          stderr,
          "warp emulator: deadlock: thread %d of block (%d, %d) waits at a %s barrier that "
          "the other threads never reach (they returned, or wait at another barrier)\n",
          self().tid, self().bx, self().by, what);
      std::abort();
    }
  }
  void progress() { idle_ = 0; }
  Self& self() { return fibers_[cur_].self; }
  static Fibers* current() { return current_; }

 private:
  struct Fiber {
    Self self;
    bool done = false;
    char* stack = nullptr;  // kStack bytes above one guard page
    void* sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t ctx;
#endif
  };

  void reserve(int n) {
    if (count_ == static_cast<size_t>(n)) return;
    release();
    fibers_.reset(new Fiber[n]);
    count_ = static_cast<size_t>(n);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (int t = 0; t < n; ++t) {
      void* m = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) {
        std::fprintf(stderr, "warp emulator: cannot map a fiber stack of %zu bytes\n", kStack);
        std::abort();
      }
      mprotect(m, page, PROT_NONE);  // an overflow faults instead of writing the next stack
      fibers_[t].stack = static_cast<char*>(m) + page;
    }
  }
  void release() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t t = 0; t < count_; ++t) {
#ifdef TESSERA_EMU_ASAN
      ASAN_UNPOISON_MEMORY_REGION(fibers_[t].stack, kStack);  // the range may be mapped again
#endif
      munmap(fibers_[t].stack - page, kStack + page);
    }
    fibers_.reset();
    count_ = 0;
  }

  static void entry() {
    Fibers& f = *current_;
#ifdef TESSERA_EMU_ASAN
    // The first fiber is entered from the launching thread, whose stack it learns here; the
    // others from a fiber.
    if (!f.main_known_)
      __sanitizer_finish_switch_fiber(nullptr, &f.main_bottom_, &f.main_size_);
    else
      __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
    f.main_known_ = true;
#endif
    (*f.body_)();
    f.fibers_[f.cur_].done = true;
    --f.live_;
    f.progress();
    if (f.live_ > 0) {
      int next = f.cur_;
      do next = (next + 1) % static_cast<int>(f.count_);
      while (f.fibers_[next].done);
      f.switch_to(next, /*exiting=*/true);
    } else {
      f.switch_out_for_good();
    }
    std::abort();  // never resumed
  }

#if defined(__x86_64__)
  void init(int t) {
#ifdef TESSERA_EMU_ASAN
    // The frames a returned fiber left at the top of its stack (the switch that ended it never
    // returned) keep their poisoned red zones; this fiber's frames start there.
    ASAN_UNPOISON_MEMORY_REGION(fibers_[t].stack + kStack - kFresh, kFresh);
#endif
    // The stack as tessera_emu_switch leaves it: six callee-saved registers, then the return
    // address (entry), then a zero return address for entry itself, which starts as a function
    // called with a 16-byte aligned stack.
    auto* top = reinterpret_cast<uintptr_t*>(
        (reinterpret_cast<uintptr_t>(fibers_[t].stack) + kStack) & ~uintptr_t(15));
    top[-1] = 0;
    top[-2] = reinterpret_cast<uintptr_t>(&Fibers::entry_trampoline);
    for (int r = 3; r <= 8; ++r) top[-r] = 0;
    fibers_[t].sp = top - 8;
  }
  static void entry_trampoline() {
    entry();
  }
  void jump(void** save, void* to) {
    tessera_emu_switch(save, to);
  }
#else
  void init(int t) {
    getcontext(&fibers_[t].ctx);
    fibers_[t].ctx.uc_stack.ss_sp = fibers_[t].stack;
    fibers_[t].ctx.uc_stack.ss_size = kStack;
    fibers_[t].ctx.uc_link = nullptr;
    makecontext(&fibers_[t].ctx, &Fibers::entry, 0);
  }
#endif

  // From the launching thread into fiber t; back when every fiber has returned.
  void switch_in(void** save, int t) {
    (void)save;
#ifdef TESSERA_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, fibers_[t].stack, kStack);
#endif
#if defined(__x86_64__)
    jump(save, fibers_[t].sp);
#else
    swapcontext(&main_ctx_, &fibers_[t].ctx);
#endif
#ifdef TESSERA_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  }
  // From the running fiber to fiber `next`; `exiting`: the running one has returned.
  void switch_to(int next, bool exiting = false) {
    const int prev = cur_;
    cur_ = next;
#ifdef TESSERA_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, fibers_[next].stack, kStack);
#endif
#if defined(__x86_64__)
    jump(&fibers_[prev].sp, fibers_[next].sp);
#else
    swapcontext(&fibers_[prev].ctx, &fibers_[next].ctx);
#endif
#ifdef TESSERA_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    (void)exiting;
  }
  void switch_out_for_good() {
#ifdef TESSERA_EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, main_bottom_, main_size_);
#endif
#if defined(__x86_64__)
    void* dead = nullptr;
    jump(&dead, main_sp_);
#else
    setcontext(&main_ctx_);
#endif
  }

  static inline thread_local Fibers* current_ = nullptr;
  std::unique_ptr<Fiber[]> fibers_;
  size_t count_ = 0;
  int cur_ = 0, live_ = 0;
  size_t idle_ = 0;
  const std::function<void()>* body_ = nullptr;
  void* main_sp_ = nullptr;
#if !defined(__x86_64__)
  ucontext_t main_ctx_;
#endif
  const void* main_bottom_ = nullptr;
  size_t main_size_ = 0;
  bool main_known_ = false;
  static constexpr size_t kFresh = 64 * 1024;  // the top of a stack unpoisoned for a new fiber

 public:
  ~Fibers() {
    release();
  }
};

// Threads meet: each arrival but the last waits, the others run meanwhile.
class Barrier {
 public:
  explicit Barrier(int n, const char* what) : n_(n), what_(what) {}
  void wait() {
    Fibers& f = *Fibers::current();
    const uint64_t gen = gen_;
    f.progress();
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      return;
    }
    while (gen_ == gen) {
      f.yield();
      if (gen_ == gen) f.idle(what_);
    }
  }

 private:
  int n_, count_ = 0;
  uint64_t gen_ = 0;
  const char* what_;
};

struct Warp {
  Barrier bar{32, "warp"};
  const void* p[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
  float f[32];
};

struct Block {
  explicit Block(int threads) : bar(threads, "block") {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
  Barrier bar;
  std::vector<std::unique_ptr<Warp>> warps;
};

// The running CUDA thread (outside a launch: thread 0 of block (0, 0), no block).
inline Self& self() {
  thread_local Self outside;
  Fibers* f = Fibers::current();
  return f ? f->self() : outside;
}
inline Warp& warp() {
  return *self().block->warps[self().tid / 32];
}
// atomicAdd on device memory: the old value.
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
  Fibers fibers;
  for (int k = 0; k < gx * gy; ++k) {
    const int at = reverse ? gx * gy - 1 - k : k, by = at / gx, bx = at % gx;
    Block block(threads);
    std::vector<uint4> smem((smem_bytes + 15) / 16);
    if (!smem.empty()) std::memset(smem.data(), 0xff, smem.size() * 16);  // none: no pointer
    char* shared = reinterpret_cast<char*>(smem.data());
    fibers.run(threads, bx, by, &block, [&] { body(shared); });
  }
}

}  // namespace tessera::tc::emu
