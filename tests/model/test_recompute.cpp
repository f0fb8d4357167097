// test_recompute.cpp: activation recomputation (model/recompute.hpp). Two micro-batches are in
// flight at once (forward A, forward B, backward A, backward B: what a pipeline stage's 1F1B
// schedule does), so a recomputed buffer that was not refilled before A's backward holds B's
// values. Losses and every gradient must be bitwise those of the run that stores everything, and
// the buffers must be what the plan says: shared where recomputed, per micro-batch where kept.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/gpt.hpp"

using namespace tessera;

namespace {

GPTConfig config(int layers) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 8;
  c.vocab_size = 70;
  c.make_vocab_size_divisible_by = 32;
  return c;
}

RecomputeConfig full(RecomputeMethod m, int n) {
  RecomputeConfig rc;
  rc.granularity = RecomputeGranularity::Full;
  rc.method = m;
  rc.num_layers = n;
  return rc;
}
RecomputeConfig selective() {
  RecomputeConfig rc;
  rc.granularity = RecomputeGranularity::Selective;
  return rc;
}

struct Result {
  double loss_a = 0, loss_b = 0;
  std::vector<char> grads;  // the flat f32 gradient buffer, as bytes
};

// With `dropout`, both dropouts at 0.1 and the micro-batches at different global samples: the
// recomputed forward must draw the masks of the first one again.
Result two_in_flight(const GPTConfig& cfg, DType dtype, const RecomputeConfig& rc,
                     bool dropout = false) {
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel m(cfg, model_shard_for(cfg, 1, 0, 1, 0), *be, tp, dtype, rc);
  m.init_parameters(17);
  const int B = 2, T = 8;
  std::vector<Activations> slots = m.make_activation_slots(B, T, 2);
  std::mt19937 g(5);
  std::uniform_int_distribution<int> tok(0, 69);
  for (Activations& a : slots)
    for (int i = 0; i < B * T; ++i) {
      a.ids.i32()[i] = tok(g);
      a.targets.i32()[i] = tok(g);
    }
  if (dropout)
    for (int k = 0; k < 2; ++k) slots[k].dropout = DropoutContext{true, 11, 3, 100 + k * B};
  m.zero_grads();
  Result r;
  r.loss_a = m.forward(slots[0], 1.0f / (2 * B * T));
  r.loss_b = m.forward(slots[1], 1.0f / (2 * B * T));
  m.backward(slots[0]);
  m.backward(slots[1]);
  const Tensor gr = m.params().flat_grads();
  r.grads.assign(static_cast<const char*>(gr.raw()),
                 static_cast<const char*>(gr.raw()) + gr.nbytes());
  return r;
}

}  // namespace

TEST(Recompute, PlanFollowsMegatronsMethods) {
  // Uniform chunks of 2 over a stage of layers 4-8: [4,6) [6,8) [8,9).
  auto p = plan_recompute(full(RecomputeMethod::Uniform, 2), 4, 9);
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(p[0].chunk_begin, 4);
  EXPECT_EQ(p[1].chunk_end, 6);
  EXPECT_EQ(p[3].chunk_begin, 6);
  EXPECT_EQ(p[4].chunk_begin, 8);
  EXPECT_EQ(p[4].chunk_end, 9);
  // Block 2: the first two layers alone, the rest stored.
  p = plan_recompute(full(RecomputeMethod::Block, 2), 4, 9);
  EXPECT_EQ(p[1].kind, RecomputeGranularity::Full);
  EXPECT_EQ(p[1].chunk_begin, 5);
  EXPECT_EQ(p[1].chunk_end, 6);
  EXPECT_EQ(p[2].kind, RecomputeGranularity::None);
  EXPECT_THROW(plan_recompute(full(RecomputeMethod::Uniform, 6), 4, 9), ConfigError);
  EXPECT_THROW(plan_recompute(full(RecomputeMethod::Block, 0), 4, 9), ConfigError);
}

TEST(Recompute, LossesAndGradientsAreBitwiseTheStoredRuns) {
  GPTConfig with_dropout = config(3);
  with_dropout.attention_dropout = with_dropout.hidden_dropout = 0.1;
  const Result no_drop = two_in_flight(with_dropout, DType::F32, RecomputeConfig{}, false);
  for (auto [dt, dropout] :
       {std::pair{DType::F32, false}, std::pair{DType::BF16, false}, std::pair{DType::F32, true}}) {
    const GPTConfig cfg = dropout ? with_dropout : config(3);
    const Result ref = two_in_flight(cfg, dt, RecomputeConfig{}, dropout);
    if (dropout) {
      ASSERT_NE(ref.loss_a, no_drop.loss_a);  // the masks are on
    }
    ASSERT_GT(ref.loss_a, 1.0);
    ASSERT_NE(ref.loss_a, ref.loss_b);  // the two micro-batches differ
    for (const RecomputeConfig& rc :
         {full(RecomputeMethod::Uniform, 1), full(RecomputeMethod::Uniform, 2),
          full(RecomputeMethod::Uniform, 3), full(RecomputeMethod::Block, 2), selective()}) {
      const Result got = two_in_flight(cfg, dt, rc, dropout);
      const std::string what =
          std::string(dtype_name(dt)) + " " + rc.describe() + (dropout ? " dropout" : "");
      EXPECT_EQ(got.loss_a, ref.loss_a) << what;
      EXPECT_EQ(got.loss_b, ref.loss_b) << what;
      ASSERT_EQ(got.grads.size(), ref.grads.size());
      EXPECT_EQ(std::memcmp(got.grads.data(), ref.grads.data(), ref.grads.size()), 0) << what;
    }
  }
}

