// test_result_validation.cpp: the pieces of result validation that need no run (the tracker
// file's format and Megatron's skip rules, the comparison, the spike detector); the state machine
// runs end to end in test_rerun.sh.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

#include "train/rerun_tracker.hpp"
#include "train/result_validator.hpp"

namespace tessera {
namespace {

TrackerLine line(int rank, int64_t it, RerunStatus s, const std::string& job = "7") {
  TrackerLine l;
  l.time = "2026-11-28T10:00:00Z";
  l.host = "node-a";
  l.device = 3;
  l.job = job;
  l.rank = rank;
  l.iteration = it;
  l.status = s;
  l.result = "nan";
  l.message = "loss is not finite";
  return l;
}

TEST(RerunTracker, LineRoundTripsInMegatronsFormat) {
  TrackerLine l = line(5, 1200, RerunStatus::FirstRerunReproducible);
  l.injected = "persistent_error";
  l.message = "it's 'quoted'\nand two lines";
  const std::string text = format_tracker_line(l);
  EXPECT_EQ(text,
            "ts=2026-11-28T10:00:00Z node=node-a device=3 jobID=7 rank=5 iteration=1200 "
            "status=FIRST_RERUN_REPRODUCIBLE result=nan injected=persistent_error "
            "message='it\"s \"quoted\" and two lines'");
  TrackerLine back;
  ASSERT_TRUE(parse_tracker_line(text, back));
  EXPECT_EQ(back.host, "node-a");
  EXPECT_EQ(back.device, 3);
  EXPECT_EQ(back.job, "7");
  EXPECT_EQ(back.rank, 5);
  EXPECT_EQ(back.iteration, 1200);
  EXPECT_EQ(back.status, RerunStatus::FirstRerunReproducible);
  EXPECT_EQ(back.injected, "persistent_error");
  EXPECT_EQ(back.message, "it\"s \"quoted\" and two lines");
}

TEST(RerunTracker, ReadsMegatronsStatusSpellings) {
  RerunStatus s;
  ASSERT_TRUE(parse_rerun_status("RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE", s));
  EXPECT_EQ(s, RerunStatus::SecondRerunReproducible);
  ASSERT_TRUE(parse_rerun_status("rerun_disabled", s));
  EXPECT_EQ(s, RerunStatus::RerunDisabled);
  EXPECT_FALSE(parse_rerun_status("SOMETHING_ELSE", s));
  TrackerLine l;
  EXPECT_FALSE(parse_tracker_line("ts=x node=a rank=1 iteration=", l));  // a partial line
  EXPECT_FALSE(parse_tracker_line("hello world", l));
  EXPECT_TRUE(parse_tracker_line(
      "ts=1 node=n device=0 jobID=N/A rank=2 iteration=9 status=RerunValidationStatus.INITIAL_RUN "
      "result=inf message='x'",
      l));
  EXPECT_EQ(l.iteration, 9);
  EXPECT_EQ(l.rank, 2);
}

TEST(RerunTracker, SkipsWhatMegatronSkips) {
  using S = RerunStatus;
  const std::vector<TrackerLine> lines = {
      // iteration 10: reproduced on rank 1, then on other hardware: skipped
      line(1, 10, S::InitialRun),
      line(1, 10, S::FirstRerunReproducible),
      line(1, 10, S::SecondRerunReproducible),
      // iteration 20: once only (a transient error, then a reproducible one): not yet
      line(0, 20, S::FirstRerunNotReproducible),
      line(0, 20, S::FirstRerunReproducible),
      // iteration 30: twice with --rerun-mode disabled on rank 2: skipped
      line(2, 30, S::RerunDisabled, "1"),
      line(2, 30, S::RerunDisabled, "2"),
      // iteration 40: twice on two ranks of one job: not skipped (not one rank's data)
      line(0, 40, S::FirstRerunReproducible),
      line(0, 40, S::SecondRerunReproducible),
      line(1, 40, S::FirstRerunReproducible),
      line(1, 40, S::SecondRerunReproducible),
      // iteration 50: a persistent error (not reproduced on other hardware): not skipped
      line(3, 50, S::FirstRerunReproducible),
      line(3, 50, S::SecondRerunNotReproducible),
  };
  const TrackerSkips s = skipped_iterations(lines);
  EXPECT_EQ(s.skip, (std::vector<int64_t>{10, 30}));
  EXPECT_EQ(s.multi_rank, (std::vector<int64_t>{40}));
}

TEST(RerunTracker, AppendsAndReadsBack) {
  const std::string path = ::testing::TempDir() + "/tessera_tracker_test/sub/rejected.txt";
  std::remove(path.c_str());
  RerunTracker t(path);
  t.check_writable();  // creates the directory
  t.append(line(0, 3, RerunStatus::InitialRun));
  t.append(line(0, 3, RerunStatus::FirstRerunNotReproducible));
  {
    std::ofstream out(path, std::ios::app);
    out << "ts=2026 node=a rank=1 iter";  // a line cut short by a crash
  }
  int bad = 0;
  const std::vector<TrackerLine> lines = t.read(&bad);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(bad, 1);
  EXPECT_EQ(lines[1].status, RerunStatus::FirstRerunNotReproducible);
  EXPECT_THROW(RerunTracker("/proc/tessera/cannot").check_writable(), ConfigError);
  EXPECT_TRUE(RerunTracker("").read().empty());
}

TEST(ResultValidation, ComparesAsMegatron) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(compare_results(2.5, 2.5), 0.0);
  EXPECT_EQ(compare_results(nan, nan), 0.0);  // a NaN reproduced is reproduced
  EXPECT_EQ(compare_results(nan, 1.0), inf);
  EXPECT_EQ(compare_results(1.0, inf), inf);
  EXPECT_DOUBLE_EQ(compare_results(1.0, 3.0), 1.0);   // |2 (1 - 3) / 4|
  EXPECT_DOUBLE_EQ(compare_results(1.0, -1.0), 2.0);  // a + b = 0: |a - b|
}

TEST(ResultValidation, SpikeIsTenTimesTheLargestRecent) {
  SpikeDetector d(10, 3);
  EXPECT_FALSE(d.spiky(1e9));  // nothing seen yet
  d.accept(2.0);
  d.accept(1.0);
  EXPECT_FALSE(d.spiky(20.0));  // 10x the largest, not more
  EXPECT_TRUE(d.spiky(20.5));
  EXPECT_FALSE(d.spiky(std::numeric_limits<double>::quiet_NaN()));  // the NaN check's
  d.accept(1.0);
  d.accept(1.0);  // the window of 3 forgets the 2.0
  EXPECT_TRUE(d.spiky(10.5));
  d.accept(std::numeric_limits<double>::infinity());  // never enters the window
  EXPECT_TRUE(d.spiky(10.5));
}

}  // namespace
}  // namespace tessera
