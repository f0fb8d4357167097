// straggler.cpp: --log-straggler (Megatron's straggler detector, docs/training.md, "Stragglers"):
// every log interval, each rank's time per iteration split into compute and waiting (for the
// neighbouring pipeline stages and the data-parallel gradient reduction), gathered on every rank,
// and the --straggler-minmax-count slowest and fastest ranks named with their hosts.
// --straggler-injection RANK:SECONDS (tests and drills) makes one rank sleep that long in every
// iteration, before its forward.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <thread>

#include "comm/gather_strings.hpp"
#include "core/logging.hpp"
#include "train/metrics.hpp"

namespace tessera {

namespace {

class StragglerMetrics : public MetricSource {
 public:
  explicit StragglerMetrics(const MetricContext& c) : c_(c) {
    hosts_ = all_gather_strings(*c_.ctx.world, host_name());  // once, at start-up
  }

  void begin_step() override {
    const auto& inj = c_.cfg.straggler_injection;
    if (inj.first == c_.ctx.world_rank && inj.second > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(inj.second));
  }

  void step(const StepStats& s, FigureSink&) override {
    const double wait = s.pipeline_wait_seconds + s.dp_wait_seconds;
    compute_ += std::max(0.0, s.seconds - wait);
    wait_ += wait;
    if (first_ == 0) first_ = s.iteration;
    last_ = s.iteration;
    ++steps_;
  }

  void report(const LogInterval&, FigureSink&) override {
    Communicator& w = *c_.ctx.world;
    const int n = w.size();
    std::vector<double> v(2 * static_cast<size_t>(n), 0.0);  // ms per iteration
    const double per = steps_ > 0 ? 1e3 / static_cast<double>(steps_) : 0.0;
    v[2 * static_cast<size_t>(w.rank())] = compute_ * per;
    v[2 * static_cast<size_t>(w.rank()) + 1] = wait_ * per;
    w.all_reduce_f64(v.data(), 2 * n, ReduceOp::Sum);
    if (w.rank() == 0) {
      std::vector<int> order(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      auto compute = [&](int r) { return v[2 * static_cast<size_t>(r)]; };
      auto waiting = [&](int r) { return v[2 * static_cast<size_t>(r) + 1]; };
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return compute(a) > compute(b); });
      const int k = std::min(n, std::max(1, c_.cfg.straggler_minmax_count));
      auto who = [&](int r) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "rank %d on %s (compute %.1f ms, waiting %.1f ms)", r,
                      hosts_[static_cast<size_t>(r)].c_str(), compute(r), waiting(r));
        return std::string(buf);
      };
      std::ostringstream slow, fast;
      for (int i = 0; i < k; ++i) {
        slow << (i ? "; " : "") << who(order[static_cast<size_t>(i)]);
        fast << (i ? "; " : "") << who(order[static_cast<size_t>(n - 1 - i)]);
      }
      TLOG(info) << "straggler report, iterations " << first_ << " to " << last_ << " (per "
                 << "iteration; waiting = pipeline receives + data-parallel reduction): slowest "
                 << slow.str() << " | fastest " << fast.str();
    }
    compute_ = wait_ = 0;
    steps_ = 0;
    first_ = 0;
  }

 private:
  MetricContext c_;
  std::vector<std::string> hosts_;
  double compute_ = 0, wait_ = 0;
  int64_t steps_ = 0, first_ = 0, last_ = 0;
};

}  // namespace

std::unique_ptr<MetricSource> make_straggler_metrics(const MetricContext& c) {
  const bool injecting = c.cfg.straggler_injection.second > 0;
  return c.cfg.log_straggler || injecting ? std::make_unique<StragglerMetrics>(c) : nullptr;
}

}  // namespace tessera
