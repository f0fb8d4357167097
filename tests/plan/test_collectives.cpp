// test_collectives.cpp: the collective plan recorded from the trainer's step (plan/collectives.hpp,
// issue 69): the recording communicators' groups are the process grid's (comm/recording.hpp), the
// shape backend routes MoE tokens evenly (backend/shape_backend.hpp), and the predictor's pieces,
// recorded on one stage holding one layer of each kind, are the pieces of the whole step's
// recording stage by stage. tests/plan/test_collective_sequence.sh holds the whole step to a real
// MPI run's calls.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "backend/shape_backend.hpp"
#include "comm/recording.hpp"
#include "options/options.hpp"
#include "plan/collectives.hpp"
#include "plan/dry_run_options.hpp"

using namespace tessera;

namespace {

const std::string kConfigs = std::string(TESSERA_SOURCE_DIR) + "/configs/";

RunOptions parsed(std::vector<std::string> args) {
  return dry_run_options(std::move(args));
}

// The calls of the model's own groups (the gradient buckets a last backward completes follow
// the data-parallel layout, which the predictor times apart).
std::vector<std::string> lines(const CallList& calls) {
  std::vector<std::string> out;
  for (const CollectiveCall& c : calls)
    if (c.group == "tp" || c.group == "cp" || c.group == "ep") out.push_back(c.line());
  return out;
}

// The world ranks a recorded send from `comm` to each group rank reaches, in group-rank order.
std::vector<int> members(Communicator& comm, CallRecorder& rec) {
  rec.calls.clear();
  Tensor t = Tensor::unbound({1}, DType::F32, cpu_allocator());
  for (int p = 0; p < comm.size(); ++p) comm.send_async(t, p, 0);
  std::vector<int> out;
  for (const CollectiveCall& c : rec.calls) out.push_back(c.peer);
  return out;
}

}  // namespace

// Every rank of a TP2 x CP2 x DP2 x PP2 grid: its recording groups hold the ranks GridLayout's
// groups hold (ProcessGrid's splits), with this rank at its place.
TEST(RecordingGrid, GroupsAreTheProcessGrids) {
  const GridLayout L = GridLayout::make(16, 2, 2, 2);
  auto group_of = [](const std::vector<std::vector<int>>& groups, int r) {
    for (const auto& g : groups)
      for (int m : g)
        if (m == r) return g;
    return std::vector<int>{};
  };
  for (int r = 0; r < L.world; ++r) {
    CallRecorder rec;
    rec.on = true;
    RecordingGridSpec spec;
    spec.layout = L;
    const RecordingGrid grid(spec, r, rec);
    const ParallelContext& c = grid.context();
    const std::vector<std::pair<Communicator*, std::vector<int>>> expect = {
        {c.tp, group_of(L.tp_groups(), r)},
        {c.pp, group_of(L.pp_groups(), r)},
        {c.cp, group_of(L.cp_groups(), r)},
        {c.dp, group_of(L.grad_groups(), r)},
        {c.model_parallel, group_of(L.model_parallel_groups(), r)},
        {c.embedding, group_of(L.embedding_groups(), r)}};
    for (const auto& [comm, want] : expect) {
      ASSERT_FALSE(want.empty()) << "rank " << r;
      EXPECT_EQ(members(*comm, rec), want) << "rank " << r;
      EXPECT_EQ(want[size_t(comm->rank())], r) << "rank " << r;
    }
    // NCCL's gradient group is the pipeline's members under its own name.
    spec.device = true;
    const RecordingGrid nccl(spec, r, rec);
    rec.calls.clear();
    nccl.context().pp_grad->send_async(Tensor::unbound({1}, DType::F32, cpu_allocator()), 0, 0);
    ASSERT_EQ(rec.calls.size(), 1u);
    EXPECT_EQ(rec.calls[0].group, "pp_grad");
  }
}

