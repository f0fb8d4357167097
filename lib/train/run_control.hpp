// run_control.hpp: when a training run stops or records more than its steps: the profiler window
// (--profile-step-start/end), a stop signal any rank received (SIGTERM, SIGUSR1), and
// --exit-interval / --exit-duration-in-mins. Every decision is agreed by all ranks, so they stop
// at the same iteration.
#pragma once

#include <cstdint>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/timer.hpp"
#include "run/train_config.hpp"

namespace tessera {

class RunControl {
 public:
  RunControl(const TrainConfig& cfg, const ParallelContext& ctx, Backend& be);
  ~RunControl();  // closes a profiler window still open

  // Megatron's --profile-step-start/end: capture iterations start+1 .. end (as logged), on the
  // ranks of --profile-ranks. `done`: iterations done so far.
  void before_step(int64_t done);
  void after_step(int64_t done);
  // Collective: the stop signal received by any rank after `iteration` (0: none), said once.
  int agreed_signal(int64_t iteration);
  // Collective (with --exit-duration-in-mins: rank 0's clock decides): stop after `iteration`?
  bool exit_due(int64_t iteration);
  // Closes the profiler window (a stop inside it).
  void stop_profiler();

 private:
  const TrainConfig& cfg_;
  const ParallelContext& ctx_;
  Backend& be_;
  Timer since_start_;
  bool profiling_ = false;    // this rank captures
  bool profiler_on_ = false;  // inside the window now
};

}  // namespace tessera
