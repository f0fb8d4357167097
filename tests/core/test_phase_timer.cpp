// test_phase_timer.cpp: the phase registry of core/phase_timer.hpp on a clock the test moves by
// hand: exclusive times of nested phases, back-to-back phases of a PhaseSequence, call counts,
// the order of the totals, one clock synchronize per collect(), nothing recorded while off, and
// discard() after an error.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/phase_timer.hpp"

using namespace tessera;

namespace {

// Timestamps are whatever `now` says when a slot is recorded.
struct HandClock final : PhaseClock {
  double* now;
  int* syncs;
  std::vector<int>* slots;  // every slot recorded, in order
  HandClock(double* n, int* s, std::vector<int>* sl) : now(n), syncs(s), slots(sl) {}
  std::vector<double> t;
  void record(int slot) override {
    if (static_cast<size_t>(slot) >= t.size()) t.resize(static_cast<size_t>(slot) + 1);
    t[static_cast<size_t>(slot)] = *now;
    slots->push_back(slot);
  }
  void synchronize() override { ++*syncs; }
  double elapsed_ms(int from, int to) override {
    return t.at(static_cast<size_t>(to)) - t.at(static_cast<size_t>(from));
  }
};

std::map<std::string, PhaseTotal> by_name(const std::vector<PhaseTotal>& v) {
  std::map<std::string, PhaseTotal> m;
  for (const PhaseTotal& t : v) m[t.name] = t;
  return m;
}

class PhaseTimerTest : public ::testing::Test {
 protected:
  void SetUp() override { PhaseTimer::global().reset(); }
  void TearDown() override {
    PhaseTimer::global().disable();
    PhaseTimer::global().reset();
  }
  void enable() { PhaseTimer::global().enable(std::make_unique<HandClock>(&now, &syncs, &slots)); }
  double now = 0;
  int syncs = 0;
  std::vector<int> slots;
};

}  // namespace

TEST_F(PhaseTimerTest, OffRecordsNothing) {
  EXPECT_FALSE(PhaseTimer::on());
  {
    TESSERA_PHASE("a");
    PhaseSequence s;
    s("b");
    s("c");
  }
  PhaseTimer::global().collect();
  EXPECT_TRUE(PhaseTimer::global().totals().empty());
  EXPECT_EQ(PhaseTimer::global().total_ms(), 0.0);
}

TEST_F(PhaseTimerTest, NestedPhasesCountExclusiveTime) {
  enable();
  EXPECT_TRUE(PhaseTimer::on());
  {
    TESSERA_PHASE("outer");  // 0 .. 10, of which 2 .. 5 inside "inner": 7 exclusive
    now = 2;
    {
      TESSERA_PHASE("inner");
      now = 5;
    }
    now = 10;
  }
  now = 11;
  {
    TESSERA_PHASE("inner");  // a second call: 11 .. 12
    now = 12;
  }
  PhaseTimer::global().collect();
  const auto t = by_name(PhaseTimer::global().totals());
  ASSERT_EQ(t.size(), 2u);
  EXPECT_DOUBLE_EQ(t.at("outer").ms, 7.0);
  EXPECT_EQ(t.at("outer").calls, 1);
  EXPECT_DOUBLE_EQ(t.at("inner").ms, 4.0);
  EXPECT_EQ(t.at("inner").calls, 2);
  // The sum never counts a moment twice: 12 ms spanned, 1 ms (10 .. 11) outside any phase.
  EXPECT_DOUBLE_EQ(PhaseTimer::global().total_ms(), 11.0);
  EXPECT_EQ(PhaseTimer::global().totals().front().name, "outer");  // longest first
  EXPECT_EQ(syncs, 1);
}

