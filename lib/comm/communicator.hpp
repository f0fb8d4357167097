// communicator.hpp: the one collective interface layers and schedules talk to, so a layer never
// reaches into MPI or NCCL. Implementations: LocalCommunicator (a group of one), MpiCommunicator
// (host tensors, comm/mpi/mpi.hpp) and NcclCommunicator (device tensors,
// comm/nccl/nccl_communicator.hpp), all built on the process grid's MPI groups.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace tessera {

enum class ReduceOp { Sum, Max };

// A collective started by an *_async call; wait() completes it (and is called by the destructor).
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  virtual void wait() = 0;
  // Orders the backend's later work after the operation without blocking the host where the
  // implementation can (NCCL: the compute stream waits for the collective's event); the
  // operation then counts as complete. Host implementations wait().
  virtual void wait_device() { wait(); }
  // Lets the library progress the operation; true when it is complete.
  virtual bool test() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over a whole f32 tensor.
  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  virtual std::unique_ptr<PendingOp> all_reduce_async(Tensor& t, ReduceOp op) = 0;
  // Host doubles (losses, norms, counts), in place.
  virtual void all_reduce_f64(double* data, int64_t n, ReduceOp op) = 0;
  // Host doubles of every rank: `all` (size() * n) = each rank's `mine` (n), in rank order. An
  // all-reduce of this rank's values among zeros (exact); a recording communicator
  // (comm/recording.hpp) gives every rank this one's.
  virtual void all_gather_f64(const double* mine, int64_t n, double* all) {
    std::fill(all, all + int64_t(size()) * n, 0.0);
    std::copy(mine, mine + n, all + int64_t(rank()) * n);
    all_reduce_f64(all, int64_t(size()) * n, ReduceOp::Sum);
  }
  virtual void broadcast(Tensor& t, int root) = 0;
  // out (size * in.numel()) = the inputs of all ranks, in rank order.
  virtual void all_gather(Tensor& out, const Tensor& in) = 0;
  // out (in.numel() / size) = this rank's block of the element-wise sum of all inputs.
  virtual void reduce_scatter(Tensor& out, const Tensor& in) = 0;
  // In place over `buf` (numel divisible by size, cut into size equal blocks): when the op is
  // complete, this rank's block (block `rank`) holds the sum of that block over all ranks; the
  // other blocks hold unspecified values. The distributed optimizer's gradient reduction.
  virtual std::unique_ptr<PendingOp> reduce_scatter_async(Tensor& buf) = 0;
  // In place over `buf` (cut the same way): each rank's block, as it holds it, is copied to every
  // rank. The distributed optimizer's parameter gather (f32, bf16 or f16).
  virtual std::unique_ptr<PendingOp> all_gather_async(Tensor& buf) = 0;
  // Point-to-point. Sends never block (the tensor must stay untouched until the returned op is
  // complete), so neighbouring pipeline stages sending to each other cannot deadlock.
  virtual std::unique_ptr<PendingOp> send_async(const Tensor& t, int peer, int tag) = 0;
  virtual void recv(Tensor& t, int peer, int tag) = 0;
  // Sends `send` to rank `to` while receiving `recv` from rank `from`, as one operation (NCCL:
  // one group, so a ring of ranks each sending to the next cannot deadlock); `send` stays
  // untouched and `recv` unread until the returned op is complete. Context parallelism's ring.
  virtual std::unique_ptr<PendingOp> send_recv_async(const Tensor& send, int to, Tensor& recv,
                                                     int from, int tag) = 0;
  virtual void barrier() = 0;
  // All-to-all of rows of `row_elems` elements (MoE's token dispatch): the first send_rows[0]
  // rows of `send` go to rank 0, the next send_rows[1] to rank 1, ...; what rank p sends here
  // (recv_rows[p] rows) lands in `recv` after what the ranks before p sent. Blocking (the device
  // implementation orders the backend's later work after it).
  virtual void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                          const std::vector<int64_t>& recv_rows, int64_t row_elems) = 0;
};

