// collective_trace.hpp: where this rank is in its collectives, for the hang watchdog
// (train/watchdog.hpp). Each communicator of the process grid is a traced group (data-parallel,
// pipeline, ...): every collective it issues gets that group's next call number (every member
// issues a group's collectives in the same order, so call N is the same operation everywhere), and
// a blocking wait marks the call it waits for (point-to-point waits name their peer). The
// watchdog's heartbeats carry this record to rank 0; when the job stops progressing, rank 0 names
// the collective that is stuck, the ranks of its group that never reached it and what those are
// doing instead (explain_hang). Recording is a few relaxed atomic stores per collective.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/collective_names.hpp"

namespace tessera {

// The world ranks of `comm`'s ranks, in its rank order.
std::vector<int> world_ranks_of(MPI_Comm comm);

// A communicator's place in the trace: its group and, for point-to-point calls, the world ranks of
// its members.
class TraceHandle {
 public:
  TraceHandle() = default;
  // `members[i]`: the world rank of the group's rank i. A communicator created again for the same
  // group (NCCL after MPI) continues its call numbers.
  TraceHandle(TraceGroup g, std::vector<int> members);
  bool on() const { return group_ != TraceGroup::None; }
  // A collective issued: its call number (0 when not traced). Point-to-point calls are not
  // numbered (the members' sequences of sends and receives differ).
  int64_t issue(TraceOp op) const;
  int world_rank_of(int group_rank) const;
  // The collective log (test hook TESSERA_TEST_COLLECTIVE_LOG, core/test_hooks.hpp): one line
  // "<group key> <op> <elements> <bytes per element>[ <peer world rank>]" for a call of `op` over
  // `elements` (the whole buffer: an all-gather's output, a reduce-scatter's input, the rows an
  // all-to-all sends); `peer` the group rank of a point-to-point partner, -1. Nothing when the
  // hook is off or the group untraced.
  void log(TraceOp op, int64_t elements, size_t element_bytes, int peer = -1) const;
  TraceGroup group() const { return group_; }

 private:
  TraceGroup group_ = TraceGroup::None;
  std::vector<int> members_;
};

// Marks the calling thread waiting in call `seq` of `h`'s group (`peer`: the group rank of a
// point-to-point partner, -1) for the scope's life. Null or untraced `h`: nothing.
class TraceWait {
 public:
  TraceWait(const TraceHandle* h, TraceOp op, int64_t seq, int peer = -1);
  // The same by value (a pending operation keeps these, not its communicator): `world_peer` is
  // the partner's world rank or -1; TraceGroup::None marks nothing.
  TraceWait(TraceGroup g, TraceOp op, int64_t seq, int world_peer);
  ~TraceWait();
  TraceWait(const TraceWait&) = delete;
  TraceWait& operator=(const TraceWait&) = delete;

 private:
  bool on_ = false;
};

// The collective log's "iteration N" line, as training iteration N starts (nothing when off).
void trace_log_iteration(int64_t iteration);

// This rank's record as a fixed number of words (the heartbeat's payload).
// The wait (5 words), each group's leader and calls, then the pipeline step (trace_pipeline_word).
constexpr int kTraceWords = 6 + 2 * static_cast<int>(TraceGroup::Count);
void trace_snapshot(int64_t* words);

// Rank 0's account of a hang from every rank's last record (`records[r]`: kTraceWords words, empty
// when none came), last iteration and whether it still answers: the stuck collectives, the ranks
// that did not arrive and where those are. "" when the records show no collective under way.
std::string explain_hang(const std::vector<std::vector<int64_t>>& records,
                         const std::vector<int64_t>& iterations,
                         const std::vector<bool>& answering);

}  // namespace tessera
