// Stage splits (model/pipeline_split.hpp): Megatron-LM's layout strings and uneven-stage options,
// every example of its docs/user-guide/features/pipeline_parallel_layout.md and of its unit tests'
// shapes, and every refusal.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/params.hpp"
#include "model/pipeline_split.hpp"

namespace tessera {
namespace {

// Each stage as "E t3 m1 L" style: the letters and decoder counts, for compact expectations.
std::vector<int> layer_counts(const std::vector<StageSpan>& spans) {
  std::vector<int> out;
  for (const StageSpan& s : spans) out.push_back(s.layers());
  return out;
}

// The message of the ConfigError `f` throws ("" when it does not throw).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineLayout, ParsesMegatronsExamples) {
  // The docs' DeepSeek-V3 example: 61 decoder layers and one MTP layer at PP16 x VPP2.
  std::vector<std::string> st = parse_pipeline_layout("Et*3|(tt|)*29,m|L");
  ASSERT_EQ(st.size(), 32u);
  EXPECT_EQ(st[0], "Ettt");
  for (int s = 1; s <= 29; ++s) EXPECT_EQ(st[size_t(s)], "tt") << s;
  EXPECT_EQ(st[30], "m");
  EXPECT_EQ(st[31], "L");
  // Its parse_str_to_list docstring's and the pattern comments' expansions.
  EXPECT_EQ(parse_pipeline_layout("Ettt|(tt|)*29,m|L").size(), 32u);
  EXPECT_EQ(parse_pipeline_layout("E(tt|)*2,tL"), (std::vector<std::string>{"Ett", "tt", "tL"}));
  EXPECT_EQ(parse_pipeline_layout("(|tt)*2,tL"), (std::vector<std::string>{"", "tt", "tttL"}));
  EXPECT_EQ(parse_pipeline_layout("E|(t|)*3,m|m||L"),
            (std::vector<std::string>{"E", "t", "t", "t", "m", "m", "", "L"}));
  // Empty stages (the docs' note) and commas anywhere.
  EXPECT_EQ(parse_pipeline_layout("E||t|L"), (std::vector<std::string>{"E", "", "t", "L"}));
  EXPECT_EQ(parse_pipeline_layout("E,t,t|t,L"), (std::vector<std::string>{"Ett", "tL"}));
  EXPECT_EQ(parse_pipeline_layout("Et*0|tL"), (std::vector<std::string>{"E", "tL"}));
  EXPECT_EQ(parse_pipeline_layout("Et*12|t*2mL"),
            (std::vector<std::string>{"Etttttttttttt", "ttmL"}));
}

TEST(PipelineLayout, RefusesUnknownCharacters) {
  EXPECT_NE(error_of([] { parse_pipeline_layout("Ex|tL"); }).find("invalid layer character 'x'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline_layout("E(t|tL"); }).find("invalid layer character '('"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline_layout("E t|tL"); }).find("invalid layer character ' '"),
            std::string::npos);
}

TEST(PipelineLayout, SplitsTheDeepSeekExample) {
  PipelineSplitOptions o;
  o.layout = "Et*3|(tt|)*29,m|L";
  // PP16 x VP2 (the docs' table) and PP8 x VP4: the same 32 stages in layer order.
  for (int pp : {16, 8}) {
    const std::vector<StageSpan> spans = split_stages(o, 61, 1, pp, 0);
    ASSERT_EQ(spans.size(), 32u);
    EXPECT_EQ(layout_virtual_stages(o.layout, pp), 32 / pp);
    EXPECT_TRUE(spans[0].embedding);
    EXPECT_EQ(spans[0].layers(), 3);
    EXPECT_EQ(spans[1].begin, 3);
    EXPECT_EQ(spans[29].end, 61);
    EXPECT_EQ(spans[30].mtp, 1);
    EXPECT_TRUE(spans[31].loss);
    EXPECT_EQ(describe_stage(spans[0]), "embedding,decoder*3");
    EXPECT_EQ(describe_stage(spans[30]), "mtp");
    EXPECT_EQ(describe_stage(spans[31]), "loss");
  }
  // The docs' rank map: PP rank 14's second virtual stage holds the MTP layer (a stage of its
  // own: Megatron's mtp_standalone), rank 15's the loss.
  EXPECT_EQ(standalone_mtp_rank(split_stages(o, 61, 1, 16, 0), 16), 14);
  GPTConfig cfg;
  cfg.num_layers = 61;
  cfg.mtp_num_layers = 1;
  const ModelShard r14 = model_shard_for(cfg, 1, 0, 16, 14, 0, o);
  EXPECT_EQ(r14.mtp_count, 1);
  EXPECT_EQ(r14.mtp_begin, 61);
  EXPECT_FALSE(r14.has_head);
  EXPECT_TRUE(r14.head_piece());
  EXPECT_EQ(r14.chunks[1].size(), 0);
  EXPECT_EQ(r14.describe_layers(), "29-30");  // its first virtual stage: stage 14
  const ModelShard r15 = model_shard_for(cfg, 1, 0, 16, 15, 0, o);
  EXPECT_TRUE(r15.has_head);
  EXPECT_EQ(r15.mtp_count, 0);
  EXPECT_EQ(layout_string(split_stages(o, 61, 1, 16, 0)).substr(0, 12), "Ettt|tt|tt|t");
  // Written with the MTP layer beside the loss it builds.
  o.layout = "Et*3|(tt|)*29,t|mL";
  EXPECT_NE(error_of([&] { split_stages(o, 61, 1, 16, 0); }).find("places 62 decoder"),
            std::string::npos);
  o.layout = "Et*3|(tt|)*28,t|t|mL";
  const std::vector<StageSpan> spans = split_stages(o, 61, 1, 16, 0);
  EXPECT_EQ(spans[31].mtp, 1);
  EXPECT_TRUE(spans[31].loss);
  EXPECT_EQ(describe_stage(spans[31]), "mtp,loss");
}

TEST(PipelineLayout, ShardsFollowTheLayout) {
  GPTConfig cfg;
  cfg.num_layers = 5;
  PipelineSplitOptions o;
  o.layout = "Et|tt||ttL";  // PP2 x VP2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
  const ModelShard r0 = model_shard_for(cfg, 1, 0, 2, 0, 0, o);
  const ModelShard r1 = model_shard_for(cfg, 1, 0, 2, 1, 0, o);
  ASSERT_EQ(r0.num_chunks(), 2);
  EXPECT_EQ(r0.chunks[0].begin, 0);
  EXPECT_EQ(r0.chunks[0].end, 1);
  EXPECT_EQ(r0.chunks[1].size(), 0);  // the empty stage
  EXPECT_EQ(r1.chunks[0].begin, 1);
  EXPECT_EQ(r1.chunks[0].end, 3);
  EXPECT_EQ(r1.chunks[1].begin, 3);
  EXPECT_EQ(r1.chunks[1].end, 5);
  EXPECT_TRUE(r0.has_embedding);
  EXPECT_FALSE(r0.has_head);
  EXPECT_FALSE(r1.has_embedding);
  EXPECT_TRUE(r1.has_head);
  EXPECT_EQ(r0.describe_layers(), "0");
  EXPECT_EQ(r1.describe_layers(), "1-2, 3-4");
  // A given VP must equal the layout's.
  EXPECT_EQ(model_shard_for(cfg, 1, 0, 2, 1, 2, o).num_chunks(), 2);
  EXPECT_NE(error_of([&] { split_stages(o, 5, 0, 2, 3); }).find("make 2 virtual stages"),
            std::string::npos);
  EXPECT_NE(error_of([&] { split_stages(o, 5, 0, 3, 0); }).find("not a multiple of"),
            std::string::npos);
}

TEST(PipelineLayout, RefusesWhatMegatronRefuses) {
  auto refusal = [](const std::string& layout, int L, int M, int pp) {
    PipelineSplitOptions o;
    o.layout = layout;
    return error_of([&] { split_stages(o, L, M, pp, 0); });
  };
  EXPECT_NE(refusal("tE|tL", 2, 0, 2).find("must begin with E"), std::string::npos);
  EXPECT_NE(refusal("Et|Lt", 2, 0, 2).find("must end with L"), std::string::npos);
  EXPECT_NE(refusal("Et|EtL", 2, 0, 2).find("2 E"), std::string::npos);
  EXPECT_NE(refusal("EtL|tL", 2, 0, 2).find("2 L"), std::string::npos);
  EXPECT_NE(refusal("Et|tL", 3, 0, 2).find("places 2 decoder layers (t), but --num-layers=3"),
            std::string::npos);
  EXPECT_NE(refusal("Et|tL", 2, 1, 2).find("places 0 MTP layers (m), but --mtp-num-layers=1"),
            std::string::npos);
  EXPECT_NE(refusal("Etm|tmL", 2, 2, 2).find("decoder layers (t) must come before"),
            std::string::npos);
  // MTP only in its rank's last virtual stage; all of it in one stage.
  EXPECT_NE(refusal("Et|tm||L", 2, 1, 2).find("rank's last virtual stage"), std::string::npos);
  // The embedding opens the first stage and the loss closes the last, empty stages or not.
  EXPECT_NE(refusal("|Et|t|L", 2, 0, 2).find("must begin with E"), std::string::npos);
  EXPECT_NE(refusal("Et|tL||", 2, 0, 2).find("must end with L"), std::string::npos);
  EXPECT_NE(refusal("Etm|mL", 1, 2, 2).find("must be in one stage"), std::string::npos);
  // With any of the other four options.
  for (int which = 0; which < 4; ++which) {
    PipelineSplitOptions o;
    o.layout = "Et|tL";
    if (which == 0) o.first = 1;
    if (which == 1) o.last = 1;
    if (which == 2) o.account_embedding = true;
    if (which == 3) o.account_loss = true;
    EXPECT_NE(error_of([&] { split_stages(o, 2, 0, 2, 0); }).find("places every layer itself"),
              std::string::npos)
        << which;
  }
}

TEST(PipelineSplit, UnevenFirstAndLastStages) {
  PipelineSplitOptions o;
  o.first = 1;
  o.last = 2;
  EXPECT_EQ(layer_counts(split_stages(o, 5, 0, 3, 1)), (std::vector<int>{1, 2, 2}));
  // 7 layers at PP4: the middle two ranks hold (7 - 1 - 2) / 2.
  EXPECT_EQ(layer_counts(split_stages(o, 7, 0, 4, 1)), (std::vector<int>{1, 2, 2, 2}));
  // First alone: the rest spread over the others.
  o.last = 0;
  o.first = 3;
  EXPECT_EQ(layer_counts(split_stages(o, 7, 0, 3, 1)), (std::vector<int>{3, 2, 2}));
  // With virtual stages: each rank's layers over its chunks, stages in order chunk * PP + rank
  // (Megatron's get_transformer_layer_offset).
  o.first = 2;
  o.last = 2;
  const std::vector<StageSpan> s = split_stages(o, 8, 0, 3, 2);
  EXPECT_EQ(layer_counts(s), (std::vector<int>{1, 2, 1, 1, 2, 1}));
  EXPECT_EQ(s[1].begin, 1);
  EXPECT_EQ(s[3].begin, 4);
  EXPECT_EQ(s[5].end, 8);
  // MTP goes with the loss.
  o.first = 1;
  o.last = 0;
  const std::vector<StageSpan> m = split_stages(o, 3, 1, 2, 1);
  EXPECT_EQ(m.back().mtp, 1);
  EXPECT_TRUE(m.back().loss);
}

TEST(PipelineSplit, RefusesUnevenStagesMegatronRefuses) {
  auto refusal = [](int first, int last, int L, int pp, int vp) {
    PipelineSplitOptions o;
    o.first = first;
    o.last = last;
    return error_of([&] { split_stages(o, L, 0, pp, vp); });
  };
  EXPECT_NE(refusal(3, 0, 8, 2, 2)
                .find("--decoder-first-pipeline-num-layers=3 is not divisible "
                      "by the 2 virtual stages"),
            std::string::npos);
  EXPECT_NE(refusal(0, 1, 8, 2, 2).find("--decoder-last-pipeline-num-layers=1 is not divisible"),
            std::string::npos);
  EXPECT_NE(refusal(1, 1, 7, 4, 1).find("do not divide over the 2 middle pipeline stages"),
            std::string::npos);
  EXPECT_NE(refusal(2, 2, 5, 2, 1).find("leaves 1 layers for 0 middle pipeline stages"),
            std::string::npos);
  EXPECT_NE(refusal(3, 3, 5, 3, 1).find("hold more than --num-layers=5"), std::string::npos);
  EXPECT_NE(refusal(2, 2, 10, 4, 2).find("middle pipeline stage's 3 layers are not divisible"),
            std::string::npos);
  // Beyond Megatron: at PP 1 the option would shrink the model (Megatron-LM #1778).
  EXPECT_NE(refusal(2, 0, 4, 1, 1).find("needs --pipeline-model-parallel-size > 1"),
            std::string::npos);
  // With the accounting options.
  PipelineSplitOptions o;
  o.first = 1;
  o.account_loss = true;
  EXPECT_NE(error_of([&] { split_stages(o, 5, 0, 2, 1); })
                .find("cannot be given with "
                      "--account-for-loss"),
            std::string::npos);
}

TEST(PipelineSplit, EmbeddingAndLossCountedAsLayers) {
  PipelineSplitOptions o;
  o.account_embedding = true;
  o.account_loss = true;
  // (6 + 2) / 4 = 2 per stage: the first and last hold one transformer layer each.
  EXPECT_EQ(layer_counts(split_stages(o, 6, 0, 4, 1)), (std::vector<int>{1, 2, 2, 1}));
  // The 405B's published layout: 126 layers at PP8 x VP8 with both: (126 + 2) / 64 = 2.
  const std::vector<StageSpan> s = split_stages(o, 126, 0, 8, 8);
  ASSERT_EQ(s.size(), 64u);
  EXPECT_EQ(s.front().layers(), 1);
  EXPECT_EQ(s.back().layers(), 1);
  EXPECT_EQ(s[1].layers(), 2);
  EXPECT_EQ(s.back().end, 126);
  o.account_loss = false;
  EXPECT_EQ(layer_counts(split_stages(o, 5, 0, 3, 1)), (std::vector<int>{1, 2, 2}));
  EXPECT_NE(error_of([&] { split_stages(o, 6, 0, 4, 1); })
                .find("7 layers (--num-layers=6 + 1 for the embedding) are not divisible by "
                      "--pipeline-model-parallel-size=4"),
            std::string::npos);
  o.account_loss = true;
  EXPECT_NE(error_of([&] { split_stages(o, 10, 0, 4, 2); })
                .find("each pipeline rank's 3 layers (--num-layers=10 + 1 for the embedding + 1 "
                      "for the loss) are not divisible by its 2 virtual stages"),
            std::string::npos);
}

TEST(PipelineSplit, EvenSplitIsTheDefault) {
  const PipelineSplitOptions o;
  EXPECT_FALSE(o.uneven());
  EXPECT_EQ(layer_counts(split_stages(o, 8, 0, 2, 2)), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_NE(error_of([&] { split_stages(o, 5, 0, 2, 1); }).find("not divisible"),
            std::string::npos);
  GPTConfig cfg;
  cfg.num_layers = 8;
  const ModelShard s = model_shard_for(cfg, 1, 0, 2, 1, 2);
  EXPECT_EQ(s.describe_layers(), "2-3, 6-7");
}

}  // namespace
}  // namespace tessera
