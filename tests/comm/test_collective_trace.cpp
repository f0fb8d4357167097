// test_collective_trace.cpp: the collective record a rank keeps (comm/mpi/collective_trace.hpp) and
// rank 0's account of a hang from every rank's record.
#include <gtest/gtest.h>

#include "comm/mpi/collective_trace.hpp"

using namespace tessera;

namespace {
constexpr int kDp = static_cast<int>(TraceGroup::DataParallel);
constexpr int kPp = static_cast<int>(TraceGroup::Pipeline);

// A record: waiting in `op` call `seq` of group `g` (op None: not waiting), with the given
// leaders and call counts per group.
std::vector<int64_t> record(TraceOp op, int g, int64_t seq, int64_t peer,
                            std::vector<std::pair<int, std::pair<int64_t, int64_t>>> groups) {
  std::vector<int64_t> w(kTraceWords, 0);
  w[0] = op == TraceOp::None ? 0 : 1;
  w[1] = static_cast<int64_t>(op);
  w[2] = g;
  w[3] = seq;
  w[4] = peer;
  for (int i = 0; i < static_cast<int>(TraceGroup::Count); ++i) w[5 + 2 * i] = -1;
  for (const auto& [grp, lc] : groups) {
    w[5 + 2 * grp] = lc.first;
    w[6 + 2 * grp] = lc.second;
  }
  return w;
}
}  // namespace

TEST(CollectiveTrace, RecordsIssueAndWait) {
  const TraceHandle h(TraceGroup::DataParallel, {3, 7});
  int64_t w[kTraceWords];
  trace_snapshot(w);
  const int64_t before = w[6 + 2 * kDp];
  EXPECT_EQ(w[5 + 2 * kDp], 3);  // the group's rank 0 is world rank 3
  const int64_t seq = h.issue(TraceOp::AllReduce);
  EXPECT_EQ(seq, before + 1);
  EXPECT_EQ(h.issue(TraceOp::Send), 0);  // point-to-point calls are not numbered
  {
    const TraceWait wait(&h, TraceOp::AllReduce, seq);
    trace_snapshot(w);
    EXPECT_EQ(w[0], 1);
    EXPECT_EQ(w[1], static_cast<int64_t>(TraceOp::AllReduce));
    EXPECT_EQ(w[2], kDp);
    EXPECT_EQ(w[3], seq);
    EXPECT_EQ(w[4], -1);
  }
  {
    const TraceWait wait(&h, TraceOp::Recv, 0, 1);  // group rank 1 = world rank 7
    trace_snapshot(w);
    EXPECT_EQ(w[4], 7);
  }
  trace_snapshot(w);
  EXPECT_EQ(w[0], 0);
  EXPECT_EQ(w[6 + 2 * kDp], seq);
  const TraceWait none(nullptr, TraceOp::Barrier, 1);  // untraced: nothing marked
  trace_snapshot(w);
  EXPECT_EQ(w[0], 0);
}

TEST(CollectiveTrace, NamesTheStuckCollectiveAndWhoDidNotArrive) {
  // DP groups {0, 2} and {1, 3}: rank 0 waits in all_reduce #5 of its group, rank 2 has issued 4
  // calls and computes; ranks 1 and 3 both wait in #5 of theirs.
  const std::vector<std::vector<int64_t>> rec = {
      record(TraceOp::AllReduce, kDp, 5, -1, {{kDp, {0, 5}}}),
      record(TraceOp::AllReduce, kDp, 5, -1, {{kDp, {1, 5}}}),
      record(TraceOp::None, 0, 0, -1, {{kDp, {0, 4}}}),
      record(TraceOp::AllReduce, kDp, 5, -1, {{kDp, {1, 5}}}),
  };
  EXPECT_EQ(explain_hang(rec, {7, 7, 6, 7}, {true, true, true, true}),
            "all_reduce #5 on the data-parallel group (ranks 0,2) is stuck: rank(s) 0 wait in it; "
            "rank(s) 2 did not arrive (rank 2: not in a collective (computing after iteration "
            "6)); all_reduce #5 on the data-parallel group (ranks 1,3) is stuck: rank(s) 1,3 "
            "wait in it, every member reached it");
  // A rank that never sent a record is named, and "every member" is not claimed for its group.
  std::vector<std::vector<int64_t>> partial = rec;
  partial[2].clear();
  EXPECT_EQ(explain_hang(partial, {7, 7, 6, 7}, {true, true, false, true}),
            "all_reduce #5 on the data-parallel group (ranks 0) is stuck: rank(s) 0 wait in it, "
            "every member that reported reached it; all_reduce #5 on the data-parallel group "
            "(ranks 1,3) is stuck: rank(s) 1,3 wait in it, every member that reported reached it; "
            "rank(s) 2 sent no record (dead or hung before their first heartbeat)");
  // Rank 2 stopped answering: named so.
  EXPECT_NE(explain_hang(rec, {7, 7, 6, 7}, {true, true, false, true})
                .find("rank(s) 2 did not arrive (rank 2: not answering (dead or stopped))"),
            std::string::npos);
}

