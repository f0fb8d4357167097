// options.hpp: the command-line / config-file options of tessera-train, with Megatron's names.
#pragma once

#include <string>

#include "core/logging.hpp"
#include "model/gpt_config.hpp"
#include "train/train_config.hpp"

namespace tessera {

struct RunOptions {
  GPTConfig model;
  TrainConfig train;
  LogOptions log;
  int threads = 0;            // 0: the cores in this process's affinity mask
  std::string device = "cpu";
  bool mock_data = true;
};

// Parses argv (and --config). Returns false when --help was printed. Throws ConfigError for an
// unknown option, a bad value or a missing config file; validates everything before returning.
bool parse_run_options(int argc, const char* const* argv, RunOptions& out);

// Cores this process may run on (sched_getaffinity), at least 1.
int affinity_cores();
// Sets the OpenMP and OpenBLAS thread counts.
void set_num_threads(int n);

// What --dry-run prints: parameters and estimated memory of this rank.
std::string dry_run_report(const RunOptions& opts);

}  // namespace tessera
