// phase_timer.hpp: where the time of a training step goes, without Nsight (docs/profiling.md).
//
// The model and the trainer mark named phases (one op kind each: "qkv-gemm-forward",
// "attention-core-forward", "optimizer-step", ...). Each mark also opens the NVTX range of the same
// name, so an Nsight capture shows the same phases. While the global PhaseTimer is disabled (the
// default) a mark costs the NVTX call and one branch; enabled, each mark takes a timestamp on a
// PhaseClock: CUDA events on the backend's stream (backend/cuda/phase_events.hpp) or, on the CPU,
// std::chrono after the backend has synchronized (ChronoPhaseClock). Timestamps are only read in
// collect(), after one synchronize, and summed per phase name.
//
// A phase's time is exclusive: a phase nested inside another is subtracted from the outer one, so
// the phases never count a moment twice and their sum is at most the wall time they span. The
// timer is for the thread that drives the backend (the one that calls the ops); other threads
// must not mark phases.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/nvtx.hpp"

namespace tessera {

// Timestamps in numbered slots. record(slot) is called with slots 0, 1, 2, ... in order and must
// not wait for the device; synchronize() makes every recorded slot readable; after it,
// elapsed_ms(a, b) is the time from slot a to slot b. Slots are reused after each collect().
class PhaseClock {
 public:
  virtual ~PhaseClock() = default;
  virtual void record(int slot) = 0;
  virtual void synchronize() = 0;
  virtual double elapsed_ms(int from, int to) = 0;
};

// Host wall clock: each timestamp is taken after `sync` (the backend's synchronize(), which
// returns when its queued work is done; nothing on the CPU backend), so it times what the backend
// did between two marks. The clock of the CPU backend, and the one tests use.
class ChronoPhaseClock final : public PhaseClock {
 public:
  explicit ChronoPhaseClock(std::function<void()> sync = {}) : sync_(std::move(sync)) {}
  void record(int slot) override {
    if (sync_) sync_();
    const auto now = std::chrono::steady_clock::now();
    if (static_cast<size_t>(slot) >= stamps_.size()) stamps_.resize(static_cast<size_t>(slot) + 1);
    stamps_[static_cast<size_t>(slot)] = now;
  }
  void synchronize() override {}
  double elapsed_ms(int from, int to) override {
    return std::chrono::duration<double, std::milli>(stamps_.at(static_cast<size_t>(to)) -
                                                     stamps_.at(static_cast<size_t>(from)))
        .count();
  }

 private:
  std::function<void()> sync_;
  std::vector<std::chrono::steady_clock::time_point> stamps_;
};

// Totals of one phase name since the last reset().
struct PhaseTotal {
  std::string name;
  double ms = 0;      // exclusive time
  int64_t calls = 0;  // how many times the phase was entered
};

namespace detail {
inline bool g_phase_timer_on = false;  // the one branch a disabled mark costs
}

class PhaseTimer {
 public:
  // The process-wide timer the model and the trainer mark.
  static PhaseTimer& global() {
    static PhaseTimer t;
    return t;
  }
  static bool on() { return detail::g_phase_timer_on; }

  // Starts timing with `clock` (this timer is then its only user). The totals are kept; reset()
  // clears them.
  void enable(std::unique_ptr<PhaseClock> clock) {
    TESSERA_CHECK(clock != nullptr, "PhaseTimer::enable needs a clock");
    TESSERA_CHECK(open_.empty(), "PhaseTimer::enable inside an open phase");
    clock_ = std::move(clock);
    intervals_.clear();
    next_slot_ = 0;
    if (this == &global()) detail::g_phase_timer_on = true;
    enabled_ = true;
  }
  // Collects what is recorded and stops timing; the totals stay readable.
  void disable() {
    if (!enabled_) return;
    collect();
    enabled_ = false;
    if (this == &global()) detail::g_phase_timer_on = false;
    clock_.reset();
  }
  bool enabled() const { return enabled_; }
  // Stops timing and drops what was not collected, without reading the clock (after an error,
  // when the clock's device work may be gone); the totals stay.
  void discard() {
    open_.clear();
    intervals_.clear();
    next_slot_ = 0;
    enabled_ = false;
    if (this == &global()) detail::g_phase_timer_on = false;
    clock_.reset();
  }

  // Opens phase `name` (nested inside the open one, if any).
  void begin(const char* name) {
    if (!enabled_) return;
    const int slot = next_slot_++;
    clock_->record(slot);
    open_.push_back(static_cast<int>(intervals_.size()));
    intervals_.push_back({id_of(name), slot, -1, open_.size() > 1 ? open_[open_.size() - 2] : -1});
  }
  // Closes the innermost open phase.
  void end() {
    if (!enabled_ || open_.empty()) return;
    const int slot = next_slot_++;
    clock_->record(slot);
    intervals_[static_cast<size_t>(open_.back())].end = slot;
    open_.pop_back();
  }
  // Closes the innermost open phase and opens `name` in its place with one timestamp (what ends
  // one phase starts the next: consecutive ops leave no gap between their phases).
  void next(const char* name) {
    if (!enabled_) return;
    if (open_.empty()) return begin(name);
    const int slot = next_slot_++;
    clock_->record(slot);
    intervals_[static_cast<size_t>(open_.back())].end = slot;
    open_.back() = static_cast<int>(intervals_.size());
    intervals_.push_back({id_of(name), slot, -1, open_.size() > 1 ? open_[open_.size() - 2] : -1});
  }

