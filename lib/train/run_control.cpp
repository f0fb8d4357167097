// run_control.cpp: the profiler window, stop signals and exits (train/run_control.hpp).
#include "train/run_control.hpp"

#include <algorithm>
#include <csignal>

#include "core/logging.hpp"
#include "core/nvtx.hpp"
#include "train/watchdog.hpp"

namespace tessera {

RunControl::RunControl(const TrainConfig& cfg, const ParallelContext& ctx, Backend& be)
    : cfg_(cfg), ctx_(ctx), be_(be) {
  const std::vector<int>& r = cfg_.profile_ranks;
  profiling_ =
      cfg_.profile && (r.empty() || std::find(r.begin(), r.end(), ctx_.world_rank) != r.end());
}

RunControl::~RunControl() {
  stop_profiler();
}

void RunControl::before_step(int64_t done) {
  if (!profiling_ || profiler_on_ || done < cfg_.profile_step_start ||
      done >= cfg_.profile_step_end)
    return;
  be_.profiler_start();
  nvtx_push("profile");
  profiler_on_ = true;
  TLOG(info) << "profiling iterations " << done + 1 << " to " << cfg_.profile_step_end
             << (be_.device() == Device::CPU
                     ? " (CPU backend: NVTX range 'profile', for nsys --capture-range=nvtx)"
                     : " (cudaProfilerStart; NVTX range 'profile')");
}

void RunControl::after_step(int64_t done) {
  if (!profiler_on_ || done < cfg_.profile_step_end) return;
  stop_profiler();
  TLOG(info) << "profiler stopped after iteration " << done;
}

void RunControl::stop_profiler() {
  if (!profiler_on_) return;
  nvtx_pop();
  be_.profiler_stop();
  profiler_on_ = false;
}

int RunControl::agreed_signal(int64_t iteration) {
  // SIGTERM / SIGUSR1 on any rank: every rank agrees here, saves and stops cleanly.
  double sig = stop_signal();
  ctx_.world->all_reduce_f64(&sig, 1, ReduceOp::Max);
  if (sig <= 0) return 0;
  const int s = static_cast<int>(sig);
  TLOG(info) << "received signal " << s << " ("
             << (s == SIGUSR1  ? "SIGUSR1"
                 : s == SIGINT ? "SIGINT"
                               : "SIGTERM")
             << "): stopping after iteration " << iteration
             << (cfg_.save.empty() ? " (no --save: nothing is saved)" : ", saving a checkpoint");
  return s;
}

bool RunControl::exit_due(int64_t iteration) {
  bool exit_now = cfg_.exit_interval > 0 && iteration % cfg_.exit_interval == 0;
  if (cfg_.exit_duration_mins > 0) {  // rank 0's clock decides, so every rank stops together
    double over =
        ctx_.world_rank == 0 && since_start_.seconds() >= cfg_.exit_duration_mins * 60 ? 1 : 0;
    ctx_.world->all_reduce_f64(&over, 1, ReduceOp::Max);
    exit_now = exit_now || over > 0;
  }
  if (exit_now && iteration < cfg_.train_iters) {
    TLOG(info) << "exiting at iteration " << iteration
               << " (--exit-interval / --exit-duration-in-mins)";
    return true;
  }
  return false;
}

}  // namespace tessera