// Expert parallelism and HSDP's instances: EP2 over DP4 with two optimizer instances.
TEST(RecordingGrid, ExpertAndInstanceGroupsFollowTheirRanks) {
  const GridLayout L = GridLayout::make(4, 1, 1);
  for (int r = 0; r < 4; ++r) {
    CallRecorder rec;
    rec.on = true;
    RecordingGridSpec spec;
    spec.layout = L;
    spec.ep = 2;
    spec.instances = 2;
    const RecordingGrid grid(spec, r, rec);
    const ParallelContext& c = grid.context();
    EXPECT_EQ(c.ep_rank, r % 2);
    EXPECT_EQ(members(*c.ep, rec), (std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}));  // consecutive
    EXPECT_EQ(members(*c.edp, rec), (std::vector<int>{r % 2, r % 2 + 2}));  // same expert rank
    EXPECT_EQ(members(*c.dp_shard, rec), (std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}));
    EXPECT_EQ(members(*c.dp_replica, rec), (std::vector<int>{r % 2, r % 2 + 2}));
    EXPECT_EQ(c.edp_shard->size(), 1);  // DP / EP / instances
    EXPECT_EQ(c.edp_replica->size(), 2);
    // A host gather assumes every rank holds what this one holds.
    const double mine[2] = {3, 5};
    double all[4] = {0, 0, 0, 0};
    c.ep->all_gather_f64(mine, 2, all);
    EXPECT_EQ(std::vector<double>(all, all + 4), (std::vector<double>{3, 5, 3, 5}));
  }
}

// Balanced routing: each expert gets N K / E copies (the remainder to the first), within the
// capacity; the tensors have addresses and no memory.
TEST(ShapeBackend, RoutesEvenlyWithinTheCapacity) {
  auto be = make_shape_backend();
  EXPECT_FALSE(be->computes());
  Tensor logits({10, 4}, DType::F32, be->allocator()), a({10, 3}, DType::I32, be->allocator());
  EXPECT_NE(logits.raw(), a.raw());
  MoERouting r;
  r.experts = 4;
  r.topk = 3;
  std::vector<int64_t> routed, kept;
  EXPECT_EQ(be->moe_route(a, a, a, logits, r, 5, routed, kept), 30);
  EXPECT_EQ(kept, (std::vector<int64_t>{8, 8, 7, 7}));
  EXPECT_EQ(routed, (std::vector<int64_t>{4, 4, 4, 3, 4, 4, 4, 3}));  // 15 copies per group of 5
  r.capacity_factor = 0.5;  // ceil(10 * 3 / 4 * 0.5) = 4 each
  EXPECT_EQ(be->moe_route(a, a, a, logits, r, 10, routed, kept), 16);
}

// DeepSeek-shaped (a dense first layer, then MoE layers; multi-token prediction) at TP2 + SP x
// EP2 x PP2 with selective recomputation: the predictor's recording (one stage of layers 0-1, the
// embedding and the head) gives every stage's pieces as the whole step's recording of that
// stage's rank lists them.
TEST(PieceCalls, AreTheWholeStepsPiecesOnEveryStage) {
  const RunOptions o =
      parsed({"--config", kConfigs + "deepseek-tiny.ini", "--mock-data", "--global-batch-size", "8",
              "--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
              "--mtp-num-layers", "1", "--recompute-granularity", "selective"});
  const GridLayout layout = GridLayout::make(8, 2, 2);
  const TrainConfig t = o.train.resolved(layout.dp);
  const PieceCalls pieces(o.model, t, layout, 2);
  std::set<std::string> groups;
  for (int s = 0; s < 2; ++s) {
    const CollectivePlan whole(o.model, t, layout, 2, layout.rank_of(0, s, 0), false,
                               CollectivePlan::piece_micro_batches(t, layout));
    const ModelShard& shard = whole.shard();
    for (const int l : shard.layers()) {
      if (shard.is_mtp_layer(l)) continue;  // the head's
      EXPECT_EQ(lines(pieces.layer_forward(l)), lines(whole.layer_forward(l))) << "layer " << l;
      for (bool last : {false, true})
        EXPECT_EQ(lines(pieces.layer_backward(l, last)), lines(whole.layer_backward(l, last)))
            << "layer " << l << (last ? " (last)" : "");
      for (const CollectiveCall& c : whole.layer_backward(l, true)) groups.insert(c.group);
    }
    if (shard.has_embedding) {
      EXPECT_EQ(lines(pieces.embed_forward()), lines(whole.embed_forward()));
      EXPECT_EQ(lines(pieces.embed_backward()), lines(whole.embed_backward()));
    }
    if (shard.has_head) {
      EXPECT_EQ(lines(pieces.head_forward()), lines(whole.head_forward()));
      for (bool last : {false, true})
        EXPECT_EQ(lines(pieces.head_backward(last)), lines(whole.head_backward(last)));
      // The MTP layer's dispatch is the head's.
      int a2a = 0;
      for (const CollectiveCall& c : whole.head_forward()) a2a += c.op == "all_to_all";
      EXPECT_EQ(a2a, 2);
    }
  }
  // The layers' backwards hold TP (the sums, the gathers) and EP (the all-to-alls) calls.
  EXPECT_TRUE(groups.count("tp") && groups.count("ep"));
}
