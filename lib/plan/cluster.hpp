// cluster.hpp: a cluster kind as data (issue 57): its GPU (memory, HBM bandwidth, dense bf16 and
// FP8 peaks), GPUs per node, and the two fabrics a collective crosses (NVLink inside a node, the
// network between nodes). One INI file per kind in configs/clusters/ (docs/planning.md); the
// --dry-run memory verdict and the step-time predictor read it. No MPI, CUDA or compute: the
// planning tools link it through tessera_tools.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tessera {

// One fabric: what one GPU can send (and, at the same time, receive) over it.
struct FabricSpec {
  std::string name;          // "NVLink 4 (NVSwitch)", "NDR InfiniBand, one 400 Gb/s port per GPU"
  double bandwidth_gbs = 0;  // per GPU, per direction, GB/s (1e9 bytes)
  double latency_us = 0;     // one message's start-up time, microseconds
  bool sharp = false;        // in-switch reduction (NVLink SHARP) for all-reduce
};

struct ClusterSpec {
  std::string name;  // the file's stem: "dgx-h100"
  std::string file;  // the file read
  std::string description;
  std::string gpu;            // "NVIDIA H100 SXM5 80GB"
  double gpu_memory_gib = 0;  // the GPU's memory as the driver reports it (nvidia-smi), GiB
  double hbm_tbs = 0;         // HBM bandwidth, TB/s
  double bf16_tflops = 0;     // dense peak, bf16/f16 tensor cores
  double fp8_tflops = 0;      // dense peak, FP8 tensor cores (0: the GPU has none)
  int gpus_per_node = 0;
  FabricSpec intra_node, inter_node;
  // [gpu] rates: a rates file measured on this GPU (bench_rates), its path as given or relative
  // to the cluster file's folder; "" scales configs/rates/h200.ini (rates_for).
  std::string rates;
};

// What the Tessera runtime holds on a GPU beside the --dry-run estimate: the CUDA context and the
// kernels' module images, cuBLAS/cuBLASLt workspaces, NCCL's channel buffers. A layout fits a GPU
// when the estimate plus this fits its memory (docs/planning.md says where the figure comes from).
constexpr double kRuntimeReserveGiB = 2.0;

// The folder of the shipped cluster files: configs/clusters of the working directory when it has
// one, else the one beside the program: the build tree's copy (bin/../configs/clusters), an
// installed one (bin/../share/tessera/configs/clusters) or the sources' (bin/../../configs), else
// "". The rates files are in its sibling folder rates/.
std::string clusters_folder();

// `name_or_file`: a shipped kind ("dgx-h100") or an INI file's path. ConfigError naming the file
// or the kinds there are for a missing kind, an unknown key, a missing or out-of-range figure.
ClusterSpec load_cluster(const std::string& name_or_file);

// One line: "dgx-h100: 8 x NVIDIA H100 SXM5 80GB (79.6 GiB) per node, ...".
std::string describe_cluster(const ClusterSpec& c);

// Tessera's achieved rates on a GPU (configs/rates/*.ini, docs/planning.md "Rates"): GEMMs by
// width and precision, attention forward and backward, memory-bound passes.
struct GpuRates {
  std::string gpu, file;
  double bf16_peak = 0, fp8_peak = 0, hbm_tbs = 0;             // the GPU's, for scaling to another
  std::vector<std::pair<double, double>> gemm_bf16, gemm_fp8;  // (width, TFLOP/s), by width
  double attention_forward = 0, attention_backward = 0;        // TFLOP/s
  double memory_tbs = 0;  // TB/s of streaming passes (the optimizer's, copies and casts)
  // TB/s of the layers' element-wise kernels (norms, activations, cross-entropy), counted in the
  // fewest bytes they move; [memory] elementwise-tbs, the streaming rate when absent (on a GPU
  // they run at memory speed; on the CPU their arithmetic sets it).
  double elementwise_tbs = 0;
  double grouped_gemm = 0;  // TFLOP/s, MoE experts' grouped GEMMs
  double routing_ns = 0;    // ns per token, one MoE layer's routing (not scaled)
  // The achieved GEMM rate at `width` (the smaller matrix side), TFLOP/s.
  double gemm(double width, bool fp8) const;
};

// The rates of `c`'s GPU: its own measured file when the cluster names one ([gpu] rates), as it
// is; else the measured rates file (configs/rates/h200.ini beside the cluster files) scaled to
// `c`'s GPU: GEMM and attention rates by the ratio of dense peaks (FP8 GEMMs at bf16 rate where
// `c`'s GPU has no FP8), the memory-bound rate by the ratio of HBM bandwidths. A rates file
// without an FP8 GEMM table ([gemm] fp8) runs FP8 GEMMs at its bf16 rate.
GpuRates rates_for(const ClusterSpec& c);
GpuRates load_rates(const std::string& file);

}  // namespace tessera