// Checks all_to_all's arguments for a group of `size` ranks.
inline void check_all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows,
                             const Tensor& recv, const std::vector<int64_t>& recv_rows,
                             int64_t row_elems, int size) {
  TESSERA_CHECK(static_cast<int>(send_rows.size()) == size &&
                    static_cast<int>(recv_rows.size()) == size && row_elems > 0 &&
                    send.dtype() == recv.dtype(),
                "all_to_all: row counts for ", send_rows.size(), " and ", recv_rows.size(),
                " ranks in a group of ", size);
  int64_t out = 0, in = 0;
  for (int p = 0; p < size; ++p) {
    TESSERA_CHECK(send_rows[p] >= 0 && recv_rows[p] >= 0, "all_to_all: negative row count");
    out += send_rows[p];
    in += recv_rows[p];
  }
  TESSERA_CHECK(out * row_elems <= send.numel() && in * row_elems <= recv.numel(),
                "all_to_all: ", out, " rows out and ", in, " rows in of ", row_elems,
                " elements for buffers of ", send.numel(), " and ", recv.numel());
}

// `v` of rank `root` on every rank of `comm`, whatever its length (the other ranks' `v` is
// replaced). Exact: the other ranks contribute zeros to a sum. For small host messages.
inline void broadcast_f64(Communicator& comm, std::vector<double>& v, int root) {
  double n = comm.rank() == root ? static_cast<double>(v.size()) : 0;
  comm.all_reduce_f64(&n, 1, ReduceOp::Sum);
  if (comm.rank() != root) v.assign(static_cast<size_t>(n), 0.0);
  if (n > 0) comm.all_reduce_f64(v.data(), static_cast<int64_t>(v.size()), ReduceOp::Sum);
}

// Collective: the message of the lowest rank of `comm` whose `mine` is not empty, on every rank;
// empty when no rank has one. So a failure one rank found stops all of them with its words.
inline std::string first_message(Communicator& comm, const std::string& mine) {
  double from = -(mine.empty() ? comm.size() : comm.rank());  // the max is the lowest rank
  comm.all_reduce_f64(&from, 1, ReduceOp::Max);
  if (-from >= comm.size()) return std::string();
  const int root = static_cast<int>(-from);
  std::vector<double> text;
  if (comm.rank() == root)
    for (unsigned char c : mine) text.push_back(c);
  broadcast_f64(comm, text, root);
  std::string out;
  for (double c : text) out.push_back(static_cast<char>(static_cast<unsigned char>(c)));
  return out;
}

// Collective: `attempt` runs on rank `who` of `comm` only (set-up one rank does for the job, such
// as creating --save), and every rank learns whether it threw. Returns "" on every rank when it
// did not; otherwise the exception's message on `who` and `elsewhere` on the other ranks, so each
// caller throws the same kind of error on every rank and none is left waiting.
inline std::string one_rank_tries(Communicator& comm, int who, const std::function<void()>& attempt,
                                  const std::string& elsewhere) {
  std::string why;
  double failed = 0;
  if (comm.rank() == who) {
    try {
      attempt();
    } catch (const std::exception& e) {
      failed = 1;
      why = *e.what() ? e.what() : elsewhere;
    }
  }
  comm.all_reduce_f64(&failed, 1, ReduceOp::Max);
  if (!failed) return std::string();
  return comm.rank() == who ? why : elsewhere;
}

