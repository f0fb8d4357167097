// select.hpp: which backend a rank runs on (--device cpu|cuda|auto) and which GPU it takes
// (DESIGN.md invariant 1: the local rank's GPU, from MPI_COMM_TYPE_SHARED).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/phase_timer.hpp"

namespace tessera {

// True when this build contains the CUDA backend (nvcc was found at configure time).
bool cuda_built();
// GPUs visible to this process (0 without CUDA, a driver or a device).
int visible_gpus();

// "cpu" or "cuda" for a --device value: "auto" is cuda when a GPU is visible and this build has
// CUDA, else cpu. ConfigError for another value, or cuda where it cannot run (names the host).
std::string resolve_device(const std::string& device, const std::string& host);

// The GPU of local rank `local_rank` of `local_size` ranks on a node where this rank sees `gpus`
// GPUs: the local rank itself when there are enough; GPU 0 when the rank sees exactly one (Slurm's
// --gpus-per-task / --gpu-bind gives each task its own; check_distinct_gpus then proves it); with
// `ranks_per_gpu` > 1 (--ranks-per-gpu: tests sharing one GPU), local rank r takes GPU r % gpus.
// ConfigError when several GPUs are visible but fewer than the ranks need.
int choose_gpu(int local_rank, int local_size, int gpus, const std::string& host,
               int ranks_per_gpu = 1);
// `ids[r]` is the PCI bus id of the GPU local rank r took: ConfigError naming the ranks when more
// than `ranks_per_gpu` share one, or when two that share one report the same NCCL host
// (`nccl_hosts[r]`: its NCCL_HOSTID, "" unset; NCCL refuses two ranks of one host on one GPU).
void check_distinct_gpus(const std::vector<std::string>& ids, const std::string& host,
                         int ranks_per_gpu = 1, const std::vector<std::string>& nccl_hosts = {});
// The PCI bus id of the current GPU ("" on the CPU backend).
std::string backend_gpu_id(Backend& be);

// The backend for a resolved device; for cuda, selects the GPU (choose_gpu) first.
std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank, int local_size,
                                      const std::string& host, int ranks_per_gpu = 1);

// "NVIDIA H100 80GB HBM3, 79.1 GiB, sm_90" for the current GPU, "cpu" on the CPU backend.
std::string backend_description(Backend& be);

// The memory `be` computes in, in bytes, and what it is: CUDA: this rank's GPU's total memory;
// CPU: the host's physical memory (which the node's ranks share).
struct MemoryCapacity {
  double bytes = 0;
  std::string what;  // "the 139.8 GiB of this rank's GPU", "the host's 23.4 GiB"
};
MemoryCapacity backend_memory_capacity(Backend& be);
// The first visible GPU's memory and name ("NVIDIA H200"), without a backend: what a --dry-run
// checks its layout against when no --cluster is given. bytes 0 when no GPU is visible.
MemoryCapacity visible_gpu_capacity();

// The device's dense peak in TFLOP/s for GEMMs in `dtype` (bf16/f16 on tensor cores, f32 on the
// FP32 units), from a GPU's name ("NVIDIA H100 80GB HBM3", ...); 0 when unknown (CPUs, other
// GPUs): then MFU is printed only with --peak-tflops.
double peak_tflops(const std::string& device_name, DType dtype);
double backend_peak_tflops(Backend& be, DType dtype);

// The clock that times phases of `be`'s work (core/phase_timer.hpp): CUDA events on its stream
// for the CUDA backend, else the host clock after be.synchronize(). `be` must outlive it.
std::unique_ptr<PhaseClock> make_phase_clock(Backend& be);

}  // namespace tessera
