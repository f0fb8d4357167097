// nccl_communicator.hpp: Communicator over NCCL for device tensors, built from one of the process
// grid's MPI groups (DESIGN.md invariant 1): group rank 0 calls ncclGetUniqueId, MPI_Bcast sends
// the id over the group's MPI communicator, every member calls ncclCommInitRank. Collectives are
// enqueued on the communicator's stream; the blocking forms synchronize that stream, the *_async
// forms record an event the PendingOp waits on. Host doubles (losses, norms) go over MPI.
// Only built where CUDA is (TESSERA_HAVE_CUDA); exercised where a GPU is.
#pragma once

#include <mpi.h>

#include <memory>

#include "comm/communicator.hpp"

namespace tessera {

// `stream` is a cudaStream_t (void* here so CPU-only code can hold one); null: a new stream.
// Collective over `group`: every member must call it, in the same order for every group.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm group, void* stream = nullptr);

}  // namespace tessera