// Everything a model and a schedule need to know about the parallel layout of this rank.
struct ParallelContext {
  int tp_size = 1, pp_size = 1, dp_size = 1;
  int tp_rank = 0, pp_rank = 0, dp_rank = 0;
  int world_rank = 0;
  Communicator* world = nullptr;
  Communicator* tp = nullptr;
  Communicator* pp = nullptr;       // pipeline activations (and everything else on the PP group)
  Communicator* pp_grad = nullptr;  // pipeline gradients flowing back; null: pp carries them
  // The gradient group: the ranks whose gradients are summed (and, with the distributed
  // optimizer, that share the optimizer state): the DP ranks, times the CP ranks with context
  // parallelism (dp_size counts only DP: the ranks that read different samples).
  Communicator* dp = nullptr;
  Communicator* model_parallel = nullptr;  // TP x PP of this (dp, cp) replica
  Communicator* embedding = nullptr;       // first and last stage of this (tp, cp, dp)
  // Context parallelism (issue 30, docs/parallelism.md): the CP ranks of the same (tp, dp, pp)
  // split each sequence; cp carries the ring attention's K/V blocks. A group of one without.
  int cp_size = 1, cp_rank = 0;
  Communicator* cp = nullptr;
  // Virtual pipeline stages (ProcessGrid::use_pipeline_ring), on the first and last stage: the
  // wrap-around's activations (last -> first) and gradients (first -> last); the first stage is
  // rank 0 in both. Null without: the pipeline communicators carry them.
  Communicator* pp_wrap = nullptr;
  Communicator* pp_wrap_grad = nullptr;
  // Expert parallelism (MoE; ProcessGrid::use_expert_parallel): the DP group cut into groups of
  // ep_size consecutive DP ranks that split the experts (ep), and the ranks holding the same
  // experts (edp: the DP ranks of the same ep_rank). Without it: ep is a group of one, edp = dp.
  int ep_size = 1, ep_rank = 0;
  Communicator* ep = nullptr;
  Communicator* edp = nullptr;
  // HSDP / the partial distributed optimizer (ProcessGrid::use_optimizer_instances): the
  // gradient group split into dp_instances groups of consecutive ranks. dp_shard: this rank's
  // instance, the group the sharded state is cut over; dp_replica: the ranks of the other
  // instances holding the same shard. edp_shard / edp_replica: the same for the routed experts'
  // group. Without: dp_shard = dp, edp_shard = edp and the replica groups are groups of one.
  int dp_instances = 1;
  Communicator* dp_shard = nullptr;
  Communicator* dp_replica = nullptr;
  Communicator* edp_shard = nullptr;
  Communicator* edp_replica = nullptr;
  Communicator* pp_backward() const { return pp_grad ? pp_grad : pp; }
  Communicator* shard_group() const { return dp_shard ? dp_shard : dp; }
  Communicator* expert_shard_group() const { return edp_shard ? edp_shard : edp; }
  // Null without replicas (one instance).
  Communicator* replica_group() const { return dp_instances > 1 ? dp_replica : nullptr; }
  Communicator* expert_replica_group() const { return dp_instances > 1 ? edp_replica : nullptr; }
  int grad_group_size() const { return dp_size * cp_size; }
  bool first_stage() const { return pp_rank == 0; }
  bool last_stage() const { return pp_rank == pp_size - 1; }
  // One process, no MPI: every group is a LocalCommunicator.
  static ParallelContext single();
};

// A group of one rank: every collective is the identity.
class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(Tensor&, ReduceOp) override {}
  std::unique_ptr<PendingOp> all_reduce_async(Tensor&, ReduceOp) override;
  void all_reduce_f64(double*, int64_t, ReduceOp) override {}
  void broadcast(Tensor&, int) override {}
  void all_gather(Tensor& out, const Tensor& in) override { out.copy_from(in); }
  void reduce_scatter(Tensor& out, const Tensor& in) override { out.copy_from(in); }
  std::unique_ptr<PendingOp> reduce_scatter_async(Tensor&) override;
  std::unique_ptr<PendingOp> all_gather_async(Tensor&) override;
  std::unique_ptr<PendingOp> send_async(const Tensor&, int, int) override;
  void recv(Tensor&, int, int) override;
  // With oneself (a ring of one): a copy.
  std::unique_ptr<PendingOp> send_recv_async(const Tensor& send, int to, Tensor& recv, int from,
                                             int tag) override;
  void barrier() override {}
  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows, int64_t row_elems) override;
};

}  // namespace tessera