TEST(CollectiveTrace, PointToPointAndDeviceCollectives) {
  // Rank 0 waits in a receive from rank 1 (pipeline), which computes.
  std::vector<std::vector<int64_t>> rec = {
      record(TraceOp::Recv, kPp, 0, 1, {{kPp, {0, 0}}}),
      record(TraceOp::None, 0, 0, -1, {{kPp, {0, 0}}}),
  };
  EXPECT_EQ(explain_hang(rec, {3, 2}, {true, true}),
            "rank 0 waits in recv with rank 1 on the pipeline group (rank 1: not in a collective "
            "(computing after iteration 2))");
  // No host waits (NCCL): rank 1 is behind rank 0 in the data-parallel group's calls.
  rec = {record(TraceOp::None, 0, 0, -1, {{kDp, {0, 9}}}),
         record(TraceOp::None, 0, 0, -1, {{kDp, {0, 8}}})};
  EXPECT_EQ(explain_hang(rec, {4, 4}, {true, true}),
            "call #9 on the data-parallel group (ranks 0,1) was issued by rank(s) 0; rank(s) 1 "
            "did not arrive (rank 1: not in a collective (computing after iteration 4))");
  // A host wait elsewhere does not hide a device collective some ranks are behind in: rank 0
  // waits in the world's all_reduce #3, rank 1 is behind in the data-parallel group's calls.
  rec = {record(TraceOp::AllReduce, 0, 3, -1, {{0, {0, 3}}, {kDp, {0, 9}}}),
         record(TraceOp::None, 0, 0, -1, {{0, {0, 2}}, {kDp, {0, 8}}})};
  EXPECT_EQ(explain_hang(rec, {4, 4}, {true, true}),
            "all_reduce #3 on the world (ranks 0,1) is stuck: rank(s) 0 wait in it; rank(s) 1 did "
            "not arrive (rank 1: not in a collective (computing after iteration 4)); call #9 on "
            "the data-parallel group (ranks 0,1) was issued by rank(s) 0; rank(s) 1 did not "
            "arrive (rank 1: not in a collective (computing after iteration 4))");
  // Nothing under way: nothing to say.
  rec = {record(TraceOp::None, 0, 0, -1, {{kDp, {0, 9}}}),
         record(TraceOp::None, 0, 0, -1, {{kDp, {0, 9}}})};
  EXPECT_EQ(explain_hang(rec, {4, 4}, {true, true}), "");
}

// The pipeline step each rank runs joins its account: zero-bubble's B and W passes by name.
TEST(CollectiveTrace, NamesThePipelinePassOfTheRanks) {
  auto with_step = [](std::vector<int64_t> w, PipePass pass, int micro, int chunk) {
    trace_pipeline_pass(pass, micro, chunk);
    w[kTraceWords - 1] = trace_pipeline_word();
    return w;
  };
  // Rank 1 waits for rank 2's input gradient in its B pass; rank 2 computes a W pass.
  std::vector<std::vector<int64_t>> rec = {
      record(TraceOp::None, 0, 0, -1, {{kPp, {0, 0}}}),
      with_step(record(TraceOp::Recv, kPp, 0, 2, {{kPp, {0, 0}}}), PipePass::InputGrad, 3, 0),
      with_step(record(TraceOp::None, 0, 0, -1, {{kPp, {0, 0}}}), PipePass::WeightGrad, 1, 1),
  };
  EXPECT_EQ(explain_hang(rec, {5, 5, 5}, {true, true, true}),
            "rank 1 waits in recv with rank 2 on the pipeline group in the B pass (input "
            "gradients) of micro-batch 3 (rank 2: not in a collective (computing after iteration "
            "5), in the W pass (weight gradients) of micro-batch 1, model chunk 1)");
  EXPECT_EQ(describe_pipeline_word(with_step(rec[0], PipePass::Backward, 7, 0)[kTraceWords - 1]),
            "the backward of micro-batch 7");
  EXPECT_EQ(describe_pipeline_word(with_step(rec[0], PipePass::Forward, 0, 2)[kTraceWords - 1]),
            "the forward of micro-batch 0, model chunk 2");
  EXPECT_EQ(describe_pipeline_word(with_step(rec[0], PipePass::None, 0, 0)[kTraceWords - 1]), "");
  trace_pipeline_pass(PipePass::None);
}
