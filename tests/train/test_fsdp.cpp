// test_fsdp.cpp: Megatron-FSDP's unit layout and its ledger (run/fsdp_ledger.hpp) on their
// own; train.fsdp (tests/train/test_fsdp.sh) runs the strategies end to end.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "model/gpt.hpp"
#include "model/params.hpp"
#include "run/fsdp_ledger.hpp"
#include "run/pipeline.hpp"
#include "tiny.hpp"

using namespace tessera;
using testing_util::small_gpt;

namespace {
ModelShard whole(const GPTConfig& c) {
  return model_shard_for(c, 1, 0, 1, 0);
}

FlatLayout fsdp_layout(int shards) {
  FlatLayout l;
  l.shards = shards;
  l.bucket_elems = 7;  // ignored: one bucket per unit
  l.fsdp_units = true;
  l.embedding_alone = true;
  return l;
}
}  // namespace

// One bucket per unit: each layer, wpe (the embedding unit), the head (the final norm), the tied
// wte alone; each padded to a multiple of the shards.
TEST(Fsdp, OneBucketPerUnitPaddedToTheShards) {
  const GPTConfig cfg = small_gpt(32, 4, 16, 100, 3);
  std::vector<ParamSpec> specs = build_param_specs(cfg, whole(cfg));
  const std::vector<FlatBucket> buckets = layout_flat_buffer(specs, fsdp_layout(3));
  ASSERT_EQ(buckets.size(), size_t(cfg.num_layers + 3));
  std::set<std::string> units;
  for (const FlatBucket& b : buckets) {
    const std::string u = fsdp_unit_of(specs[size_t(b.first_param)].name);
    for (int p = b.first_param; p < b.end_param; ++p)
      EXPECT_EQ(fsdp_unit_of(specs[size_t(p)].name), u) << specs[size_t(p)].name;
    EXPECT_TRUE(units.insert(specs[size_t(b.first_param)].name == "wte" ? "wte" : u).second) << u;
    EXPECT_EQ(b.numel() % 3, 0);
  }
  EXPECT_EQ(units, (std::set<std::string>{"layers.0", "layers.1", "layers.2", "embedding", "head",
                                          "wte"}));
}

// With unit-only gradients and compute weights the store has no flat buffers; each parameter's
// views live in its bucket's tensor, which reads whatever it is bound to.
TEST(Fsdp, UnitOnlyStoreViewsFollowTheirBucket) {
  const GPTConfig cfg = small_gpt(32, 4, 16, 100, 2);
  FlatLayout l = fsdp_layout(2);
  l.units_only_grads = l.units_only_compute = true;
  l.master = false;
  ParamStore ps(build_param_specs(cfg, whole(cfg)), cpu_allocator(), DType::F32, l);
  EXPECT_THROW(ps.flat_grads(), Error);
  EXPECT_THROW(ps.flat_compute(), Error);
  const ParamSpec& s = ps.spec("layers.1.mlp.fc1.weight");
  size_t index = 0;
  while (ps.specs()[index].name != s.name) ++index;
  const int b = ps.bucket_of(index);
  const FlatBucket& fb = ps.buckets()[size_t(b)];
  Tensor g = ps.grad(s), w = ps.compute_param(s);
  EXPECT_THROW((void)g.f32(), Error);  // unbound
  Tensor gm({fb.numel()}), wm({fb.numel()});
  gm.fill_(0.f);
  for (int64_t i = 0; i < fb.numel(); ++i) wm.f32()[i] = float(i);
  ps.bucket_grads(b).bind_storage(gm);
  ps.bucket_compute(b).bind_storage(wm);
  EXPECT_EQ(w.f32()[0], float(s.flat_offset - fb.begin));
  g.f32()[3] = 7.f;
  EXPECT_EQ(gm.f32()[s.flat_offset - fb.begin + 3], 7.f);
  EXPECT_EQ(ps.numel(), ps.buckets().front().end);
}

