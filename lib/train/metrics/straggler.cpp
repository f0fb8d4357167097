// straggler.cpp: --log-straggler (Megatron's straggler detector, docs/training.md, "Stragglers"):
// every log interval, each rank's time per iteration split into compute and waiting (for the
// neighbouring pipeline stages and the data-parallel gradient reduction), gathered on every rank,
// and the --straggler-minmax-count slowest and fastest ranks named with their hosts.
// --straggler-injection RANK:SECONDS (tests and drills) makes one rank sleep that long in every
// iteration, before its forward. As Megatron's detector, it can start off
// (--disable-straggler-on-startup) and be toggled while the run goes on by connecting to
// --straggler-ctrlr-port on world rank 0's host (`curl HOST:PORT`: a request for "/"); rank 0
// decides whether a report is printed, the other ranks' figures travel in the report's
// all-reduce either way. --straggler-injection alone slows the rank without reports.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <sstream>
#include <thread>

#include "comm/gather_strings.hpp"
#include "core/logging.hpp"
#include "train/metrics.hpp"

namespace tessera {

namespace {

// The toggle: a TCP listener on world rank 0; a request for "/" flips the switch and is answered
// with the new state (an HTTP response, so curl and a browser show it).
class StragglerController {
 public:
  StragglerController(int port, std::atomic<bool>& on) : on_(on) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int yes = 1;
    if (fd_ >= 0) ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(fd_, 4) != 0) {
      error_ = std::strerror(errno);
      if (fd_ >= 0) ::close(fd_);
      fd_ = -1;
      return;
    }
    thread_ = std::thread([this] { serve(); });
  }
  ~StragglerController() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) ::close(fd_);
  }
  StragglerController(const StragglerController&) = delete;
  StragglerController& operator=(const StragglerController&) = delete;
  const std::string& error() const { return error_; }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;  // gone again (the listener does not block)
      answer(c);
      ::close(c);
    }
  }
  // A request for "/" (`curl HOST:PORT`) flips the switch and is answered with its new state;
  // any other path (a browser's /favicon.ico) is answered 404 and changes nothing.
  void answer(int c) {
    std::string request;
    char buf[512];
    for (int tries = 0; tries < 5 && request.find("\r\n") == std::string::npos; ++tries) {
      pollfd q{c, POLLIN, 0};
      if (::poll(&q, 1, 100) <= 0) continue;
      const ssize_t got = ::recv(c, buf, sizeof buf, 0);
      if (got <= 0) break;
      request.append(buf, static_cast<size_t>(got));
    }
    const size_t sp = request.find(' ');
    const std::string target =
        sp == std::string::npos ? "" : request.substr(sp + 1, request.find(' ', sp + 1) - sp - 1);
    std::string status = "404 Not Found", body = "ask for / to toggle the straggler report\n";
    if (target == "/") {
      const bool now = !on_.load();
      on_ = now;
      status = "200 OK";
      body = std::string("straggler report ") + (now ? "on" : "off") + "\n";
      TLOG(info) << "straggler report turned " << (now ? "on" : "off")
                 << " (--straggler-ctrlr-port)";
    }
    const std::string reply =
        "HTTP/1.0 " + status +
        "\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\n\r\n" + body;
    if (::send(c, reply.data(), reply.size(), MSG_NOSIGNAL) < 0) {
    }
  }
  std::atomic<bool>& on_;
  std::atomic<bool> stop_{false};
  int fd_ = -1;
  std::string error_;
  std::thread thread_;
};

class StragglerMetrics : public MetricSource {
 public:
  explicit StragglerMetrics(const MetricContext& c) : c_(c) {
    hosts_ = all_gather_strings(*c_.ctx.world, host_name());  // once, at start-up
    on_ = !c_.cfg.straggler_off_at_start;
    const int port = c_.cfg.straggler_ctrlr_port;
    if (c_.cfg.log_straggler && port > 0 && c_.ctx.world->rank() == 0) {
      controller_ = std::make_unique<StragglerController>(port, on_);
      if (!controller_->error().empty())
        TLOG(warning) << "--straggler-ctrlr-port " << port << ": cannot listen ("
                      << controller_->error() << "); the straggler report stays "
                      << (on_ ? "on" : "off");
      else
        TLOG(info) << "straggler report " << (on_ ? "on" : "off") << "; a connection to "
                   << hosts_[0] << ":" << port << " toggles it (--straggler-ctrlr-port)";
    }
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
    if (w.rank() == 0 && c_.cfg.log_straggler && on_) {
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
  std::atomic<bool> on_{true};
  std::unique_ptr<StragglerController> controller_;
  double compute_ = 0, wait_ = 0;
  int64_t steps_ = 0, first_ = 0, last_ = 0;
};

}  // namespace

std::unique_ptr<MetricSource> make_straggler_metrics(const MetricContext& c) {
  const bool injecting = c.cfg.straggler_injection.second > 0;
  return c.cfg.log_straggler || injecting ? std::make_unique<StragglerMetrics>(c) : nullptr;
}

}  // namespace tessera
