// rerun_tracker.hpp: the result-rejected tracker file of result validation
// (--result-rejected-tracker-filename; docs/training.md, "Result validation and reruns"): one line
// per event, appended by the rank it concerns, in Megatron-LM's format
//   ts=T node=HOST device=D jobID=J rank=R iteration=N status=S result=X [injected=TYPE]
//   message='M'
// and the rules that turn its lines into skipped iterations (Megatron's
// get_skipped_iterations_from_tracker_file) or into a launch that would only repeat a known
// failure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

enum class RerunStatus {
  RerunDisabled,               // --rerun-mode disabled: a rejected result, not rerun
  InitialRun,                  // a result rejected; the iteration reruns in place
  FirstRerunNotReproducible,   // the rerun in place differs: a transient error
  FirstRerunReproducible,      // the rerun in place agrees: rerun on other hardware
  SecondRerunNotReproducible,  // other hardware differs: a persistent error of the first host
  SecondRerunReproducible,     // other hardware agrees: the result is correct
  LoadFallback,                // --load-fallback loaded an older checkpoint (iteration: that one)
};
// "FIRST_RERUN_REPRODUCIBLE", ...; parse_rerun_status also takes Megatron's spellings
// ("RerunValidationStatus.X", lower case). Returns false for anything else.
const char* rerun_status_name(RerunStatus s);
bool parse_rerun_status(std::string text, RerunStatus& out);

struct TrackerLine {
  std::string time, host, job = "N/A";
  int device = -1;  // CUDA device of the rank; -1: the CPU backend
  int rank = 0;
  int64_t iteration = 0;  // 1-indexed, as logged
  RerunStatus status = RerunStatus::InitialRun;
  std::string result;    // the rejected result, as logged ("nan", "12.5")
  std::string injected;  // the error-injection type that caused it; empty: a real result
  std::string message;
};

// The line as written (no newline).
std::string format_tracker_line(const TrackerLine& l);
// One line; false when it is not a tracker line (a partial line, another file).
bool parse_tracker_line(const std::string& text, TrackerLine& out);
// The tracker lines of a file's text; `unreadable` counts the lines that do not parse.
std::vector<TrackerLine> parse_tracker_text(const std::string& text, int* unreadable = nullptr);

// The tracker file: appended to by every rank (one write() call a line, O_APPEND, so lines of
// ranks on different nodes do not interleave on a POSIX file system).
class RerunTracker {
 public:
  explicit RerunTracker(std::string path = "");
  const std::string& path() const { return path_; }
  bool enabled() const { return !path_.empty(); }
  // Checks the file can be appended to (creating it and its directory); ConfigError naming it.
  void check_writable() const;
  // Appends a line; Error naming the file when it cannot.
  void append(const TrackerLine& l) const;
  // The file's lines (none when it does not exist); `unreadable` counts lines that do not parse.
  std::vector<TrackerLine> read(int* unreadable = nullptr) const;
  // The file's text (empty when it does not exist).
  std::string read_text() const;

 private:
  std::string path_;
};

// Megatron's rules: lines RERUN_DISABLED, FIRST_RERUN_REPRODUCIBLE and SECOND_RERUN_REPRODUCIBLE
// count; an iteration whose (rank, iteration) counts at least twice is skipped, unless within one
// job the iteration counted on more than one rank (then it is in `multi_rank`, not `skip`).
struct TrackerSkips {
  std::vector<int64_t> skip, multi_rank;  // sorted, distinct
};
TrackerSkips skipped_iterations(const std::vector<TrackerLine>& lines);

}  // namespace tessera
