// watchdog.cpp: stop signals, heartbeats and the no-progress timeout.
#include "train/watchdog.hpp"

#include "comm/mpi/collective_trace.hpp"

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>

namespace tessera {

namespace {
volatile std::sig_atomic_t g_signal = 0, g_sigints = 0;
void on_stop_signal(int sig) {
  if (sig == SIGINT && ++g_sigints >= 2) {  // Ctrl-C twice: the user means now
    const char m[] = "second SIGINT: exiting at once (nothing saved since the last checkpoint)\n";
    if (::write(STDERR_FILENO, m, sizeof m - 1) < 0) {
    }
    ::_exit(130);
  }
  g_signal = sig;  // only a flag: the training loop agrees on it, saves and stops
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
constexpr int kTagBeat = 7001;
}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);  // Ctrl-C: as SIGTERM the first time
}

int stop_signal() {
  return g_signal;
}

Watchdog::Watchdog(double timeout_minutes, MPI_Comm world) : timeout_s_(timeout_minutes * 60) {
  if (timeout_s_ <= 0) return;
  int provided = 0;
  MPI_Query_thread(&provided);
  heartbeats_ = provided == MPI_THREAD_MULTIPLE;
  MPI_Comm_rank(world, &rank_);
  MPI_Comm_size(world, &size_);
  if (heartbeats_) MPI_Comm_dup(world, &comm_);
  last_progress_ = now_s();
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // A heartbeat rank 0 never received is cancelled, then dropped with the communicator.
  if (beat_req_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&beat_req_);
    MPI_Request_free(&beat_req_);
  }
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void Watchdog::progress(int64_t iteration) {
  iteration_ = iteration;
  last_progress_ = now_s();
}

void Watchdog::run() {
  constexpr int kWords = 1 + kTraceWords;  // iteration, then the collective record
  std::vector<double> last_beat(size_, now_s());
  std::vector<std::vector<int64_t>> records(static_cast<size_t>(size_));
  std::vector<int64_t> iterations(static_cast<size_t>(size_), 0);
  beat_.assign(kWords, 0);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_.load(); })) {
    const double t = now_s();
    if (heartbeats_) {
      if (rank_ != 0) {
        int done = 1;
        if (beat_req_ != MPI_REQUEST_NULL) MPI_Test(&beat_req_, &done, MPI_STATUS_IGNORE);
        if (done) {
          beat_[0] = iteration_;
          trace_snapshot(beat_.data() + 1);
          MPI_Isend(beat_.data(), kWords, MPI_INT64_T, 0, kTagBeat, comm_, &beat_req_);
        }
      } else {
        last_beat[0] = t;
        int flag = 1;
        while (flag) {
          MPI_Status st;
          MPI_Iprobe(MPI_ANY_SOURCE, kTagBeat, comm_, &flag, &st);
          if (!flag) break;
          std::vector<int64_t> w(kWords);
          MPI_Recv(w.data(), kWords, MPI_INT64_T, st.MPI_SOURCE, kTagBeat, comm_,
                   MPI_STATUS_IGNORE);
          last_beat[st.MPI_SOURCE] = t;
          iterations[st.MPI_SOURCE] = w[0];
          records[st.MPI_SOURCE].assign(w.begin() + 1, w.end());
        }
      }
    }
    const double idle = t - last_progress_.load();
    if (idle < timeout_s_) continue;
    std::string silent, stuck;
    if (rank_ == 0 && heartbeats_) {
      std::vector<bool> answering(static_cast<size_t>(size_), true);
      for (int r = 1; r < size_; ++r)
        if (t - last_beat[r] > 5.0) {
          silent += (silent.empty() ? "" : ", ") + std::to_string(r);
          answering[static_cast<size_t>(r)] = false;
        }
      records[0].resize(kTraceWords);
      trace_snapshot(records[0].data());
      iterations[0] = iteration_;
      stuck = explain_hang(records, iterations, answering);
    }
    if (rank_ == 0) {
      std::string why = silent.empty() ? "every rank still answers, so a collective is stuck"
                                       : "rank(s) " + silent + " stopped answering (dead or hung)";
      if (!stuck.empty()) why += ": " + stuck;
      std::fprintf(stderr,
                   "rank 0 (%s): error: no progress for %.1f minutes after iteration %lld "
                   "(--distributed-timeout-minutes); %s; ending the job\n",
                   host, idle / 60, (long long)iteration_.load(), why.c_str());
    } else {
      std::fprintf(stderr,
                   "rank %d (%s): error: no progress for %.1f minutes after iteration %lld "
                   "(--distributed-timeout-minutes); a peer died or hangs (rank 0 names it)\n",
                   rank_, host, idle / 60, (long long)iteration_.load());
    }
    std::fflush(stderr);
    if (rank_ != 0) std::this_thread::sleep_for(std::chrono::seconds(2));  // let rank 0 speak first
    std::_Exit(3);
  }
}

}  // namespace tessera
