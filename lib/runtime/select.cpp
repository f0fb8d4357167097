// select.cpp: --device resolution and per-rank GPU selection.
#include "runtime/select.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/error.hpp"

#ifdef TESSERA_HAVE_CUDA
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/phase_events.hpp"
#endif

namespace tessera {

using detail::concat;

bool cuda_built() {
#ifdef TESSERA_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int visible_gpus() {
#ifdef TESSERA_HAVE_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

std::string resolve_device(const std::string& device, const std::string& host) {
  if (device == "cpu") return "cpu";
  if (device == "auto") return cuda_built() && visible_gpus() > 0 ? "cuda" : "cpu";
  if (device != "cuda")
    throw ConfigError("--device=" + device + " is not a device (allowed: cpu, cuda, auto)");
  if (!cuda_built())
    throw ConfigError(
        "--device=cuda: this build has no CUDA backend (nvcc was not found when CMake ran); "
        "rebuild with the CUDA toolkit in /usr/local/cuda, or use --device cpu");
  if (visible_gpus() == 0) {
    const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
    throw ConfigError(concat("--device=cuda: no CUDA device is visible on ", host,
                             vis ? concat(" (CUDA_VISIBLE_DEVICES=", vis, ")") : std::string(),
                             "; check the driver (nvidia-smi) and the job's GPU request "
                             "(--gpus-per-node), or use --device cpu"));
  }
  return "cuda";
}

int choose_gpu(int local_rank, int local_size, int gpus, const std::string& host,
               int ranks_per_gpu) {
  if (gpus <= 0) throw ConfigError(concat("--device=cuda: no CUDA device is visible on ", host));
  TESSERA_CHECK(local_rank >= 0 && local_rank < local_size, "local rank ", local_rank,
                " outside the ", local_size, " ranks of the node");
  if (gpus >= local_size) return local_rank;
  if (gpus == 1) return 0;  // one GPU per task (checked across the node by check_distinct_gpus)
  if (ranks_per_gpu > 1 && int64_t(gpus) * ranks_per_gpu >= local_size) return local_rank % gpus;
  throw ConfigError(
      concat(local_size, " ranks share ", host, ", which has ", gpus, " visible GPUs",
             ranks_per_gpu > 1 ? concat(" (--ranks-per-gpu ", ranks_per_gpu, ")") : std::string(),
             "; start at most one rank per GPU (e.g. srun "
             "--ntasks-per-node=",
             gpus, ", or mpirun -np ", gpus, " per node)"));
}

void check_distinct_gpus(const std::vector<std::string>& ids, const std::string& host,
                         int ranks_per_gpu, const std::vector<std::string>& nccl_hosts) {
  for (size_t a = 0; a < ids.size(); ++a) {
    if (ids[a].empty()) continue;  // a CPU rank
    int sharing = 1;
    for (size_t b = a + 1; b < ids.size(); ++b) {
      if (ids[a] != ids[b]) continue;
      if (ranks_per_gpu <= 1)
        throw ConfigError(concat("local ranks ", a, " and ", b, " on ", host,
                                 " would share the GPU at PCI ", ids[a],
                                 "; give each task its own GPU (srun --gpus-per-task=1, or as "
                                 "many ranks per node as GPUs)"));
      if (++sharing > ranks_per_gpu)
        throw ConfigError(concat(sharing, " local ranks on ", host, " (", a, ", ..., ", b,
                                 ") would share the GPU at PCI ", ids[a], "; --ranks-per-gpu ",
                                 ranks_per_gpu, " allows ", ranks_per_gpu));
      if (a < nccl_hosts.size() && b < nccl_hosts.size() && nccl_hosts[a] == nccl_hosts[b])
        throw ConfigError(
            concat("local ranks ", a, " and ", b, " on ", host, " share the GPU at PCI ", ids[a],
                   " with the same NCCL host (NCCL_HOSTID ",
                   nccl_hosts[a].empty() ? std::string("unset") : "'" + nccl_hosts[a] + "'",
                   "): NCCL refuses two ranks of one host on one GPU; start each rank through "
                   "scripts/nccl-share-gpu.sh, which gives it its own NCCL_HOSTID"));
    }
  }
}

std::string backend_gpu_id(Backend& be) {
#ifdef TESSERA_HAVE_CUDA
  if (be.device() == Device::CUDA) return cuda::pci_bus_id(cuda::current_device());
#endif
  (void)be;
  return "";
}

std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank, int local_size,
                                      const std::string& host, int ranks_per_gpu) {
  if (device == "cpu") return make_cpu_backend();
  TESSERA_CHECK(device == "cuda", "make_backend: unresolved device '", device, "'");
#ifdef TESSERA_HAVE_CUDA
  cuda::set_device(choose_gpu(local_rank, local_size, visible_gpus(), host, ranks_per_gpu));
  return make_cuda_backend();
#else
  (void)local_rank;
  (void)local_size;
  (void)ranks_per_gpu;
  throw ConfigError("--device=cuda: this build has no CUDA backend (" + host + ")");
#endif
}

std::string backend_description(Backend& be) {
#ifdef TESSERA_HAVE_CUDA
  if (be.device() == Device::CUDA) return cuda::device_description(cuda::current_device());
#endif
  return be.name();
}

double peak_tflops(const std::string& name, DType dtype) {
  const bool tensor = dtype == DType::BF16 || dtype == DType::F16;
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H100"))  // SXM5 (and NVL, about the same); PCIe
    return has("PCIe") ? (tensor ? 756.0 : 51.0) : (tensor ? 989.4 : 66.9);
  if (has("H200")) return tensor ? 989.4 : 66.9;
  if (has("A100")) return tensor ? 312.0 : 19.5;
  return 0;
}

MemoryCapacity backend_memory_capacity(Backend& be) {
  MemoryCapacity c;
  char buf[160];
#ifdef TESSERA_HAVE_CUDA
  if (be.device() == Device::CUDA) {
    size_t free_b = 0, total_b = 0;
    cuda::memory_info(&free_b, &total_b);
    c.bytes = static_cast<double>(total_b);
    std::snprintf(buf, sizeof buf, "the %.1f GiB of this rank's GPU", c.bytes / 1073741824.0);
    c.what = buf;
    return c;
  }
#endif
  (void)be;
  c.bytes = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  std::snprintf(buf, sizeof buf, "the host's %.1f GiB", c.bytes / 1073741824.0);
  c.what = buf;
  return c;
}

MemoryCapacity visible_gpu_capacity() {
  MemoryCapacity c;
#ifdef TESSERA_HAVE_CUDA
  if (visible_gpus() > 0) {
    size_t total = 0;
    c.what = cuda::device_name(0, &total);
    c.bytes = static_cast<double>(total);
  }
#endif
  return c;
}

double backend_peak_tflops(Backend& be, DType dtype) {
  return be.device() == Device::CUDA ? peak_tflops(backend_description(be), dtype) : 0;
}

std::unique_ptr<PhaseClock> make_phase_clock(Backend& be) {
#ifdef TESSERA_HAVE_CUDA
  if (be.device() == Device::CUDA && be.stream() != nullptr)
    return cuda::make_event_clock(be.stream());
#endif
  return std::make_unique<ChronoPhaseClock>([&be] { be.synchronize(); });
}

}  // namespace tessera
