// test_zero_bubble_schedule.cpp: the zero-bubble schedule (run/pipeline.hpp, ZB-H1): its order on
// each stage, how many B passes' W operands a stage holds, its ideal timeline against 1F1B's
// ((P-1)(F+B-W) + W idle against (P-1)(F+B+W)), and the timelines docs/parallelism.md shows,
// which must be the schedule code's own output.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <tuple>

#include "run/pipeline.hpp"

using namespace tessera;

namespace {
std::vector<std::vector<PipeStep>> stages(int P, int m, bool zero_bubble) {
  std::vector<std::vector<PipeStep>> s;
  for (int r = 0; r < P; ++r)  // ZB-H1: h = k + 1 (a pass's operands half a slot)
    s.push_back(zero_bubble ? schedule_zero_bubble(P, r, m, 1, zero_bubble_held(P, r, m, 1, 2, 1))
                            : schedule_1f1b(P, r, m));
  return s;
}

// The fenced block after `marker` in docs/parallelism.md.
std::string doc_block(const std::string& marker) {
  std::ifstream f(std::string(TESSERA_SOURCE_DIR) + "/docs/parallelism.md");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string doc = ss.str();
  const size_t at = doc.find(marker);
  if (at == std::string::npos) return "(no " + marker + " in docs/parallelism.md)";
  const size_t begin = doc.find("```\n", at) + 4, end = doc.find("```", begin);
  return doc.substr(begin, end - begin);
}
}  // namespace

// Written out by hand from the rule: stage s runs 1F1B's F and B in order; before each B it runs
// the oldest W while h passes are held; the rest after its last B.
TEST(ZeroBubble, OrderOfFourStagesEightMicroBatches) {
  EXPECT_EQ(schedule_string(schedule_zero_bubble(4, 3, 8, 1, 4)),
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 W0 B4 F5 W1 B5 F6 W2 B6 F7 W3 B7 W4 W5 W6 W7");
  EXPECT_EQ(schedule_string(schedule_zero_bubble(4, 1, 8, 1, 2)),
            "F0 F1 F2 B0 F3 B1 F4 W0 B2 F5 W1 B3 F6 W2 B4 F7 W3 B5 W4 B6 W5 B7 W6 W7");
  // Nothing held: 1F1B's whole backwards.
  EXPECT_EQ(schedule_zero_bubble(4, 0, 8, 1, 0), schedule_1f1b(4, 0, 8));
  // Interleaved: the same F and B order as Megatron's, W's after.
  const auto zb = schedule_zero_bubble(2, 1, 4, 2, 2);
  std::vector<PipeStep> fb;
  for (const PipeStep& p : zb)
    if (!p.weight) fb.push_back(p);
  EXPECT_EQ(fb, schedule_interleaved(2, 1, 4, 2));
  EXPECT_EQ(schedule_string(zb),
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 W0.1 B0.0 F3.0 W1.1 B1.0 F2.1 W0.0 B2.1 F3.1 W1.0 "
            "B3.1 W2.1 B2.0 W3.1 B3.0 W2.0 W3.0");
  // The slots: a W does not hold one (its operands are copies).
  EXPECT_EQ(pipeline_chunk_slots(zb, 2), pipeline_chunk_slots(schedule_interleaved(2, 1, 4, 2), 2));
}

TEST(ZeroBubble, HeldPassesFitTheSlotsTheStageHoldsFewer) {
  // k = 3 slots fewer than stage 0 at P = 4: ZB-H1's k + 1 when a pass holds half a slot.
  EXPECT_EQ(zero_bubble_held(4, 3, 8, 1, 2.0, 1.0), 4);
  EXPECT_EQ(zero_bubble_held(4, 3, 8, 1, 1.0, 1.0), 3);  // as large as a slot: k
  EXPECT_EQ(zero_bubble_held(4, 1, 8, 1, 1.0, 1.0), 1);
  EXPECT_EQ(zero_bubble_held(4, 0, 8, 1, 1.0, 0.1), 0);  // stage 0: nothing to spare
  EXPECT_EQ(zero_bubble_held(4, 3, 8, 1, 1.0, 4.0), 0);  // full recomputation: slots too small
  // Interleaved: the slots summed over chunks (stage 0 of 2 x 2 holds 6, stage 1 holds 4).
  EXPECT_EQ(zero_bubble_held(2, 1, 4, 2, 1.0, 1.0), 2);
}

// On an ideal pipeline 1F1B idles (P-1)(F+B+W) per stage. Zero-bubble idles (P-1)(F+B-W) + W
// (with W <= F, as in a transformer layer, where W is about F):
// ZB-H1's (P-1)(F+B-W) and one W more, since stage 0 keeps 1F1B's memory (whole backwards: its
// next forward waits for a W).
TEST(ZeroBubble, IdealTimelineIdlesAboutAThirdOfOneFOneB) {
  int one = 0, zb = 0;
  schedule_timeline(stages(4, 8, false), 1, 1, 1, &one);
  schedule_timeline(stages(4, 8, true), 1, 1, 1, &zb);
  EXPECT_EQ(one, 3 * 8 + 9);
  EXPECT_EQ(zb, 3 * 8 + 4);
  for (int P : {2, 3, 8})
    for (const auto& [f, b, w] : {std::tuple{1, 1, 1}, {2, 2, 1}, {2, 1, 1}, {3, 2, 2}}) {
      const int m = 2 * P, ideal = m * (f + b + w);
      schedule_timeline(stages(P, m, false), f, b, w, &one);
      schedule_timeline(stages(P, m, true), f, b, w, &zb);
      EXPECT_EQ(one - ideal, (P - 1) * (f + b + w)) << P << " " << f << b << w;
      EXPECT_EQ(zb - ideal, (P - 1) * (f + b - w) + w) << P << " " << f << b << w;
    }
}

// docs/parallelism.md shows the code's own timelines.
TEST(ZeroBubble, DocsTimelinesAreTheSchedulesOwn) {
  EXPECT_EQ(doc_block("<!-- timeline: 1F1B, 4 stages, 8 micro-batches -->"),
            schedule_timeline(stages(4, 8, false), 1, 1, 1));
  EXPECT_EQ(doc_block("<!-- timeline: zero-bubble, 4 stages, 8 micro-batches -->"),
            schedule_timeline(stages(4, 8, true), 1, 1, 1));
}
