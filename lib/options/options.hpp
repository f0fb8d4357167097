// options.hpp: the command-line / config-file options of tessera-train, with Megatron's names.
// The options come in groups, each in its own file of options/ (option_group.hpp); this
// header is what callers include: it also brings the data opening (run_data.hpp), the memory
// estimate (memory_estimate.hpp) and the context-parallel ring's traffic (context_parallel.hpp)
// that the --dry-run report prints. No MPI, CUDA or NCCL: tessera-inspect parses the same
// options (lib/CMakeLists.txt, tessera_host); a rank's set-up is train/rank_setup.hpp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "model/recompute.hpp"
#include "run/context_parallel.hpp"
#include "run/memory_estimate.hpp"
#include "run/run_data.hpp"
#include "run/run_options.hpp"

namespace tessera {

// Why `dir` holds no checkpoint yet ("" when it holds one, or something that must be looked at:
// a damaged checkpoint stays an error). Absent, empty, or only other files and the leftovers of a
// save that never finished (iter_N.tmp) count as none.
std::string no_checkpoint_in(const std::string& dir);

// "0,8,16" -> {0, 8, 16}; "all" -> {} (every rank). ConfigError naming `option` otherwise.
std::vector<int> parse_rank_list(const std::string& text, const std::string& option);
// The training shape's attention call on one rank (options/kernels.cpp), for the start-up
// line that says which kernels run it (Backend::attention_plan).
AttentionCall attention_call(const RunOptions& o);

// The recomputation the Megatron options ask for (--recompute-granularity, --recompute-method,
// --recompute-num-layers, and the older --checkpoint-activations / --checkpoint-num-layers);
// empty strings and 0 mean "not given". ConfigError naming the option for a bad combination.
RecomputeConfig recompute_options(const std::string& granularity, const std::string& method,
                                  int num_layers, bool checkpoint_activations,
                                  int checkpoint_num_layers);

class OptionParser;
// Another program that takes tessera-train's options (tessera-inspect reads a run's config): its
// name and usage line for --help and errors, and a group of options of its own.
struct RunOptionsProgram {
  std::string name = "tessera-train";
  std::string usage = "[--config FILE] [options]";
  std::function<void(OptionParser&)> add_options;
  // Only the data matters (the micro-batch size is not checked against the global batch).
  bool data_only = false;
  // --device auto|cpu|cuda to the device the run takes (runtime/select.hpp's resolve_device for
  // the programs that run a backend; empty: the name is only checked, so the options parse
  // without the CUDA runtime).
  std::function<std::string(const RunOptions&, const std::string& host)> resolve_device;
};

// Parses argv (and --config). Returns false when --help was printed. Throws ConfigError for an
// unknown option, a bad value or a missing config file; validates everything before returning.
bool parse_run_options(int argc, const char* const* argv, RunOptions& out,
                       const RunOptionsProgram& program = RunOptionsProgram());

// What --dry-run prints: the layout, and per pipeline stage the parameters and estimated memory
// of one rank of that stage. Checks the layout first (the dry run's validate_layout).
std::string dry_run_report(const RunOptions& opts, int world_size);

}  // namespace tessera
