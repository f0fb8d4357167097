// Megatron's _get_ltor_masks_and_position_ids (train/sample_layout.hpp) on hand-worked samples.
#include <gtest/gtest.h>

#include <vector>

#include "train/sample_layout.hpp"

using namespace tessera;

namespace {

struct Layout {
  std::vector<int32_t> positions, key_begin, targets;
};

Layout layout_of(const std::vector<int32_t>& input, LtorOptions o) {
  const int64_t T = static_cast<int64_t>(input.size());
  Layout l{std::vector<int32_t>(T, -7), std::vector<int32_t>(T, -7), std::vector<int32_t>(T, 5)};
  ltor_layout(input.data(), T, o, l.positions.data(), l.key_begin.data(), l.targets.data());
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
