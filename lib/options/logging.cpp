// logging.cpp: the logging and system options (log lines, metrics, TensorBoard, timers, the
// profiler window, threads, device, the watchdog) and their checks.
#include <unistd.h>

#include <sstream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

std::vector<int> parse_rank_list(const std::string& text, const std::string& option) {
  std::vector<int> ranks;
  if (text == "all") return ranks;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int r = -1;
    try {
      r = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || r < 0)
      throw ConfigError(option + "=" + text +
                        " is not a list of ranks (allowed: 'all' or e.g. 0,8,16)");
    ranks.push_back(r);
  }
  if (ranks.empty()) throw ConfigError(option + " is empty (allowed: 'all' or e.g. 0,8,16)");
  return ranks;
}

namespace {

class LoggingOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    TrainConfig& t = o.train;
    p.group("Logging and system")
        .add_options()("log-interval", po::value(&t.log_interval)->default_value(10),
                       "iterations between log lines")(
            "log-level", po::value(&log_level_)->default_value("info"),
            "debug | info | warning | error")("log-file", po::value(&o.log.file),
                                              "also append this rank's log to this file")(
            "log-all-ranks", po::bool_switch(&o.log.all_ranks),
            "every rank prints, prefixed with its rank")(
            "metrics-file", po::value(&t.metrics_file),
            "append one JSON line per logged iteration to this file")(
            "peak-tflops", po::value(&t.peak_tflops)->default_value(0.0),
            "peak TFLOP/s per rank, to print MFU")(
            "timing-log-level", po::value(&t.timing_log_level)->default_value(0),
            "timers printed after the iteration line: 0 (only save-checkpoint, at each save), 1 "
            "(forward-backward, gradient reduction, parameter gather, optimizer), 2 (also the "
            "forward and backward compute, pipeline sends and receives, batch generator); timed "
            "phases synchronize the device")(
            "timing-log-option", po::value(&t.timing_log_option)->default_value("minmax"),
            "minmax (min and max over ranks) | max | all (every rank)")(
            "log-params-norm", po::bool_switch(&t.log_params_norm),
            "print the L2 norm of the parameters in the iteration line")(
            "log-num-zeros-in-grad", po::bool_switch(&t.log_num_zeros_in_grad),
            "print the number of zeros in the gradient in the iteration line")(
            "tensorboard-dir", po::value(&t.tensorboard_dir),
            "write TensorBoard event files here (the last rank writes them)")(
            "tensorboard-log-interval", po::value(&t.tensorboard_log_interval)->default_value(1),
            "iterations between TensorBoard scalars")(
            "log-timers-to-tensorboard", po::bool_switch(&t.log_timers_to_tensorboard),
            "also write the --timing-log-level timers (ms per iteration, max over ranks)")(
            "log-validation-ppl-to-tensorboard",
            po::bool_switch(&t.log_validation_ppl_to_tensorboard),
            "also write the validation perplexity")(
            "memory-report-interval", po::value(&t.memory_report_interval)->default_value(0),
            "print every rank's memory (allocated, max allocated, reserved) against the --dry-run "
            "estimate after the first iteration and every N iterations (0: after the first only)")(
            "distributed-timeout-minutes",
            po::value(&t.distributed_timeout_minutes)->default_value(10.0),
            "no progress for this long (a rank died or hangs) ends the job with an error naming "
            "the "
            "rank (0: wait forever)")("threads", po::value(&o.threads)->default_value(0),
                                      "OpenMP/BLAS threads per rank (0: OMP_NUM_THREADS when it is "
                                      "set, else this rank's share of the cores in its affinity "
                                      "mask)")(
            "device", po::value(&o.device)->default_value("auto"),
            "cpu | cuda | auto (cuda when a GPU is visible and the build has CUDA); each rank "
            "takes the GPU of its local rank")(
            "ranks-per-gpu", po::value(&o.ranks_per_gpu)->default_value(1),
            "local ranks that may share one GPU (default 1: each rank its own, as a cluster "
            "needs); more for tests on one GPU, whose ranks then need their own NCCL_HOSTID "
            "(start them through scripts/nccl-share-gpu.sh)")(
            "profile", po::bool_switch(&t.profile),
            "bracket iterations with cudaProfilerStart/Stop for "
            "nsys --capture-range=cudaProfilerApi "
            "(docs/profiling.md)")("profile-step-start",
                                   po::value(&t.profile_step_start)->default_value(10),
                                   "with --profile: start capturing before iteration N+1")(
            "profile-step-end", po::value(&t.profile_step_end)->default_value(12),
            "with --profile: stop capturing after iteration N")(
            "profile-ranks", po::value(&profile_ranks_)->default_value("0"),
            "with --profile: comma-separated global ranks that capture, or 'all'");
  }

  void resolve(const OptionParser&, RunOptions& o, StartupNotes&) override {
    o.log.level = log_level_from_name(log_level_);
    o.train.profile_ranks = parse_rank_list(profile_ranks_, "--profile-ranks");
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    if (o.device != "cpu" && o.device != "cuda" && o.device != "auto")
      throw ConfigError("--device=" + o.device + " is not a device (allowed: cpu, cuda, auto)");
    if (o.resolve_device) o.device = o.resolve_device(o, host);
    if (o.ranks_per_gpu < 1)
      throw ConfigError(
          detail::concat("--ranks-per-gpu=", o.ranks_per_gpu, " is out of range (allowed: >= 1)"));
    if (o.threads < 0)
      throw ConfigError(
          detail::concat("--threads=", o.threads, " is out of range (allowed: >= 0)"));
  }

 private:
  std::string log_level_ = "info";
  std::string profile_ranks_;
};

}  // namespace

std::unique_ptr<OptionGroup> make_logging_options() {
  return std::make_unique<LoggingOptions>();
}

}  // namespace tessera
