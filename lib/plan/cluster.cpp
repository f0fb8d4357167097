// cluster.cpp: cluster files (plan/cluster.hpp; docs/planning.md).
#include "plan/cluster.hpp"

#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
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
  if (readlink("/proc/self/exe", exe, sizeof exe - 1) > 0) {  // <prefix>/bin/<program>
    const std::string e = exe;
    const std::string bin = e.substr(0, e.rfind('/'));
    // The build tree's copy (bin/../configs), an installed one (share/tessera), the sources
    // (a build folder inside the repository).
    for (const char* up :
         {"/../configs/clusters", "/../share/tessera/configs/clusters", "/../../configs/clusters"})
      if (is_dir(bin + up)) return bin + up;
  }
  return "";
}

ClusterSpec load_cluster(const std::string& name_or_file) {
  ClusterSpec c;
  const bool path =
      name_or_file.find('/') != std::string::npos ||
      (name_or_file.size() > 4 && name_or_file.compare(name_or_file.size() - 4, 4, ".ini") == 0);
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
      "gpu.model", po::value(&c.gpu)->required())("gpu.memory-gib",
                                                  po::value(&c.gpu_memory_gib)->required())(
      "gpu.hbm-tbs", po::value(&c.hbm_tbs)->required())("gpu.bf16-tflops",
                                                        po::value(&c.bf16_tflops)->required())(
      "gpu.fp8-tflops", po::value(&c.fp8_tflops)->required())(
      "gpu.rates", po::value(&c.rates)->default_value(""))("node.gpus",
                                                           po::value(&c.gpus_per_node)->required())(
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
  std::snprintf(
      buf, sizeof buf,
      "%s: %d x %s (%.1f GiB, %.0f TFLOP/s bf16%s) per node; %s %.0f GB/s per GPU "
      "inside a node, %s %.0f GB/s per GPU between nodes",
      c.name.c_str(), c.gpus_per_node, c.gpu.c_str(), c.gpu_memory_gib, c.bf16_tflops,
      c.fp8_tflops > 0 ? (", " + std::to_string(int(c.fp8_tflops + 0.5)) + " FP8").c_str() : "",
      c.intra_node.name.c_str(), c.intra_node.bandwidth_gbs, c.inter_node.name.c_str(),
      c.inter_node.bandwidth_gbs);
  return buf;
}

namespace {

std::vector<std::pair<double, double>> rate_table(const std::string& file, const char* key,
                                                  const std::string& text) {
  std::vector<std::pair<double, double>> t;
  std::istringstream in(text);
  std::string item;
  while (in >> item) {
    const size_t colon = item.find(':');
    char* end = nullptr;
    const double w = colon == std::string::npos ? 0 : std::strtod(item.c_str(), &end);
    const double r = colon == std::string::npos ? 0 : std::strtod(item.c_str() + colon + 1, &end);
    if (!(w > 0 && r > 0))
      throw ConfigError("rates file '" + file + "': " + key + " item '" + item +
                        "' is not WIDTH:TFLOPS (e.g. 2048:800)");
    t.emplace_back(w, r);
  }
  if (t.empty()) throw ConfigError("rates file '" + file + "': " + key + " is empty");
  std::sort(t.begin(), t.end());
  return t;
}

}  // namespace

double GpuRates::gemm(double width, bool fp8) const {
  const auto& t = fp8 && !gemm_fp8.empty() ? gemm_fp8 : gemm_bf16;
  if (width <= t.front().first) return t.front().second;
  if (width >= t.back().first) return t.back().second;
  for (size_t i = 1; i < t.size(); ++i)
    if (width <= t[i].first) {
      const double f = std::log(width / t[i - 1].first) / std::log(t[i].first / t[i - 1].first);
      return t[i - 1].second + f * (t[i].second - t[i - 1].second);
    }
  return t.back().second;
}

