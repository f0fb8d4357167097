// nccl_communicator.hpp: Communicator over NCCL for device tensors, built from one of the process
// grid's MPI groups (DESIGN.md invariant 1): group rank 0 calls ncclGetUniqueId, MPI_Bcast sends
// the id over the group's MPI communicator, every member calls ncclCommInitRank. Collectives run
// on the communicator's own stream, ordered against the compute stream with events. Host doubles
// (losses, norms) go over MPI. Only built where CUDA is (TESSERA_HAVE_CUDA); exercised where a GPU
// is.
#pragma once

#include <mpi.h>

#include <memory>

#include "comm/communicator.hpp"
#include "comm/mpi/collective_trace.hpp"

namespace tessera {

// `compute_stream` is the backend's cudaStream_t (void* so CPU-only code can pass one): every
// collective is ordered after the work queued on it and before the work queued after it, while
// running on the communicator's own stream (so the DP reduction overlaps the backward).
// Collective over `group`: every member must call it, in the same order for every group.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm group, void* compute_stream,
                                                     TraceGroup trace = TraceGroup::None);

}  // namespace tessera
