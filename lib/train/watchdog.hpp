// watchdog.hpp: turns hangs into errors. A background thread on every rank sends a heartbeat to
// rank 0 every second (on its own communicator; needs MPI_THREAD_MULTIPLE) and watches the main
// thread's progress. When the main thread has made no progress for --distributed-timeout-minutes
// (it waits in a collective for a rank that died or stopped answering), rank 0 names the ranks
// whose heartbeats stopped and, from the collective record each heartbeat carries
// (comm/mpi/collective_trace.hpp), the collective that is stuck, on which group, the ranks that did
// not arrive and where they are; every rank prints one line, and the process exits non-zero so
// the launcher (mpirun, srun) ends the whole job.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tessera {

// Signals that ask the job to stop cleanly (SIGTERM, SIGUSR1: Slurm's time-limit warning with
// #SBATCH --signal=USR1@120): a flag the training loop checks at every step boundary.
void install_stop_signals();
int stop_signal();  // the signal received, or 0

class Watchdog {
 public:
  // timeout_minutes <= 0: no watchdog. `world` is duplicated for the heartbeats.
  Watchdog(double timeout_minutes, MPI_Comm world);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  // The main thread calls this whenever it gets somewhere (each iteration, each save).
  void progress(int64_t iteration);
  bool active() const { return thread_.joinable(); }

 private:
  void run();
  double timeout_s_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  bool heartbeats_ = false;
  std::atomic<double> last_progress_{0};
  std::atomic<int64_t> iteration_{0};
  std::atomic<bool> stop_{false};
  std::vector<int64_t> beat_;  // the heartbeat in flight: iteration, trace record (must live on)
  MPI_Request beat_req_ = MPI_REQUEST_NULL;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace tessera
