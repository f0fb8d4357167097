// Megatron's _get_ltor_masks_and_position_ids (run/sample_layout.hpp) on hand-worked samples.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "run/sample_layout.hpp"

using namespace tessera;

namespace {

struct Layout {
  std::vector<int32_t> positions, key_begin, targets;
};

Layout layout_of(const std::vector<int32_t>& input, LtorOptions o) {
  const int64_t T = static_cast<int64_t>(input.size());
  Layout l{std::vector<int32_t>(T, -7), std::vector<int32_t>(T, -7), std::vector<int32_t>(T, 5)};
  ltor_layout(input.data(), nullptr, T, o, l.positions.data(), l.key_begin.data(),
              l.targets.data());
  return l;
}

}  // namespace

TEST(SampleLayout, EachOptionAsMegatronComputesIt) {
  // EOD = 0 at 0 (a sample starting on a document's last token), 3, 4 (an empty document) and
  // 7, the last input token (it starts nothing inside this sample).
  const std::vector<int32_t> input = {0, 9, 9, 0, 0, 9, 9, 0};
  LtorOptions o;
  o.eod = 0;
  Layout plain = layout_of(input, o);
  EXPECT_EQ(plain.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(plain.key_begin, (std::vector<int32_t>(8, 0)));
  EXPECT_EQ(plain.targets, (std::vector<int32_t>(8, 5)));

  o.reset_position_ids = true;
  Layout pos = layout_of(input, o);
  EXPECT_EQ(pos.positions, (std::vector<int32_t>{0, 0, 1, 2, 0, 0, 1, 2}));
  EXPECT_EQ(pos.key_begin, (std::vector<int32_t>(8, 0)));

  o.reset_position_ids = false;
  o.reset_attention_mask = true;
  Layout mask = layout_of(input, o);
  EXPECT_EQ(mask.positions, plain.positions);
  EXPECT_EQ(mask.key_begin, (std::vector<int32_t>{0, 1, 1, 1, 4, 5, 5, 5}));

  o.reset_attention_mask = false;
  o.eod_mask_loss = true;
  Layout loss = layout_of(input, o);
  EXPECT_EQ(loss.targets, (std::vector<int32_t>{-1, 5, 5, -1, -1, 5, 5, -1}));
  EXPECT_EQ(loss.positions, plain.positions);

  o.reset_position_ids = o.reset_attention_mask = true;
  Layout all = layout_of(input, o);
  EXPECT_EQ(all.positions, pos.positions);
  EXPECT_EQ(all.key_begin, mask.key_begin);
  EXPECT_EQ(all.targets, loss.targets);
  EXPECT_TRUE(o.active());
  EXPECT_FALSE(LtorOptions{}.active());
}

TEST(SampleLayout, PackedDocumentsComeFromTheFlagsNotTheEods) {
  // --sft: documents at 0, 3 and 5 (flags), padding from 7; an EOD inside a document (at 1)
  // resets nothing. The first token of each document is no target.
  const std::vector<int32_t> sample = {5, 0, 6, 7, 8, 9, 0, -1, -1};
  const std::vector<uint8_t> flags = {kDocumentStart, 1, 1, kDocumentStart, 1, kDocumentStart, 0,
                                      kDocumentStart, 0};
  LtorOptions o;
  o.eod = 0;
  o.packed = o.reset_position_ids = o.reset_attention_mask = true;
  std::vector<int32_t> pos(8), key(8);
  ltor_layout(sample.data(), flags.data(), 8, o, pos.data(), key.data(), nullptr);
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 1, 0}));
  EXPECT_EQ(key, (std::vector<int32_t>{0, 0, 0, 3, 3, 5, 5, 7}));
  std::vector<uint8_t> counts(8);
  loss_counts(sample.data(), flags.data(), 8, o, counts.data());
  // Targets 1..8: 0 (counts), 6, then 7 starts a document, 8, 9 starts one, 0 has mask 0, pads.
  EXPECT_EQ(counts, (std::vector<uint8_t>{1, 1, 0, 1, 0, 0, 0, 0}));
}

TEST(SampleLayout, WithoutAnEodNothingResets) {
  const std::vector<int32_t> input = {3, 1, 4, 1, 5};
  LtorOptions o;
  o.eod = 2;
  o.reset_position_ids = o.reset_attention_mask = o.eod_mask_loss = true;
  Layout l = layout_of(input, o);
  EXPECT_EQ(l.positions, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(l.key_begin, (std::vector<int32_t>(5, 0)));
  EXPECT_EQ(l.targets, (std::vector<int32_t>(5, 5)));
}

// Where documents cannot run, one line naming what to change: the CPU takes every case; CUDA masks
// documents in its tensor-core kernels at every CP size and takes ALiBi's distances by row (so
// reset positions with ALiBi need the mask too).
TEST(SampleLayout, WhatCannotRunIsOneLine) {
  LtorOptions mask, packed, alibi_pos;
  mask.reset_attention_mask = true;
  packed.packed = true;
  alibi_pos.reset_position_ids = true;
  for (const LtorOptions& o : {mask, packed, alibi_pos}) {
    EXPECT_EQ(documents_problem(o, "cpu", true), "");
    EXPECT_EQ(documents_problem(o, "cuda", false), "");
  }
  EXPECT_EQ(documents_problem(mask, "cuda", true), "");
  EXPECT_EQ(documents_problem(packed, "cuda", true), "");
  EXPECT_NE(documents_problem(alibi_pos, "cuda", true)
                .find("--reset-position-ids with ALiBi and without --reset-attention-mask"),
            std::string::npos);
}
