// test_process_grid.cpp: the rank layout against Megatron-LM's tables, and the 1F1B schedule.
#include <gtest/gtest.h>

#include "run/pipeline.hpp"
#include "runtime/process_grid.hpp"

using namespace tessera;
using Groups = std::vector<std::vector<int>>;

TEST(GridLayout, MegatronSixteenRanksTp2Pp4) {
  // The example of Megatron-LM's initialize_model_parallel docstring: 16 GPUs, TP 2, PP 4.
  const GridLayout g = GridLayout::make(16, 2, 4);
  EXPECT_EQ(g.dp, 2);
  EXPECT_EQ(g.tp_groups(),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(g.dp_groups(),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(g.pp_groups(), (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(g.embedding_groups(), (Groups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  EXPECT_EQ(g.model_parallel_groups(),
            (Groups{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}));
  const GridCoords c = g.coords(13);  // 13 = tp 1 + 2 * (dp 0 + 2 * pp 3)
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.dp, 0);
  EXPECT_EQ(c.pp, 3);
}

TEST(GridLayout, EightRanksAndDegenerateLayouts) {
  const GridLayout g = GridLayout::make(8, 2, 2);
  EXPECT_EQ(g.dp, 2);
  EXPECT_EQ(g.tp_groups(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(g.dp_groups(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(g.pp_groups(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  for (int r = 0; r < 8; ++r) {
    const GridCoords c = g.coords(r);
    EXPECT_EQ(g.rank_of(c.tp, c.pp, c.dp), r);
  }
  const GridLayout dp_only = GridLayout::make(4, 1, 1);
  EXPECT_EQ(dp_only.dp_groups(), (Groups{{0, 1, 2, 3}}));
  EXPECT_EQ(dp_only.embedding_groups(), (Groups{{0}, {1}, {2}, {3}}));
  const GridLayout tp_only = GridLayout::make(4, 4, 1);
  EXPECT_EQ(tp_only.tp_groups(), (Groups{{0, 1, 2, 3}}));
  EXPECT_EQ(tp_only.dp, 1);
}

TEST(GridLayout, ContextParallelSixteenRanksTp2Cp2Pp2) {
  // Megatron-Core's order tp-cp-dp-pp: rank = tp + TP * (cp + CP * (dp + DP * pp)).
  const GridLayout g = GridLayout::make(16, 2, 2, 2);
  EXPECT_EQ(g.dp, 2);
  EXPECT_EQ(g.cp, 2);
  EXPECT_EQ(g.tp_groups(),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(g.cp_groups(),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(g.dp_groups(),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  // Gradients (and the distributed optimizer's shards) span DP x CP of the same (tp, pp).
  EXPECT_EQ(g.grad_groups(),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(g.pp_groups(),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(g.model_parallel_groups(),
            (Groups{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}));
  const GridCoords c = g.coords(11);  // 11 = tp 1 + 2 * (cp 1 + 2 * (dp 0 + 2 * pp 1))
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.cp, 1);
  EXPECT_EQ(c.dp, 0);
  EXPECT_EQ(c.pp, 1);
  for (int r = 0; r < 16; ++r) {
    const GridCoords k = g.coords(r);
    EXPECT_EQ(g.rank_of(k.tp, k.pp, k.dp, k.cp), r);
  }
  // CP 1 is the (TP, PP, DP) grid: the gradient groups are the DP groups.
  const GridLayout plain = GridLayout::make(8, 2, 2);
  EXPECT_EQ(plain.grad_groups(), plain.dp_groups());
  EXPECT_EQ(plain.cp_groups().size(), 8u);
  try {
    GridLayout::make(12, 2, 1, 4);
    FAIL() << "12 ranks with TP 2 x CP 4 accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--context-parallel-size=4"), std::string::npos)
        << e.what();
  }
}

TEST(GridLayout, ImpossibleLayoutNamesTheNumbers) {
  try {
    GridLayout::make(6, 4, 1);
    FAIL() << "6 ranks with TP 4 accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("world size 6"), std::string::npos) << m;
    EXPECT_NE(m.find("--tensor-model-parallel-size=4"), std::string::npos) << m;
  }
  EXPECT_THROW(GridLayout::make(4, 0, 1), ConfigError);
}

TEST(GridLayout, OptimizerInstancesDivideTheDataParallelRanks) {
  const GridLayout L = GridLayout::make(16, 2, 1, 2);  // DP 4 x CP 2 = 8 gradient ranks
  EXPECT_NO_THROW(check_optimizer_instances(L, 1, 4));
  EXPECT_NO_THROW(check_optimizer_instances(L, 2, 4));  // the experts' DP 2 x CP 2 = 4
  try {
    check_optimizer_instances(L, 1, 3);
    FAIL() << "3 instances of 8 ranks accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("DP 4 x CP 2 = 8"), std::string::npos) << e.what();
  }
  try {
    check_optimizer_instances(L, 4, 4);  // the experts' DP 1 x CP 2 = 2
    FAIL() << "4 instances of 2 expert ranks accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("DP 4 / EP 4 x CP 2 = 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(check_optimizer_instances(L, 1, 0), ConfigError);
}

TEST(Pipeline, OneFOneBOrderForFourStagesEightMicroBatches) {
  EXPECT_EQ(schedule_string(schedule_1f1b(4, 0, 8)),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(schedule_string(schedule_1f1b(4, 1, 8)),
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(schedule_string(schedule_1f1b(4, 2, 8)),
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(schedule_string(schedule_1f1b(4, 3, 8)),
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  EXPECT_EQ(pipeline_slots(4, 0, 8), 4);
  EXPECT_EQ(pipeline_slots(4, 3, 8), 1);
  // Fewer micro-batches than stages: all forwards, then all backwards.
  EXPECT_EQ(schedule_string(schedule_1f1b(4, 0, 2)), "F0 F1 B0 B1");
  EXPECT_EQ(pipeline_slots(4, 0, 2), 2);
  EXPECT_NEAR(theoretical_bubble(4, 8), 3.0 / 11.0, 1e-15);
}

TEST(Pipeline, EveryStageRunsEachMicroBatchOnceAndSlotsSuffice) {
  for (int P : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 5, 8, 13})
      for (int s = 0; s < P; ++s) {
        const auto steps = schedule_1f1b(P, s, m);
        ASSERT_EQ(steps.size(), size_t(2 * m));
        std::vector<int> fwd(m, -1), bwd(m, -1);
        int in_flight = 0, most = 0;
        for (size_t i = 0; i < steps.size(); ++i) {
          (steps[i].forward ? fwd : bwd)[steps[i].micro] = int(i);
          in_flight += steps[i].forward ? 1 : -1;
          most = std::max(most, in_flight);
        }
        for (int k = 0; k < m; ++k) {
          ASSERT_GE(fwd[k], 0);
          ASSERT_GT(bwd[k], fwd[k]);
          if (k > 0) {
            ASSERT_GT(bwd[k], bwd[k - 1]);  // backwards in order: slot k % slots is free
          }
        }
        ASSERT_EQ(most, pipeline_slots(P, s, m)) << "P " << P << " s " << s << " m " << m;
      }
}

// Megatron's interleaved schedule for 2 stages, 2 chunks each, 4 micro-batches, written out by
// hand from its definition: forward k is micro-batch (k / 4) * 2 + k % 2 of chunk (k / 2) % 2,
// backward k the same micro-batch of chunk 1 - (k / 2) % 2; stage 0 warms up with
// (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4 forwards, stage 1 with 2. "F2.1": micro-batch 2 of chunk 1.
TEST(Pipeline, InterleavedOrderForTwoStagesTwoChunksFourMicroBatches) {
  EXPECT_EQ(schedule_string(schedule_interleaved(2, 0, 4, 2)),
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0");
  EXPECT_EQ(schedule_string(schedule_interleaved(2, 1, 4, 2)),
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0");
  // As many micro-batches as stages: every forward first.
  EXPECT_EQ(schedule_string(schedule_interleaved(2, 0, 2, 2)),
            "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0");
  // One chunk is plain 1F1B.
  EXPECT_EQ(schedule_interleaved(4, 1, 8, 1), schedule_1f1b(4, 1, 8));
  // Stage 0 has all 4 micro-batches of chunk 0 in flight before B0.0, at most 2 of chunk 1.
  EXPECT_EQ(pipeline_chunk_slots(schedule_interleaved(2, 0, 4, 2), 2), (std::vector<int>{4, 2}));
  EXPECT_NEAR(theoretical_bubble_ratio(4, 8, 2), 3.0 / 16.0, 1e-15);
}

// Every rank of an interleaved pipeline, run together the way the trainer runs them (sends never
// block, a step waits for the input it receives): the schedule always completes (no deadlock),
// runs every micro-batch of every chunk forward once and backward once after it, and within a
// chunk in micro-batch order (so slot m % slots is free), with no more in flight than
// pipeline_chunk_slots says.
TEST(Pipeline, InterleavedCompletesOnEveryRankWithoutDeadlock) {
  for (int P : {2, 3, 4})
    for (int V : {2, 3})
      for (int m : {P, 2 * P, 3 * P}) {
        SCOPED_TRACE("P " + std::to_string(P) + " V " + std::to_string(V) + " m " +
                     std::to_string(m));
        const int S = P * V;  // virtual stages
        std::vector<std::vector<PipeStep>> steps;
        for (int p = 0; p < P; ++p) steps.push_back(schedule_interleaved(P, p, m, V));
        // done[f/b][virtual stage][micro]
        std::vector<std::vector<char>> fdone(S, std::vector<char>(m, 0)), bdone = fdone;
        std::vector<size_t> next(P, 0);
        bool progress = true;
        while (progress) {
          progress = false;
          for (int p = 0; p < P; ++p) {
            while (next[p] < steps[p].size()) {
              const PipeStep& st = steps[p][next[p]];
              const int vs = st.chunk * P + p;
              bool ready;
              if (st.forward) {
                ASSERT_FALSE(fdone[vs][st.micro]) << "forward twice";
                ready = vs == 0 || fdone[vs - 1][st.micro];
              } else {
                ASSERT_TRUE(fdone[vs][st.micro]) << "backward before forward";
                ASSERT_FALSE(bdone[vs][st.micro]) << "backward twice";
                if (st.micro > 0) {
                  ASSERT_TRUE(bdone[vs][st.micro - 1]) << "out of order";
                }
                ready = vs == S - 1 || bdone[vs + 1][st.micro];
              }
              if (!ready) break;
              (st.forward ? fdone : bdone)[vs][st.micro] = 1;
              ++next[p];
              progress = true;
            }
          }
        }
        for (int p = 0; p < P; ++p) ASSERT_EQ(next[p], steps[p].size()) << "rank " << p << " stuck";
        for (int vs = 0; vs < S; ++vs)
          for (int k = 0; k < m; ++k) ASSERT_TRUE(bdone[vs][k]);
        for (int p = 0; p < P; ++p) {
          const std::vector<int> slots = pipeline_chunk_slots(steps[p], V);
          std::vector<int> live(V, 0);
          for (const PipeStep& st : steps[p]) {
            live[st.chunk] += st.forward ? 1 : -1;
            ASSERT_LE(live[st.chunk], slots[st.chunk]);
          }
        }
      }
}
