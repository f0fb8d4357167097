// rerun_tracker.cpp: the result-rejected tracker file (train/rerun_tracker.hpp).
#include "train/rerun_tracker.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace tessera {

namespace {
const char* const kStatusNames[] = {
    "RERUN_DISABLED",
    "INITIAL_RUN",
    "FIRST_RERUN_NOT_REPRODUCIBLE",
    "FIRST_RERUN_REPRODUCIBLE",
    "SECOND_RERUN_NOT_REPRODUCIBLE",
    "SECOND_RERUN_REPRODUCIBLE",
    "LOAD_FALLBACK",
};
constexpr int kStatuses = sizeof(kStatusNames) / sizeof(kStatusNames[0]);
static_assert(kStatuses == static_cast<int>(RerunStatus::LoadFallback) + 1,
              "a name for every RerunStatus");

std::string utc_now() {
  char buf[32];
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// A value without spaces: the file is split at spaces (a result never has one; a host name
// neither).
std::string token(std::string s) {
  for (char& c : s)
    if (std::isspace(static_cast<unsigned char>(c))) c = '_';
  return s.empty() ? "-" : s;
}

bool parse_int(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}
}  // namespace

const char* rerun_status_name(RerunStatus s) {
  return kStatusNames[static_cast<int>(s)];
}

bool parse_rerun_status(std::string text, RerunStatus& out) {
  const std::string prefix = "RerunValidationStatus.";
  if (text.rfind(prefix, 0) == 0) text = text.substr(prefix.size());
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (int i = 0; i < kStatuses; ++i)
    if (text == kStatusNames[i]) {
      out = static_cast<RerunStatus>(i);
      return true;
    }
  return false;
}

std::string format_tracker_line(const TrackerLine& l) {
  std::ostringstream o;
  o << "ts=" << (l.time.empty() ? utc_now() : l.time) << " node=" << token(l.host)
    << " device=" << l.device << " jobID=" << token(l.job) << " rank=" << l.rank
    << " iteration=" << l.iteration << " status=" << rerun_status_name(l.status)
    << " result=" << token(l.result);
  if (!l.injected.empty()) o << " injected=" << token(l.injected);
  std::string m = l.message;
  std::replace(m.begin(), m.end(), '\'', '"');
  std::replace(m.begin(), m.end(), '\n', ' ');
  o << " message='" << m << "'";
  return o.str();
}

bool parse_tracker_line(const std::string& text, TrackerLine& out) {
  TrackerLine l;
  const size_t msg = text.find(" message='");
  const std::string fields = msg == std::string::npos ? text : text.substr(0, msg);
  if (msg != std::string::npos) {
    l.message = text.substr(msg + 10);
    if (!l.message.empty() && l.message.back() == '\'') l.message.pop_back();
  }
  std::istringstream in(fields);
  std::string kv;
  int seen = 0;  // rank, iteration and status are required
  while (in >> kv) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) return false;
    const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    int64_t n = 0;
    if (k == "ts") {
      l.time = v;
    } else if (k == "node") {
      l.host = v;
    } else if (k == "device") {
      if (!parse_int(v, n)) n = -1;  // Megatron may write a device it could not name
      l.device = static_cast<int>(n);
    } else if (k == "jobID") {
      l.job = v;
    } else if (k == "rank") {
      if (!parse_int(v, n)) return false;
      l.rank = static_cast<int>(n);
      seen |= 1;
    } else if (k == "iteration") {
      if (!parse_int(v, n)) return false;
      l.iteration = n;
      seen |= 2;
    } else if (k == "status") {
      if (!parse_rerun_status(v, l.status)) return false;
      seen |= 4;
    } else if (k == "result") {
      l.result = v;
    } else if (k == "injected") {
      l.injected = v;
    }
  }
  if (seen != 7) return false;
  out = std::move(l);
  return true;
}

RerunTracker::RerunTracker(std::string path) : path_(std::move(path)) {}

void RerunTracker::check_writable() const {
  if (path_.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path parent = fs::path(path_).parent_path();
  if (!parent.empty()) fs::create_directories(parent, ec);
  const int fd = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0)
    throw ConfigError("--result-rejected-tracker-filename '" + path_ + "' cannot be opened (" +
                      std::strerror(errno) + "); choose a file this job can write");
  ::close(fd);
}

void RerunTracker::append(const TrackerLine& l) const {
  if (path_.empty()) return;
  const std::string line = format_tracker_line(l) + "\n";
  const int fd = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  const ssize_t n = fd < 0 ? -1 : ::write(fd, line.data(), line.size());
  const int err = errno;
  if (fd >= 0) ::close(fd);
  if (n != static_cast<ssize_t>(line.size()))
    throw Error("cannot append to the tracker file '" + path_ + "' (" + std::strerror(err) +
                "); the event was: " + line.substr(0, line.size() - 1));
}

std::string RerunTracker::read_text() const {
  if (path_.empty()) return std::string();
  std::ifstream in(path_);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<TrackerLine> RerunTracker::read(int* unreadable) const {
  return parse_tracker_text(read_text(), unreadable);
}

std::vector<TrackerLine> parse_tracker_text(const std::string& all, int* unreadable) {
  std::vector<TrackerLine> lines;
  if (unreadable) *unreadable = 0;
  std::istringstream in(all);
  std::string text;
  while (std::getline(in, text)) {
    if (text.empty()) continue;
    TrackerLine l;
    if (parse_tracker_line(text, l))
      lines.push_back(std::move(l));
    else if (unreadable)
      ++*unreadable;
  }
  return lines;
}

TrackerSkips skipped_iterations(const std::vector<TrackerLine>& lines) {
  std::map<std::pair<int, int64_t>, int> count;                    // (rank, iteration) -> lines
  std::map<std::pair<std::string, int64_t>, std::set<int>> ranks;  // (job, iteration) -> ranks
  for (const TrackerLine& l : lines) {
    if (l.status != RerunStatus::RerunDisabled && l.status != RerunStatus::FirstRerunReproducible &&
        l.status != RerunStatus::SecondRerunReproducible)
      continue;
    ++count[{l.rank, l.iteration}];
    ranks[{l.job, l.iteration}].insert(l.rank);
  }
  std::set<int64_t> candidates, excluded;
  for (const auto& [key, n] : count)
    if (n >= 2) candidates.insert(key.second);
  for (const auto& [key, r] : ranks)
    if (r.size() > 1) excluded.insert(key.second);
  TrackerSkips s;
  for (int64_t it : candidates) (excluded.count(it) ? s.multi_rank : s.skip).push_back(it);
  return s;
}

}  // namespace tessera
