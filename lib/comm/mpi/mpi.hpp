// mpi.hpp: MPI start-up and shut-down, an owning MPI_Comm handle, and the MPI implementation of
// Communicator for host tensors.
#pragma once

#include <mpi.h>

#include <string>

#include "comm/communicator.hpp"
#include "comm/mpi/collective_trace.hpp"

namespace tessera {

// Initializes MPI (if the launcher did not) with MPI_ERRORS_RETURN on MPI_COMM_WORLD so every
// failure reaches MPI_CHECK; finalizes in the destructor. Works as a singleton process too.
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
  int world_rank() const { return rank_; }
  int world_size() const { return size_; }

 private:
  bool owns_ = false;
  int rank_ = 0, size_ = 1;
};

// Prints `rank R (host): error: <message>` to stderr and ends the whole job (MPI_Abort), so an
// error on one rank never leaves the others hanging in a collective.
[[noreturn]] void abort_job(const std::string& message, int exit_code = 1);

// Owns an MPI_Comm from MPI_Comm_split / _split_type / _dup and frees it.
class MpiComm {
 public:
  MpiComm() = default;
  explicit MpiComm(MPI_Comm c) : comm_(c) {}
  ~MpiComm();
  MpiComm(MpiComm&& o) noexcept : comm_(o.comm_) { o.comm_ = MPI_COMM_NULL; }
  MpiComm& operator=(MpiComm&& o) noexcept;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  MPI_Comm get() const { return comm_; }
  int rank() const;
  int size() const;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

// Collectives on host f32 tensors over one MPI communicator (not owned). `trace`: the process
// grid's group it is, recorded for the hang watchdog (comm/mpi/collective_trace.hpp).
class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm, TraceGroup trace = TraceGroup::None);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm comm() const { return comm_; }
  void all_reduce(Tensor& t, ReduceOp op) override;
  std::unique_ptr<PendingOp> all_reduce_async(Tensor& t, ReduceOp op) override;
  void all_reduce_f64(double* data, int64_t n, ReduceOp op) override;
  void broadcast(Tensor& t, int root) override;
  void all_gather(Tensor& out, const Tensor& in) override;
  void reduce_scatter(Tensor& out, const Tensor& in) override;
  std::unique_ptr<PendingOp> reduce_scatter_async(Tensor& buf) override;
  std::unique_ptr<PendingOp> all_gather_async(Tensor& buf) override;
  std::unique_ptr<PendingOp> send_async(const Tensor& t, int peer, int tag) override;
  void recv(Tensor& t, int peer, int tag) override;
  std::unique_ptr<PendingOp> send_recv_async(const Tensor& send, int to, Tensor& recv, int from,
                                             int tag) override;
  void barrier() override;
  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows, int64_t row_elems) override;

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  TraceHandle trace_;
};

}  // namespace tessera