GpuRates load_rates(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw ConfigError("rates file '" + file + "' cannot be read");
  GpuRates r;
  r.file = file;
  std::string bf16, fp8;
  po::options_description d;
  d.add_options()("gpu", po::value(&r.gpu)->required())(
      "bf16-tflops", po::value(&r.bf16_peak)->required())("fp8-tflops",
                                                          po::value(&r.fp8_peak)->default_value(0))(
      "hbm-tbs", po::value(&r.hbm_tbs)->required())("gemm.bf16", po::value(&bf16)->required())(
      "gemm.fp8", po::value(&fp8)->default_value(""))("attention.forward-tflops",
                                                      po::value(&r.attention_forward)->required())(
      "attention.backward-tflops", po::value(&r.attention_backward)->required())(
      "memory.tbs", po::value(&r.memory_tbs)->required())(
      "memory.elementwise-tbs", po::value(&r.elementwise_tbs)->default_value(0))(
      "moe.grouped-gemm-tflops", po::value(&r.grouped_gemm)->required())(
      "moe.routing-ns-per-token", po::value(&r.routing_ns)->required());
  try {
    po::variables_map vm;
    po::store(po::parse_config_file(in, d, /*allow_unregistered=*/false), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw ConfigError("rates file '" + file + "': " + e.what() + " (docs/planning.md, \"Rates\")");
  }
  r.gemm_bf16 = rate_table(file, "[gemm] bf16", bf16);
  if (!fp8.empty()) r.gemm_fp8 = rate_table(file, "[gemm] fp8", fp8);
  if (r.elementwise_tbs < 0)
    throw ConfigError("rates file '" + file + "': [memory] elementwise-tbs is negative");
  if (r.elementwise_tbs == 0) r.elementwise_tbs = r.memory_tbs;
  for (double v : {r.bf16_peak, r.hbm_tbs, r.attention_forward, r.attention_backward, r.memory_tbs,
                   r.grouped_gemm, r.routing_ns})
    if (!(v > 0)) throw ConfigError("rates file '" + file + "': a figure is not positive");
  return r;
}

GpuRates rates_for(const ClusterSpec& c) {
  const std::string dir = fs::path(c.file).parent_path().string();
  if (!c.rates.empty()) {  // measured on this cluster's GPU
    const fs::path p(c.rates);
    return load_rates(p.is_absolute() || dir.empty() ? c.rates : (fs::path(dir) / p).string());
  }
  // The reference rates: beside the cluster file's folder (a copy of configs/), else the shipped
  // ones.
  std::string file = (dir.empty() ? std::string(".") : dir) + "/../rates/h200.ini";
  if (!fs::exists(file)) {
    const std::string shipped = clusters_folder();
    if (shipped.empty())
      throw ConfigError("cluster file '" + c.file +
                        "' names no rates file and the shipped rates (configs/rates/h200.ini) are "
                        "neither beside it, in the working directory nor beside the program; give "
                        "[gpu] rates = FILE");
    file = shipped + "/../rates/h200.ini";
  }
  GpuRates r = load_rates(file);
  const double dense = c.bf16_tflops / r.bf16_peak;
  const double fp8 = c.fp8_tflops > 0 && r.fp8_peak > 0 ? c.fp8_tflops / r.fp8_peak : 0;
  for (auto& [w, t] : r.gemm_bf16) t *= dense;
  if (fp8 > 0 && !r.gemm_fp8.empty())
    for (auto& [w, t] : r.gemm_fp8) t *= fp8;
  else
    r.gemm_fp8 = r.gemm_bf16;  // no FP8 tensor cores: FP8 GEMMs run at the bf16 rate
  r.attention_forward *= dense;
  r.attention_backward *= dense;
  r.grouped_gemm *= dense;
  r.memory_tbs *= c.hbm_tbs / r.hbm_tbs;
  r.elementwise_tbs *= c.hbm_tbs / r.hbm_tbs;
  r.gpu = c.gpu + " (scaled from " + r.gpu + ")";
  return r;
}

}  // namespace tessera
