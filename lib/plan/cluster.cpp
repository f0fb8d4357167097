// cluster.cpp: cluster files (plan/cluster.hpp; docs/planning.md).
#include "plan/cluster.hpp"

#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.hpp"

namespace tessera {

namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;

bool is_dir(const std::string& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

// The kinds in `folder`, "dgx-a100, dgx-h100, ..." (for the error naming a missing one).
std::string kinds_in(const std::string& folder) {
  std::vector<std::string> kinds;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec))
    if (e.path().extension() == ".ini") kinds.push_back(e.path().stem().string());
  std::sort(kinds.begin(), kinds.end());
  std::string out;
  for (const std::string& k : kinds) out += (out.empty() ? "" : ", ") + k;
  return out.empty() ? "none" : out;
}

void positive(const std::string& file, const char* key, double v) {
  if (!(v > 0))
    throw ConfigError("cluster file '" + file + "': " + key + " = " + std::to_string(v) +
                      " is not a positive figure");
}

}  // namespace

std::string clusters_folder() {
  if (is_dir("configs/clusters")) return "configs/clusters";
  char exe[4096] = {0};
  if (readlink("/proc/self/exe", exe, sizeof exe - 1) > 0) {  // build/bin/<program>
    const std::string e = exe;
    const std::string dir = e.substr(0, e.rfind('/')) + "/../../configs/clusters";
    if (is_dir(dir)) return dir;
  }
  return "";
}

ClusterSpec load_cluster(const std::string& name_or_file) {
  ClusterSpec c;
  const bool path = name_or_file.find('/') != std::string::npos ||
                    (name_or_file.size() > 4 &&
                     name_or_file.compare(name_or_file.size() - 4, 4, ".ini") == 0);
  if (path) {
    c.file = name_or_file;
  } else {
    const std::string folder = clusters_folder();
    if (folder.empty())
      throw ConfigError("--cluster " + name_or_file +
                        ": configs/clusters is not in the working directory nor beside the "
                        "build; give the cluster file's path");
    c.file = folder + "/" + name_or_file + ".ini";
    if (!fs::exists(c.file))
      throw ConfigError("--cluster " + name_or_file + ": no such cluster kind in " + folder +
                        " (there: " + kinds_in(folder) + "); give one of them or a file's path");
  }
  std::ifstream in(c.file);
  if (!in) throw ConfigError("cluster file '" + c.file + "' cannot be read");
  const std::string stem = fs::path(c.file).stem().string();
  c.name = stem;
  po::options_description d;
  d.add_options()("description", po::value(&c.description)->required())(
      "gpu.model", po::value(&c.gpu)->required())(
      "gpu.memory-gib", po::value(&c.gpu_memory_gib)->required())(
      "gpu.hbm-tbs", po::value(&c.hbm_tbs)->required())(
      "gpu.bf16-tflops", po::value(&c.bf16_tflops)->required())(
      "gpu.fp8-tflops", po::value(&c.fp8_tflops)->required())(
      "node.gpus", po::value(&c.gpus_per_node)->required())(
      "intra-node.fabric", po::value(&c.intra_node.name)->required())(
      "intra-node.bandwidth-gbs", po::value(&c.intra_node.bandwidth_gbs)->required())(
      "intra-node.latency-us", po::value(&c.intra_node.latency_us)->required())(
      "intra-node.sharp", po::value(&c.intra_node.sharp)->default_value(false))(
      "inter-node.fabric", po::value(&c.inter_node.name)->required())(
      "inter-node.bandwidth-gbs", po::value(&c.inter_node.bandwidth_gbs)->required())(
      "inter-node.latency-us", po::value(&c.inter_node.latency_us)->required());
  try {
    po::variables_map vm;
    po::store(po::parse_config_file(in, d, /*allow_unregistered=*/false), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw ConfigError("cluster file '" + c.file + "': " + e.what() +
                      " (docs/planning.md lists the keys)");
  }
  positive(c.file, "[gpu] memory-gib", c.gpu_memory_gib);
  positive(c.file, "[gpu] hbm-tbs", c.hbm_tbs);
  positive(c.file, "[gpu] bf16-tflops", c.bf16_tflops);
  if (c.fp8_tflops < 0) positive(c.file, "[gpu] fp8-tflops", c.fp8_tflops);
  positive(c.file, "[node] gpus", c.gpus_per_node);
  positive(c.file, "[intra-node] bandwidth-gbs", c.intra_node.bandwidth_gbs);
  positive(c.file, "[inter-node] bandwidth-gbs", c.inter_node.bandwidth_gbs);
  if (c.intra_node.latency_us < 0) positive(c.file, "[intra-node] latency-us", -1);
  if (c.inter_node.latency_us < 0) positive(c.file, "[inter-node] latency-us", -1);
  return c;
}

std::string describe_cluster(const ClusterSpec& c) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s: %d x %s (%.1f GiB, %.0f TFLOP/s bf16%s) per node; %s %.0f GB/s per GPU "
                "inside a node, %s %.0f GB/s per GPU between nodes",
                c.name.c_str(), c.gpus_per_node, c.gpu.c_str(), c.gpu_memory_gib, c.bf16_tflops,
                c.fp8_tflops > 0 ? (", " + std::to_string(int(c.fp8_tflops + 0.5)) + " FP8").c_str()
                                 : "",
                c.intra_node.name.c_str(), c.intra_node.bandwidth_gbs, c.inter_node.name.c_str(),
                c.inter_node.bandwidth_gbs);
  return buf;
}

}  // namespace tessera