  // Waits for the clock once and adds every finished phase since the last collect() to the
  // totals; the clock's slots are free again. Call it between steps (no phase open): after a
  // train_step, which ends with a backend synchronize, it waits for nothing.
  void collect() {
    if (!enabled_ || intervals_.empty()) return;
    TESSERA_CHECK(open_.empty(), "PhaseTimer::collect with ", open_.size(), " phase(s) open");
    clock_->synchronize();
    std::vector<double> ms(intervals_.size());
    for (size_t i = 0; i < intervals_.size(); ++i)
      ms[i] = clock_->elapsed_ms(intervals_[i].begin, intervals_[i].end);
    std::vector<double> exclusive = ms;
    for (size_t i = 0; i < intervals_.size(); ++i)
      if (intervals_[i].parent >= 0) exclusive[static_cast<size_t>(intervals_[i].parent)] -= ms[i];
    for (size_t i = 0; i < intervals_.size(); ++i) {
      PhaseTotal& t = totals_[static_cast<size_t>(intervals_[i].phase)];
      t.ms += std::max(0.0, exclusive[i]);
      ++t.calls;
    }
    intervals_.clear();
    next_slot_ = 0;
  }

  // The totals, longest first (phases never entered since reset() are left out).
  std::vector<PhaseTotal> totals() const {
    std::vector<PhaseTotal> out;
    for (const PhaseTotal& t : totals_)
      if (t.calls > 0) out.push_back(t);
    std::stable_sort(out.begin(), out.end(),
                     [](const PhaseTotal& a, const PhaseTotal& b) { return a.ms > b.ms; });
    return out;
  }
  double total_ms() const {
    double s = 0;
    for (const PhaseTotal& t : totals_) s += t.ms;
    return s;
  }
  // Zero totals; phases recorded but not yet collected are dropped.
  void reset() {
    TESSERA_CHECK(open_.empty(), "PhaseTimer::reset inside an open phase");
    for (PhaseTotal& t : totals_) t.ms = 0, t.calls = 0;
    intervals_.clear();
    next_slot_ = 0;
  }

 private:
  struct Interval {
    int phase, begin, end, parent;  // parent: index of the enclosing interval, or -1
  };
  // Marks mostly pass string literals: the pointer finds the id without building a string (the
  // name is compared, so a pointer reused for another name is no harm).
  int id_of(const char* name) {
    auto p = by_pointer_.find(name);
    if (p != by_pointer_.end() && totals_[static_cast<size_t>(p->second)].name == name)
      return p->second;
    auto it = ids_.find(name);
    int id = 0;
    if (it != ids_.end()) {
      id = it->second;
    } else {
      id = static_cast<int>(totals_.size());
      ids_.emplace(name, id);
      totals_.push_back({name, 0, 0});
    }
    by_pointer_[name] = id;
    return id;
  }

  bool enabled_ = false;
  std::unique_ptr<PhaseClock> clock_;
  std::map<std::string, int> ids_;
  std::unordered_map<const char*, int> by_pointer_;
  std::vector<PhaseTotal> totals_;  // by phase id
  std::vector<Interval> intervals_;
  std::vector<int> open_;  // indices into intervals_, innermost last
  int next_slot_ = 0;
};

// Closes the innermost phase from a destructor: a clock that fails there (a device in error,
// while an exception unwinds) stops the timer instead of throwing.
inline void end_quietly() noexcept {
  try {
    PhaseTimer::global().end();
  } catch (...) {
    PhaseTimer::global().discard();
  }
}

// One phase for the lifetime of the object, with its NVTX range: TESSERA_PHASE("grad-norm").
class PhaseScope {
 public:
  explicit PhaseScope(const char* name) : nvtx_(name) {
    if (PhaseTimer::on()) {
      PhaseTimer::global().begin(name);
      timed_ = true;
    }
  }
  ~PhaseScope() {
    if (timed_) end_quietly();
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  NvtxRange nvtx_;
  bool timed_ = false;
};

// A run of consecutive phases, one line each, the last one closed with the object:
//   PhaseSequence phase;
//   phase("layernorm-forward");
//   be.layernorm_forward(...);
//   phase("qkv-gemm-forward");
//   be.matmul_forward(...);
// Everything between two marks belongs to the earlier phase.
class PhaseSequence {
 public:
  PhaseSequence() = default;
  ~PhaseSequence() {
    if (open_) nvtx_pop();
    if (timed_) end_quietly();
  }
  PhaseSequence(const PhaseSequence&) = delete;
  PhaseSequence& operator=(const PhaseSequence&) = delete;

  void operator()(const char* name) {
    if (open_) nvtx_pop();
    nvtx_push(name);
    if (PhaseTimer::on()) {
      if (timed_)
        PhaseTimer::global().next(name);
      else
        PhaseTimer::global().begin(name);
      timed_ = true;
    }
    open_ = true;
  }
  // Ends the current phase early (the destructor does it otherwise).
  void close() {
    if (!open_) return;
    nvtx_pop();
    if (timed_) PhaseTimer::global().end();
    open_ = timed_ = false;
  }

 private:
  bool open_ = false, timed_ = false;
};

}  // namespace tessera

#define TESSERA_PHASE_CAT2(a, b) a##b
#define TESSERA_PHASE_CAT(a, b) TESSERA_PHASE_CAT2(a, b)
// TESSERA_PHASE("grad-norm"): a timed phase (and NVTX range) until the end of the scope.
#define TESSERA_PHASE(name) ::tessera::PhaseScope TESSERA_PHASE_CAT(phase_scope_, __LINE__)(name)
