// validation.cpp: result validation and reruns (train/result_validator.hpp; docs/training.md,
// "Result validation, reruns and stragglers"): Megatron's --rerun-mode, the checks, the tracker
// file,
// --iterations-to-skip and error injection; their checks and the --dry-run line.
#include <algorithm>
#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

namespace {

int64_t whole_number(const std::string& text, const std::string& option, const char* what) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw ConfigError(option + " " + text + ": '" + text + "' is not " + what);
  return v;
}

// Tokens of a list option, split at spaces and commas too (one INI value holds the whole list).
std::vector<std::string> list_items(const std::vector<std::string>& tokens) {
  std::vector<std::string> items;
  for (const std::string& t : tokens) {
    std::string cur;
    for (char c : t + " ") {
      if (c == ' ' || c == ',' || c == '\t') {
        if (!cur.empty()) items.push_back(cur);
        cur.clear();
      } else {
        cur.push_back(c);
      }
    }
  }
  return items;
}

class ValidationOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    TrainConfig& t = o.train;
    p.group("Result validation, reruns and stragglers")
        .add_options()(
            "rerun-mode", po::value(&t.rerun_mode)->default_value("validate_results"),
            "validate_results (a rejected result reruns the iteration in place; exit 16 / 17 "
            "as Megatron) | report_stats (every iteration run twice, the spread logged) | "
            "disabled (a non-finite result stops the run)")(
            "no-check-for-nan-in-loss-and-grad", po::bool_switch(&no_nan_check_),
            "do not check each rank's loss and gradient buckets for NaN/Inf before their "
            "reductions (the optimizer still refuses a non-finite update)")(
            "check-for-spiky-loss", po::bool_switch(&t.check_spiky_loss),
            "reject (and rerun, not fatal) a loss more than 10x the largest of the last 100")(
            "check-for-large-grads", po::bool_switch(&t.check_large_grads),
            "reject (and rerun, not fatal) a gradient norm more than 10x the largest of the last "
            "100")("result-rejected-tracker-filename", po::value(&t.rejected_tracker_file),
                   "append every rejected result and rerun outcome here (default with --save: "
                   "SAVE/result_rejected_tracker.txt); an iteration reproduced twice on a rank "
                   "is skipped by the next launch")(
            "iterations-to-skip", po::value(&skip_)->multitoken(),
            "iterations (1-indexed) whose samples are consumed without an update")(
            "error-injection-rate", po::value(&t.error_injection_rate)->default_value(0),
            "inject an error into about one in N iterations of each rank (random, from --seed; "
            "0: never)")("error-injection-type",
                         po::value(&t.error_injection_type)->default_value("transient_error"),
                         "the injected error: transient_error (exit 17 after the rerun in place) "
                         "| persistent_error (exit 16, then 17 naming the first host) | "
                         "correct_result (exit 16, then 17: a real result)")(
            "error-injection-at", po::value(&at_)->multitoken(),
            "inject the error at ITERATION[:RANK] (rank 0 when not given), once in the run's "
            "lineage (drills and tests)")(
            "log-straggler", po::bool_switch(&t.log_straggler),
            "every log interval, each rank's compute and waiting time per iteration; the slowest "
            "and fastest ranks named with their hosts")(
            "straggler-minmax-count", po::value(&t.straggler_minmax_count)->default_value(1),
            "with --log-straggler: how many slowest and fastest ranks to name")(
            "disable-straggler-on-startup", po::bool_switch(&t.straggler_off_at_start),
            "with --log-straggler: start with the report off; a connection to "
            "--straggler-ctrlr-port on rank 0's host turns it on (and off again)")(
            "straggler-ctrlr-port", po::value(&t.straggler_ctrlr_port)->default_value(65535),
            "with --log-straggler: the TCP port on rank 0's host that toggles the report "
            "(`curl HOST:PORT`); 0: none")(
            "straggler-injection", po::value(&straggler_injection_),
            "RANK:SECONDS: that rank sleeps SECONDS in every iteration (tests and drills of "
            "--log-straggler)");
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes&) override {
    TrainConfig& t = o.train;
    const std::string& m = t.rerun_mode;
    if (m != "validate_results" && m != "report_stats" && m != "disabled")
      throw ConfigError("--rerun-mode " + m +
                        " is not a choice (allowed: validate_results, report_stats, disabled)");
    t.check_nan = !no_nan_check_;
    const std::string& type = t.error_injection_type;
    if (type != "transient_error" && type != "persistent_error" && type != "correct_result")
      throw ConfigError("--error-injection-type " + type +
                        " is not a choice (allowed: transient_error, persistent_error, "
                        "correct_result)");
    if (t.error_injection_rate < 0)
      throw ConfigError("--error-injection-rate " + std::to_string(t.error_injection_rate) +
                        ": must be >= 0 (0: no injection)");
    for (const std::string& s : list_items(skip_)) {
      const int64_t it = whole_number(s, "--iterations-to-skip", "an iteration number");
      if (it < 1) throw ConfigError("--iterations-to-skip " + s + ": iterations count from 1");
      t.iterations_to_skip.push_back(it);
    }
    for (const std::string& s : list_items(at_)) {
      const size_t colon = s.find(':');
      const int64_t it =
          whole_number(s.substr(0, colon), "--error-injection-at", "ITERATION[:RANK]");
      const int64_t rank =
          colon == std::string::npos
              ? 0
              : whole_number(s.substr(colon + 1), "--error-injection-at", "ITERATION[:RANK]");
      if (it < 1 || rank < 0)
        throw ConfigError("--error-injection-at " + s +
                          ": give ITERATION[:RANK], an iteration from 1 and a rank from 0");
      t.error_injection_at.push_back({it, static_cast<int>(rank)});
    }
    const bool injecting = t.error_injection_rate > 0 || !t.error_injection_at.empty();
    if (injecting && m != "validate_results")
      throw ConfigError(
          "error injection (--error-injection-rate / --error-injection-at) needs "
          "--rerun-mode validate_results (it is given " +
          m + ")");
    if (p.given("error-injection-type") && !injecting)
      throw ConfigError(
          "--error-injection-type without --error-injection-rate or "
          "--error-injection-at: give one of them, or leave it out");
    if (m != "validate_results" && (t.check_spiky_loss || t.check_large_grads))
      throw ConfigError(
          "--check-for-spiky-loss / --check-for-large-grads need --rerun-mode "
          "validate_results (a rejected result is rerun there)");
    if (t.straggler_minmax_count < 1)
      throw ConfigError("--straggler-minmax-count " + std::to_string(t.straggler_minmax_count) +
                        ": must be >= 1");
    if (t.straggler_ctrlr_port < 0 || t.straggler_ctrlr_port > 65535)
      throw ConfigError("--straggler-ctrlr-port " + std::to_string(t.straggler_ctrlr_port) +
                        ": give a TCP port (1-65535), or 0 for none");
    if (t.straggler_off_at_start && !t.log_straggler)
      throw ConfigError(
          "--disable-straggler-on-startup needs --log-straggler (it starts the report off)");
    if (!straggler_injection_.empty()) {
      const size_t colon = straggler_injection_.find(':');
      char* end = nullptr;
      const double secs = colon == std::string::npos
                              ? -1
                              : std::strtod(straggler_injection_.c_str() + colon + 1, &end);
      const int64_t rank = colon == std::string::npos
                               ? -1
                               : whole_number(straggler_injection_.substr(0, colon),
                                              "--straggler-injection", "RANK:SECONDS");
      if (colon == std::string::npos || rank < 0 || !end || *end != '\0' || !(secs > 0) ||
          secs > 3600)
        throw ConfigError("--straggler-injection " + straggler_injection_ +
                          ": give RANK:SECONDS, e.g. 1:0.05 (a rank from 0, seconds in (0, 3600])");
      t.straggler_injection = {static_cast<int>(rank), secs};
    }
    if (t.rejected_tracker_file.empty() && !t.save.empty())
      t.rejected_tracker_file = t.save + "/result_rejected_tracker.txt";
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    if (s != DryRunSection::Setup) return;
    const TrainConfig& t = d.o.train;
    out << "result validation: --rerun-mode " << t.rerun_mode;
    if (t.rerun_mode != "disabled")
      out << (t.check_nan ? ", NaN/Inf checks" : ", no NaN/Inf checks")
          << (t.check_spiky_loss ? ", spiky loss" : "")
          << (t.check_large_grads ? ", large grads" : "");
    out << "; tracker file "
        << (t.rejected_tracker_file.empty() ? std::string("none") : t.rejected_tracker_file);
    if (!t.iterations_to_skip.empty())
      out << "; " << t.iterations_to_skip.size() << " iteration(s) to skip";
    out << "\n";
  }

 private:
  bool no_nan_check_ = false;
  std::vector<std::string> skip_, at_;
  std::string straggler_injection_;
};

}  // namespace

std::unique_ptr<OptionGroup> make_validation_options() {
  return std::make_unique<ValidationOptions>();
}

}  // namespace tessera
