// rank_setup.cpp: a rank's threads and backend (train/rank_setup.hpp).
#include "train/rank_setup.hpp"

#include <cblas.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/select.hpp"
#include "comm/mpi.hpp"
#include "comm/mpi_check.hpp"
#include "comm/process_grid.hpp"
#include "core/error.hpp"
#include "train/memory_estimate.hpp"

namespace tessera {

int default_threads(MPI_Comm node) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) return 1;
  int n = 1;
  MPI_Comm_size(node, &n);
  std::vector<cpu_set_t> all(n);
  MPI_Allgather(&mine, sizeof(cpu_set_t), MPI_BYTE, all.data(), sizeof(cpu_set_t), MPI_BYTE, node);
  int sharing = 0;
  for (cpu_set_t& other : all) {
    cpu_set_t both;
    CPU_AND(&both, &mine, &other);
    sharing += CPU_COUNT(&both) > 0;
  }
  // OMP_NUM_THREADS, as OpenMP reads it, when it is one positive number (a list is OpenMP's
  // nesting: its first level).
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && (*end == '\0' || *end == ',') && v > 0 && v <= 4096)
      return static_cast<int>(v);
  }
  return std::max(1, CPU_COUNT(&mine) / std::max(1, sharing));
}

void set_num_threads(int n) {
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

std::unique_ptr<Backend> make_rank_backend(ProcessGrid& grid, const std::string& device,
                                           bool pipeline_ring) {
  // Megatron's setting: one hardware queue, so kernels of the compute and NCCL streams start in
  // the order the host issued them on every rank (no cross-stream reordering between ranks).
  if (device == "cuda") setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", /*overwrite=*/0);
  std::unique_ptr<Backend> be;
  try {
    be = make_backend(device, grid.local_rank(), grid.local_size(), grid.host());
    // Every rank of the node learns which GPU each took (collective over the node).
    constexpr int kId = 32;
    char mine[kId] = {0};
    std::snprintf(mine, sizeof mine, "%s", backend_gpu_id(*be).c_str());
    std::vector<char> all(static_cast<size_t>(kId) * grid.local_size());
    MPI_CHECK(MPI_Allgather(mine, kId, MPI_CHAR, all.data(), kId, MPI_CHAR, grid.node_comm()));
    std::vector<std::string> ids;
    for (int r = 0; r < grid.local_size(); ++r) ids.emplace_back(all.data() + size_t(r) * kId);
    check_distinct_gpus(ids, grid.host());
  } catch (const ConfigError& e) {
    abort_job(e.what(), 2);
  }
  if (pipeline_ring) grid.use_pipeline_ring();
  if (be->device() == Device::CUDA) grid.use_nccl(be->stream());
  return be;
}

void check_rank_memory(ProcessGrid& grid, Backend& be, const MemoryEstimate& e) {
  const MemoryCapacity cap = backend_memory_capacity(be);
  // On the CPU the node's ranks share the host's memory: their estimates together must fit.
  const int sharing = be.device() == Device::CPU ? grid.local_size() : 1;
  double together = e.total_bytes();
  if (sharing > 1)
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &together, 1, MPI_DOUBLE, MPI_SUM, grid.node_comm()));
  std::string why = memory_fit_problem(e, grid.coords().pp, cap.bytes, cap.what, sharing, together);
  if (!why.empty() && grid.world_rank() != 0)  // rank 0 prints it: say whose it is
    why = "rank " + std::to_string(grid.world_rank()) + ": " + why;
  why = first_message(*grid.context().world, why);
  if (!why.empty()) throw AgreedConfigError(why);
}

}  // namespace tessera
