// rank_setup.hpp: what a rank sets up before its model: its thread count (from its share of the
// node's cores) and its backend on the GPU of its local rank.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "backend/backend.hpp"
#include "core/cpus.hpp"  // affinity_cores

namespace tessera {

// This rank's share of its cores: affinity cores / ranks on the node whose masks overlap it, so
// 8 unbound ranks on 2 cores run one thread each; OMP_NUM_THREADS instead when it is set. node is
// MPI_COMM_TYPE_SHARED of the world (collective over it).
int default_threads(MPI_Comm node);
// Sets the OpenMP and OpenBLAS thread counts.
void set_num_threads(int n);

class ProcessGrid;
// This rank's backend for a resolved --device (resolve_device), on the GPU of its local rank;
// with CUDA, the grid's device-tensor groups switch to NCCL (collective: every rank calls it).
// A rank that cannot take its GPU ends the whole job with the reason (exit code 2).
// `pipeline_ring`: virtual pipeline stages (ProcessGrid::use_pipeline_ring before the NCCL
// communicators are made). `ranks_per_gpu` (--ranks-per-gpu): how many local ranks may share one
// GPU (tests on one GPU; each must then have its own NCCL_HOSTID, scripts/nccl-share-gpu.sh).
std::unique_ptr<Backend> make_rank_backend(ProcessGrid& grid, const std::string& device,
                                           bool pipeline_ring = false, int ranks_per_gpu = 1);

struct MemoryEstimate;
// Collective over the world, before the model is built: when the estimate `e` of this rank's
// memory (run/memory_estimate.hpp) exceeds what the rank has (backend_memory_capacity; on the
// CPU: the estimates of the node's ranks together against the host's memory; on a GPU that
// several ranks share, --ranks-per-gpu, theirs together against its memory), every
// rank throws AgreedConfigError with the first such rank's line, instead of allocating until the
// kernel's OOM killer or the GPU allocator ends the run.
void check_rank_memory(ProcessGrid& grid, Backend& be, const MemoryEstimate& e);

}  // namespace tessera
