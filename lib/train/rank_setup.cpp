// rank_setup.cpp: a rank's threads and backend (train/rank_setup.hpp).
#include "train/rank_setup.hpp"

#include <cblas.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "comm/mpi/mpi.hpp"
#include "comm/mpi/mpi_check.hpp"
#include "core/error.hpp"
#include "run/memory_estimate.hpp"
#include "runtime/process_grid.hpp"
#include "runtime/select.hpp"

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

namespace {
// Every local rank's string `mine` (at most 63 characters), in local rank order (collective over
// the node).
std::vector<std::string> node_strings(ProcessGrid& grid, const std::string& mine) {
  constexpr int kLen = 64;
  char buf[kLen] = {0};
  std::snprintf(buf, sizeof buf, "%s", mine.c_str());
  std::vector<char> all(static_cast<size_t>(kLen) * grid.local_size());
  MPI_CHECK(MPI_Allgather(buf, kLen, MPI_CHAR, all.data(), kLen, MPI_CHAR, grid.node_comm()));
  std::vector<std::string> out;
  for (int r = 0; r < grid.local_size(); ++r) out.emplace_back(all.data() + size_t(r) * kLen);
  return out;
}
}  // namespace

std::unique_ptr<Backend> make_rank_backend(ProcessGrid& grid, const std::string& device,
                                           bool pipeline_ring, int ranks_per_gpu) {
  // Megatron's setting: one hardware queue, so kernels of the compute and NCCL streams start in
  // the order the host issued them on every rank (no cross-stream reordering between ranks).
  if (device == "cuda") setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", /*overwrite=*/0);
  std::unique_ptr<Backend> be;
  try {
    be = make_backend(device, grid.local_rank(), grid.local_size(), grid.host(), ranks_per_gpu);
    // Every rank of the node learns which GPU each took, and its NCCL host (collective).
    const char* nccl_host = std::getenv("NCCL_HOSTID");
    const std::vector<std::string> ids = node_strings(grid, backend_gpu_id(*be));
    const std::vector<std::string> hosts = node_strings(grid, nccl_host ? nccl_host : "");
    check_distinct_gpus(ids, grid.host(), ranks_per_gpu, hosts);
  } catch (const ConfigError& e) {
    abort_job(e.what(), 2);
  }
  if (pipeline_ring) grid.use_pipeline_ring();
  if (be->device() == Device::CUDA) grid.use_nccl(be->stream());
  return be;
}

void check_rank_memory(ProcessGrid& grid, Backend& be, const MemoryEstimate& e) {
  const MemoryCapacity cap = backend_memory_capacity(be);
  // On the CPU the node's ranks share the host's memory, and on a GPU several ranks may share
  // (--ranks-per-gpu): their estimates together must fit.
  const std::vector<std::string> ids = node_strings(grid, backend_gpu_id(be));
  std::vector<double> each(static_cast<size_t>(grid.local_size()));
  double mine = e.total_bytes();
  MPI_CHECK(MPI_Allgather(&mine, 1, MPI_DOUBLE, each.data(), 1, MPI_DOUBLE, grid.node_comm()));
  int sharing = 0;
  double together = 0;
  for (int r = 0; r < grid.local_size(); ++r)
    if (be.device() == Device::CPU || ids[size_t(r)] == ids[size_t(grid.local_rank())])
      ++sharing, together += each[size_t(r)];
  std::string why = memory_fit_problem(e, grid.coords().pp, cap.bytes, cap.what, sharing, together);
  if (!why.empty() && grid.world_rank() != 0)  // rank 0 prints it: say whose it is
    why = "rank " + std::to_string(grid.world_rank()) + ": " + why;
  why = first_message(*grid.context().world, why);
  if (!why.empty()) throw AgreedConfigError(why);
}

}  // namespace tessera
