// collective_trace.cpp: the collective record and rank 0's account of a hang
// (comm/mpi/collective_trace.hpp).
#include "comm/mpi/collective_trace.hpp"

#include "comm/mpi/mpi_check.hpp"
#include "core/error.hpp"
#include "core/test_hooks.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>

namespace tessera {

namespace {

constexpr int kGroups = static_cast<int>(TraceGroup::Count);
// The wait in progress: waiting (0/1), op, group, call number, peer (world rank or -1).
std::atomic<int64_t> g_wait[5] = {};
// Per group: the world rank of its rank 0 (-1: not a member) and the calls issued.
std::atomic<int64_t> g_leader[kGroups];
std::atomic<int64_t> g_calls[kGroups];
const bool g_init = [] {
  for (int g = 0; g < kGroups; ++g) {
    g_leader[g] = -1;
    g_calls[g] = 0;
  }
  return true;
}();

bool point_to_point(int64_t op) {
  return op == static_cast<int64_t>(TraceOp::Send) || op == static_cast<int64_t>(TraceOp::Recv) ||
         op == static_cast<int64_t>(TraceOp::SendRecv);
}

// The collective log's file, opened at its first line (the world rank is known by then).
std::mutex g_log_mutex;
std::FILE* log_file() {
  static std::FILE* f = [] {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const std::string path =
        std::string(test_hooks::collective_log_prefix()) + ".rank" + std::to_string(rank);
    std::FILE* file = std::fopen(path.c_str(), "w");
    TESSERA_CHECK(file != nullptr, "TESSERA_TEST_COLLECTIVE_LOG: cannot write ", path);
    return file;
  }();
  return f;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

}  // namespace

std::vector<int> world_ranks_of(MPI_Comm comm) {
  int size = 0;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_CHECK(MPI_Comm_group(comm, &group));
  MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world));
  std::vector<int> mine(static_cast<size_t>(size)), out(mine.size());
  for (int i = 0; i < size; ++i) mine[static_cast<size_t>(i)] = i;
  MPI_CHECK(MPI_Group_translate_ranks(group, size, mine.data(), world, out.data()));
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return out;
}

TraceHandle::TraceHandle(TraceGroup g, std::vector<int> members)
    : group_(g), members_(std::move(members)) {
  if (g == TraceGroup::None || members_.empty()) {
    group_ = TraceGroup::None;
    return;
  }
  g_leader[static_cast<int>(g)] = members_[0];
}

int64_t TraceHandle::issue(TraceOp op) const {
  if (!on() || point_to_point(static_cast<int64_t>(op))) return 0;
  return ++g_calls[static_cast<int>(group_)];
}

void TraceHandle::log(TraceOp op, int64_t elements, size_t element_bytes, int peer) const {
  if (!on() || !test_hooks::collective_log_prefix()) return;
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  std::FILE* f = log_file();
  std::fprintf(f, "%s %s %lld %zu", trace_group_key(group_), trace_op_name(op),
               static_cast<long long>(elements), element_bytes);
  if (peer >= 0) std::fprintf(f, " %d", world_rank_of(peer));
  std::fputc('\n', f);
  std::fflush(f);
}

void trace_log_iteration(int64_t iteration) {
  if (!test_hooks::collective_log_prefix()) return;
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  std::fprintf(log_file(), "iteration %lld\n", static_cast<long long>(iteration));
  std::fflush(log_file());
}

int TraceHandle::world_rank_of(int group_rank) const {
  return group_rank >= 0 && group_rank < static_cast<int>(members_.size())
             ? members_[static_cast<size_t>(group_rank)]
             : -1;
}

TraceWait::TraceWait(const TraceHandle* h, TraceOp op, int64_t seq, int peer)
    : TraceWait(h ? h->group() : TraceGroup::None, op, seq,
                h && peer >= 0 ? h->world_rank_of(peer) : -1) {}

TraceWait::TraceWait(TraceGroup g, TraceOp op, int64_t seq, int world_peer)
    : on_(g != TraceGroup::None) {
  if (!on_) return;
  g_wait[1].store(static_cast<int64_t>(op), std::memory_order_relaxed);
  g_wait[2].store(static_cast<int64_t>(g), std::memory_order_relaxed);
  g_wait[3].store(seq, std::memory_order_relaxed);
  g_wait[4].store(world_peer, std::memory_order_relaxed);
  g_wait[0].store(1, std::memory_order_release);
}

TraceWait::~TraceWait() {
  if (on_) g_wait[0].store(0, std::memory_order_release);
}

void trace_snapshot(int64_t* w) {
  w[0] = g_wait[0].load(std::memory_order_acquire);
  for (int i = 1; i < 5; ++i) w[i] = g_wait[i].load(std::memory_order_relaxed);
  for (int g = 0; g < kGroups; ++g) {
    w[5 + 2 * g] = g_leader[g].load(std::memory_order_relaxed);
    w[6 + 2 * g] = g_calls[g].load(std::memory_order_relaxed);
  }
  w[kTraceWords - 1] = trace_pipeline_word();
}