TEST_F(PhaseTimerTest, SequenceMarksAreBackToBack) {
  enable();
  {
    PhaseSequence phase;
    phase("gemm");  // 0 .. 3
    now = 3;
    phase("gelu");  // 3 .. 4
    now = 4;
    phase("gemm");  // 4 .. 9
    now = 9;
  }
  PhaseTimer::global().collect();
  const std::vector<PhaseTotal> v = PhaseTimer::global().totals();
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].name, "gemm");
  EXPECT_DOUBLE_EQ(v[0].ms, 8.0);
  EXPECT_EQ(v[0].calls, 2);
  EXPECT_EQ(v[1].name, "gelu");
  EXPECT_DOUBLE_EQ(v[1].ms, 1.0);
  // One timestamp per mark plus the close: 4 slots for 3 phases.
  EXPECT_EQ(slots, (std::vector<int>{0, 1, 2, 3}));
}

TEST_F(PhaseTimerTest, CollectFreesTheSlotsAndKeepsTheTotals) {
  enable();
  for (int step = 0; step < 3; ++step) {
    {
      TESSERA_PHASE("step-work");
      now += 2;
    }
    PhaseTimer::global().collect();  // one synchronize per collect
  }
  EXPECT_EQ(syncs, 3);
  EXPECT_EQ(slots, (std::vector<int>{0, 1, 0, 1, 0, 1}));  // reused after each collect
  const std::vector<PhaseTotal> v = PhaseTimer::global().totals();
  ASSERT_EQ(v.size(), 1u);
  EXPECT_DOUBLE_EQ(v[0].ms, 6.0);
  EXPECT_EQ(v[0].calls, 3);
  PhaseTimer::global().collect();  // nothing new: no synchronize
  EXPECT_EQ(syncs, 3);
  PhaseTimer::global().reset();
  EXPECT_TRUE(PhaseTimer::global().totals().empty());
}

TEST_F(PhaseTimerTest, CollectInsideAnOpenPhaseIsAnError) {
  enable();
  PhaseTimer::global().begin("open");
  EXPECT_THROW(PhaseTimer::global().collect(), Error);
  PhaseTimer::global().end();
  EXPECT_NO_THROW(PhaseTimer::global().collect());
}

TEST_F(PhaseTimerTest, DisableCollectsAndStops) {
  enable();
  {
    TESSERA_PHASE("x");
    now = 1.5;
  }
  PhaseTimer::global().disable();  // collects what was recorded
  EXPECT_FALSE(PhaseTimer::on());
  {
    TESSERA_PHASE("x");  // not timed
  }
  const std::vector<PhaseTotal> v = PhaseTimer::global().totals();
  ASSERT_EQ(v.size(), 1u);
  EXPECT_DOUBLE_EQ(v[0].ms, 1.5);
  EXPECT_EQ(v[0].calls, 1);
}

TEST_F(PhaseTimerTest, DiscardDropsWhatWasNotCollected) {
  enable();
  {
    TESSERA_PHASE("kept");
    now = 1;
  }
  PhaseTimer::global().collect();
  const int synced = syncs;
  PhaseTimer::global().begin("dropped");  // an error leaves a phase open
  now = 5;
  PhaseTimer::global().discard();  // the clock is not read again
  EXPECT_EQ(syncs, synced);
  EXPECT_FALSE(PhaseTimer::on());
  const std::vector<PhaseTotal> v = PhaseTimer::global().totals();
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].name, "kept");
  enable();  // usable again
  {
    TESSERA_PHASE("kept");
    now = 7;
  }
  PhaseTimer::global().collect();
  EXPECT_DOUBLE_EQ(PhaseTimer::global().totals()[0].ms, 3.0);
}

TEST(ChronoPhaseClock, SynchronizesBeforeEachTimestamp) {
  int syncs = 0;
  ChronoPhaseClock c([&] { ++syncs; });
  c.record(0);
  c.record(1);
  EXPECT_EQ(syncs, 2);
  EXPECT_GE(c.elapsed_ms(0, 1), 0.0);
  EXPECT_THROW(c.elapsed_ms(0, 5), std::out_of_range);
}