// The ledger's pool for one step of a 3-layer model, gradients sharded, 2 micro-batches: the
// backward holds the head's and the tied embedding's units, each layer's while the one before it
// is still reducing (two layer-sized buffers), the embedding's (wpe) last; the next micro-batch
// reuses them. Sharding the weights too adds one gathered buffer of each unit (bf16) and a second
// layer's: a layer's weights are held while the next one's gather (the prefetch) is in flight.
TEST(Fsdp, LedgerPoolIsTheUnitsHeldAtOnce) {
  const GPTConfig cfg = small_gpt(32, 4, 16, 100, 3);
  const ModelShard sh = whole(cfg);
  std::vector<ParamSpec> specs = build_param_specs(cfg, sh);
  const std::vector<FlatBucket> buckets = layout_flat_buffer(specs, fsdp_layout(2));
  int64_t layer = 0, other = 0;
  for (const FlatBucket& b : buckets) {
    if (fsdp_unit_of(specs[size_t(b.first_param)].name).rfind("layers.", 0) == 0)
      layer = b.numel();
    else
      other += b.numel();
  }
  const std::vector<PipeStep> steps = schedule_1f1b(1, 0, 2);
  const std::vector<LayerRecompute> none(3);
  const int64_t grads = fsdp_pool_bytes(specs, buckets, sh, true, false, DType::F32, steps, none);
  EXPECT_EQ(grads, 4 * (other + 2 * layer));
  // The weights: the embedding's units (wte, wpe) with the first layer's prefetched, each layer's
  // with the next one's, the last layer's with the head's (wte, the final norm); backward the
  // same in reverse, in the same buffers.
  const int64_t both = fsdp_pool_bytes(specs, buckets, sh, true, true, DType::BF16, steps, none);
  EXPECT_EQ(both, grads + 2 * (other + 2 * layer));
  // Full recomputation of the 3 layers: the last layer's backward holds its own weights and the
  // previous layer's prefetched while the chunk's first layer is gathered again for its second
  // forward (no prefetch inside a recomputation): a third layer buffer.
  std::vector<LayerRecompute> full(3);
  for (LayerRecompute& r : full) {
    r.kind = RecomputeGranularity::Full;
    r.chunk_begin = 0;
    r.chunk_end = 3;
  }
  EXPECT_EQ(fsdp_pool_bytes(specs, buckets, sh, true, true, DType::BF16, steps, full),
            both + 2 * layer);
}

// The ledger's calls in a step of one micro-batch: each piece's gather is started while the piece
// before it in the pass holds its own weights (forward: the next layer; backward: the previous),
// and waited for only when its piece begins; a unit gathered once is not gathered again while
// held, and every gather is waited for before its weights are released.
TEST(Fsdp, LedgerPrefetchesTheNextPieceOfThePass) {
  const GPTConfig cfg = small_gpt(32, 4, 16, 100, 3);
  const ModelShard sh = whole(cfg);
  std::vector<ParamSpec> specs = build_param_specs(cfg, sh);
  const std::vector<FlatBucket> buckets = layout_flat_buffer(specs, fsdp_layout(2));
  std::vector<FsdpLedger::Unit> units = fsdp_units(specs, buckets, sh);
  std::vector<std::string> name(units.size());
  for (const FlatBucket& b : buckets) {
    const std::string& first = specs[size_t(b.first_param)].name;
    name[size_t(&b - buckets.data())] =
        first.rfind("layers.", 0) == 0 ? fsdp_unit_of(first) : first;
  }
  struct Rec final : FsdpLedger::Actions {
    const std::vector<std::string>* name;
    std::vector<std::string> log;
    std::set<int> started;
    void gather(int u, const Tensor&) override {
      EXPECT_TRUE(started.insert(u).second) << (*name)[size_t(u)] << " gathered twice";
      log.push_back("g " + (*name)[size_t(u)]);
    }
    void wait_gather(int u) override {
      EXPECT_EQ(started.erase(u), 1u) << (*name)[size_t(u)] << " waited for unstarted";
      log.push_back("w " + (*name)[size_t(u)]);
    }
    void release_params(int u) override {
      EXPECT_EQ(started.count(u), 0u) << (*name)[size_t(u)] << " released while gathering";
    }
    void bind_grads(int, const Tensor&) override {}
    void start_reduce(int) override {}
    void finish_reduce(int) override {}
  } rec;
  rec.name = &name;
  FsdpLedger ledger(units, sh, false, true, DType::F32, &cpu_allocator());
  ledger.set_actions(&rec);
  constexpr int E = kEmbedPiece, H = kHeadPiece;
  for (int p : {E, 0, 1, 2, H}) ledger.before_forward(p), ledger.after_forward(p);
  for (int p : {H, 2, 1, 0, E}) ledger.before_backward(p), ledger.after_backward(p);
  ledger.finish();
  EXPECT_TRUE(rec.started.empty());
  std::string seq;
  for (const std::string& s : rec.log) seq += s + "; ";
  // The tied embedding (wte) is in the embedding's and the head's pieces, each bucket a unit.
  EXPECT_EQ(seq,
            "g wpe; g wte; w wpe; w wte; g layers.0; w layers.0; g layers.1; w layers.1; "
            "g layers.2; w layers.2; g lnf.weight; g wte; w lnf.weight; w wte; "
            "g lnf.weight; g wte; w lnf.weight; w wte; g layers.2; w layers.2; g layers.1; "
            "w layers.1; g layers.0; w layers.0; g wpe; g wte; w wpe; w wte; ");
}