std::string explain_hang(const std::vector<std::vector<int64_t>>& rec,
                         const std::vector<int64_t>& iterations,
                         const std::vector<bool>& answering) {
  const int n = static_cast<int>(rec.size());
  auto known = [&](int r) { return r >= 0 && r < n && rec[r].size() >= size_t(kTraceWords); };
  auto leader = [&](int r, int g) { return known(r) ? rec[r][5 + 2 * g] : -1; };
  auto calls = [&](int r, int g) { return rec[r][6 + 2 * g]; };
  auto group_name = [](int64_t g) { return trace_group_name(static_cast<TraceGroup>(g)); };
  auto op_name = [](int64_t op) { return trace_op_name(static_cast<TraceOp>(op)); };
  auto where_collective = [&](int r) -> std::string {
    if (r < 0 || r >= n) return "unknown";
    if (r < static_cast<int>(answering.size()) && !answering[r])
      return "not answering (dead or stopped)";
    if (!known(r)) return "no record";
    const std::vector<int64_t>& w = rec[r];  // the collective it waits in
    if (w[0] == 1 && point_to_point(w[1]))
      return std::string("waiting in ") + op_name(w[1]) + " with rank " + std::to_string(w[4]) +
             " on the " + group_name(w[2]);
    if (w[0] == 1)
      return std::string("waiting in ") + op_name(w[1]) + " #" + std::to_string(w[3]) + " on the " +
             group_name(w[2]);
    return "not in a collective (computing after iteration " +
           std::to_string(r < static_cast<int>(iterations.size()) ? iterations[r] : 0) + ")";
  };
  // Where rank r is: its collective, and the pipeline step it runs (zero-bubble: B or W).
  auto where = [&](int r) -> std::string {
    const std::string s = where_collective(r);
    const bool alive = !(r < static_cast<int>(answering.size()) && !answering[r]);
    const std::string step =
        alive && known(r) ? describe_pipeline_word(rec[r][kTraceWords - 1]) : "";
    return step.empty() ? s : s + ", in " + step;
  };
  auto members_of = [&](int g, int64_t lead) {
    std::vector<int> m;
    for (int q = 0; q < n; ++q)
      if (leader(q, g) == lead) m.push_back(q);
    return m;
  };
  std::vector<std::string> parts;
  std::vector<int> unrecorded;  // ranks whose heartbeat never came: members of any group
  for (int r = 0; r < n; ++r)
    if (!known(r)) unrecorded.push_back(r);
  // Collectives some ranks wait in: (group, leader, call, op) -> the waiting ranks.
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::vector<int>> stuck;
  for (int r = 0; r < n; ++r) {
    const bool silent = r < static_cast<int>(answering.size()) && !answering[r];
    if (silent || !known(r) || rec[r][0] != 1) continue;
    const std::vector<int64_t>& w = rec[r];
    if (point_to_point(w[1])) {
      const std::string step = describe_pipeline_word(w[kTraceWords - 1]);
      parts.push_back("rank " + std::to_string(r) + " waits in " + op_name(w[1]) + " with rank " +
                      std::to_string(w[4]) + " on the " + group_name(w[2]) +
                      (step.empty() ? "" : " in " + step) + " (rank " + std::to_string(w[4]) +
                      ": " + where(static_cast<int>(w[4])) + ")");
      continue;
    }
    if (w[2] < 0 || w[2] >= kGroups) continue;
    stuck[{w[2], leader(r, static_cast<int>(w[2])), w[3], w[1]}].push_back(r);
  }
  for (const auto& [key, waiting] : stuck) {
    const auto [g, lead, seq, op] = key;
    const std::vector<int> members = members_of(static_cast<int>(g), lead);
    std::vector<int> missing;
    for (int q : members)
      if (calls(q, static_cast<int>(g)) < seq) missing.push_back(q);
    std::ostringstream os;
    os << op_name(op) << " #" << seq << " on the " << group_name(g) << " (ranks "
       << rank_list(members) << ") is stuck: rank(s) " << rank_list(waiting) << " wait in it";
    if (missing.empty()) {
      os << (unrecorded.empty() ? ", every member reached it"
                                : ", every member that reported reached it");
    } else {
      os << "; rank(s) " << rank_list(missing) << " did not arrive (";
      for (size_t i = 0; i < missing.size(); ++i)
        os << (i ? "; " : "") << "rank " << missing[i] << ": " << where(missing[i]);
      os << ")";
    }
    parts.push_back(os.str());
  }
  // Collectives the host does not wait in (NCCL's run on the GPU, the host blocks later, maybe in
  // another call): a group whose members issued different numbers of calls; those behind did not
  // reach the newest one. Groups already named above are not repeated.
  std::set<std::pair<int64_t, int64_t>> named;
  for (const auto& entry : stuck)
    named.insert({std::get<0>(entry.first), std::get<1>(entry.first)});
  for (int g = 0; g < kGroups; ++g) {
    std::map<int64_t, std::vector<int>> instances;
    for (int q = 0; q < n; ++q)
      if (leader(q, g) >= 0) instances[leader(q, g)].push_back(q);
    for (const auto& [lead, members] : instances) {
      if (named.count({g, lead})) continue;
      int64_t newest = 0;
      for (int q : members) newest = std::max(newest, calls(q, g));
      std::vector<int> ahead, behind;
      for (int q : members) (calls(q, g) == newest ? ahead : behind).push_back(q);
      if (behind.empty()) continue;
      std::ostringstream os;
      os << "call #" << newest << " on the " << group_name(g) << " (ranks " << rank_list(members)
         << ") was issued by rank(s) " << rank_list(ahead) << "; rank(s) " << rank_list(behind)
         << " did not arrive (";
      for (size_t i = 0; i < behind.size(); ++i)
        os << (i ? "; " : "") << "rank " << behind[i] << ": " << where(behind[i]);
      os << ")";
      parts.push_back(os.str());
    }
  }
  if (!unrecorded.empty())
    parts.push_back("rank(s) " + rank_list(unrecorded) +
                    " sent no record (dead or hung before their first heartbeat)");
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

}  // namespace tessera
