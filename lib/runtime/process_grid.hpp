// process_grid.hpp: the (TP, CP, DP, PP) process grid of DESIGN.md invariant 1, Megatron's default
// order: rank = tp + TP * (cp + CP * (dp + DP * pp)). TP groups are consecutive ranks (keep them in
// one node), context-parallel (CP) groups next. Without context parallelism (CP = 1) this is
// rank = tp + TP * (dp + DP * pp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/grid_layout.hpp"
#include "comm/mpi/mpi.hpp"

namespace tessera {

// This rank's place in the grid and its communicators. Built collectively by every rank, in the
// same order, from MPI_COMM_WORLD.
class ProcessGrid {
 public:
  // Needs MPI initialized; throws ConfigError on a bad layout.
  ProcessGrid(int tp, int pp, int cp = 1);
  const GridLayout& layout() const { return layout_; }
  int world_rank() const { return world_rank_; }
  int world_size() const { return layout_.world; }
  const GridCoords& coords() const { return coords_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  const std::string& host() const { return host_; }

  MPI_Comm node_comm() const { return node_.get(); }

  // Collective. Replaces the communicators that move device tensors (TP, PP, DP, embedding) by
  // NCCL ones ordered against `compute_stream` (the backend's), created eagerly, by every rank in
  // the same order. Groups of one rank need no communicator. Pipeline activations and gradients
  // get one NCCL communicator each, so the two directions never wait on each other.
  void use_nccl(void* compute_stream);
  bool uses_nccl() const { return nccl_; }
  // Collective; before use_nccl. Virtual pipeline stages make the pipeline a ring: the last stage
  // sends activations to the first, the first gradients to the last. Each direction of that
  // wrap-around gets a communicator of its own over (first, last) stage (MPI, or NCCL once
  // use_nccl runs), so that on NCCL, which runs a communicator's operations in order on one
  // stream, no wrap-around transfer waits behind the chain's others (a cycle, with a ring).
  void use_pipeline_ring();
  // Collective; before use_nccl. MoE's expert parallelism: `ep` consecutive data-parallel ranks
  // split the experts (Megatron's order: ep inside dp). ConfigError naming the numbers when ep
  // does not divide DP. With context parallelism an EP group stays inside one CP rank, and expert
  // gradients are summed over expert-DP x CP.
  void use_expert_parallel(int ep);
  // Collective; after use_expert_parallel, before use_nccl. HSDP / the partial distributed
  // optimizer (--num-distributed-optimizer-instances): the gradient group (DP x CP, rank
  // cp + CP * dp) cut into `instances` groups of consecutive ranks (the shard groups), and the
  // ranks at the same place in each (the replica groups); the expert-data-parallel group the
  // same way. ConfigError naming the numbers when `instances` does not divide them.
  void use_optimizer_instances(int instances);

  ParallelContext context();

  // The table printed at start-up: one line per rank with (tp, pp, dp), local rank and host.
  std::string layout_table();

 private:
  GridLayout layout_;
  GridCoords coords_;
  int world_rank_ = 0, local_rank_ = 0, local_size_ = 1;
  std::string host_;
  // dp_: the gradient group (DP x CP); cp_: the context-parallel ring (made when CP > 1).
  MpiComm tp_, pp_, dp_, mp_, emb_, node_, cp_;
  std::unique_ptr<Communicator> world_comm_, tp_comm_, pp_comm_, dp_comm_, mp_comm_, emb_comm_;
  std::unique_ptr<Communicator> cp_comm_;
  std::unique_ptr<Communicator> pp_grad_comm_;  // set by use_nccl; else pp_comm_ carries both
  // use_pipeline_ring, on the first and last stage: activations last -> first, gradients first ->
  // last (MpiComm handles of their own, so MPI matching never mixes them with the embedding's).
  MpiComm wrap_, wrap_grad_;
  std::unique_ptr<Communicator> wrap_comm_, wrap_grad_comm_;
  int ep_ = 1;  // use_expert_parallel
  MpiComm ep_group_, edp_group_;
  std::unique_ptr<Communicator> ep_comm_, edp_comm_;
  int instances_ = 1;  // use_optimizer_instances
  MpiComm shard_, replica_, eshard_, ereplica_;
  std::unique_ptr<Communicator> shard_comm_, replica_comm_, eshard_comm_, ereplica_comm_;
  bool in_embedding_ = false, nccl_ = false, ring_ = false;
};

}  // namespace tessera