TEST(Recompute, BuffersAreSharedWhereRecomputedAndKeptElsewhere) {
  const GPTConfig cfg = config(3);
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  const ModelShard shard = model_shard_for(cfg, 1, 0, 1, 0);
  auto same = [](const Tensor& x, const Tensor& y) { return x.raw() == y.raw(); };
  {  // uniform 2: chunks [0,2) [2,3); kept: the chunk outputs res2 of layers 1 and 2
    GPTModel m(cfg, shard, *be, tp, DType::F32, full(RecomputeMethod::Uniform, 2));
    auto s = m.make_activation_slots(2, 8, 2);
    EXPECT_TRUE(same(s[0].layers[0].ln1, s[1].layers[0].ln1));
    EXPECT_TRUE(same(s[0].layers[0].res2, s[1].layers[0].res2));   // inside a chunk
    EXPECT_FALSE(same(s[0].layers[1].res2, s[1].layers[1].res2));  // a chunk's output
    EXPECT_TRUE(same(s[0].layers[2].fc1, s[0].layers[0].fc1));     // position 0 of both chunks
    EXPECT_FALSE(same(s[0].layers[2].res2, s[1].layers[2].res2));
    EXPECT_FALSE(same(s[0].input, s[1].input));
    EXPECT_FALSE(same(s[0].dres, s[1].dres));
    EXPECT_TRUE(same(s[0].dfc, s[1].dfc));  // scratch
  }
  {  // selective: LayerNorm, attention core and GELU outputs shared; GEMM outputs kept
    GPTModel m(cfg, shard, *be, tp, DType::F32, selective());
    auto s = m.make_activation_slots(2, 8, 2);
    EXPECT_TRUE(same(s[0].layers[0].ln2, s[1].layers[2].ln2));
    EXPECT_TRUE(same(s[0].layers[0].att, s[1].layers[1].att));
    EXPECT_TRUE(same(s[0].layers[0].gelu, s[1].layers[0].gelu));
    EXPECT_FALSE(same(s[0].layers[0].qkv, s[1].layers[0].qkv));
    EXPECT_FALSE(same(s[0].layers[0].fc1, s[0].layers[1].fc1));
    EXPECT_FALSE(same(s[0].layers[0].res1, s[1].layers[0].res1));
  }
}

TEST(Recompute, FootprintCountsWhatEachModeKeeps) {
  // Per layer per micro-batch, in elements of N = B*T tokens (f32, TP 1, C = 16, ffn 64):
  //   none:      ln1 C, qkv 3C, att C, res1 C, ln2 C, fc1 4C, gelu 4C, res2 C, 4 LN statistics,
  //              lse (heads)
  //   selective: qkv 3C, res1 C, fc1 4C, res2 C
  //   full:      res2 C (each layer its own chunk)
  const GPTConfig cfg = config(3);
  const ModelShard shard = model_shard_for(cfg, 1, 0, 1, 0);
  const int B = 2, T = 8;
  const double N = B * T, C = 16, H = 4, bytes = 4;
  auto fp = [&](const RecomputeConfig& rc) {
    return activation_footprint(cfg, shard, rc, B, T, DType::F32);
  };
  const ActivationFootprint none = fp({}), sel = fp(selective()),
                            full1 = fp(full(RecomputeMethod::Uniform, 1)),
                            full3 = fp(full(RecomputeMethod::Uniform, 3));
  const double layer_none = N * (16 * C + 4 + H) * bytes, layer_sel = N * 9 * C * bytes,
               layer_full = N * C * bytes;
  EXPECT_DOUBLE_EQ(none.per_micro_batch - sel.per_micro_batch, 3 * (layer_none - layer_sel));
  EXPECT_DOUBLE_EQ(none.per_micro_batch - full1.per_micro_batch, 3 * (layer_none - layer_full));
  // Full, one chunk of 3: only the stage output is kept; the working set holds 3 layers but the
  // last one's output (which is kept per micro-batch).
  EXPECT_DOUBLE_EQ(none.per_micro_batch - full3.per_micro_batch, 3 * layer_none - layer_full);
  EXPECT_DOUBLE_EQ(full3.shared - none.shared, 3 * layer_none - layer_full);
  EXPECT_DOUBLE_EQ(full1.shared - none.shared, layer_none - layer_full);
  EXPECT_DOUBLE_EQ(sel.shared - none.shared, layer_none - layer_sel);
  // The model allocates what the footprint counts: the host allocator's bytes for three slots.
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel m(cfg, shard, *be, tp, DType::F32, selective());
  const size_t before = host_allocated_bytes();
  const std::vector<Activations> slots = m.make_activation_slots(B, T, 3);
  EXPECT_DOUBLE_EQ(static_cast<double>(host_allocated_bytes() - before), sel.total(3));
}
