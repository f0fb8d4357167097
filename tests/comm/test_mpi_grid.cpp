// test_mpi_grid.cpp (run with mpirun -np 8): the communicators of ProcessGrid contain exactly the
// ranks GridLayout says, and the MPI collectives compute what they should.
#include <gtest/gtest.h>

#include <algorithm>

#include "runtime/process_grid.hpp"

using namespace tessera;

namespace {
// The world ranks of a group, gathered through the group itself.
std::vector<int> members(Communicator& c, int world_rank) {
  Tensor mine({1}), all({c.size()});
  mine.f32()[0] = static_cast<float>(world_rank);
  c.all_gather(all, mine);
  std::vector<int> out;
  for (int i = 0; i < c.size(); ++i) out.push_back(static_cast<int>(all.f32()[i]));
  return out;
}
std::vector<int> group_containing(const std::vector<std::vector<int>>& groups, int rank) {
  for (const auto& g : groups)
    for (int r : g)
      if (r == rank) return g;
  return {};
}
}  // namespace

TEST(ProcessGrid, GroupsMatchTheLayout) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ASSERT_EQ(world % 4, 0) << "run with a multiple of 4 ranks";
  ProcessGrid grid(2, 2);
  ParallelContext ctx = grid.context();
  const GridLayout& L = grid.layout();
  const int r = grid.world_rank();
  EXPECT_EQ(ctx.dp_size, world / 4);
  EXPECT_EQ(members(*ctx.tp, r), group_containing(L.tp_groups(), r));
  EXPECT_EQ(members(*ctx.pp, r), group_containing(L.pp_groups(), r));
  EXPECT_EQ(members(*ctx.dp, r), group_containing(L.dp_groups(), r));
  EXPECT_EQ(members(*ctx.model_parallel, r), group_containing(L.model_parallel_groups(), r));
  EXPECT_EQ(members(*ctx.embedding, r), group_containing(L.embedding_groups(), r));
  EXPECT_EQ(ctx.tp->rank(), ctx.tp_rank);
  EXPECT_EQ(ctx.pp->rank(), ctx.pp_rank);
  EXPECT_EQ(grid.local_size(), world);  // one node here
  const std::string table = grid.layout_table();
  if (r == 0) {
    EXPECT_NE(table.find("TP 2 x PP 2 x DP"), std::string::npos) << table;
  }
}

// Virtual pipeline stages: the ring's wrap-around communicators hold the first and last stage of
// the rank's (tp, dp), first stage rank 0, and exist on those stages only.
TEST(ProcessGrid, PipelineRingCommunicators) {
  ProcessGrid grid(2, 2);
  EXPECT_EQ(grid.context().pp_wrap, nullptr);
  grid.use_pipeline_ring();
  const ParallelContext ctx = grid.context();
  const int r = grid.world_rank();
  ASSERT_NE(ctx.pp_wrap, nullptr);  // with PP 2 every rank is a first or last stage
  ASSERT_NE(ctx.pp_wrap_grad, nullptr);
  const std::vector<int> want = group_containing(grid.layout().embedding_groups(), r);
  EXPECT_EQ(members(*ctx.pp_wrap, r), want);
  EXPECT_EQ(members(*ctx.pp_wrap_grad, r), want);
  EXPECT_EQ(ctx.pp_wrap->rank(), ctx.first_stage() ? 0 : 1);
  // Last stage -> first stage on one, first -> last on the other, at the same time.
  Tensor s({3}), got({3});
  s.fill_(float(r));
  Communicator& fwd = *ctx.pp_wrap;
  Communicator& bwd = *ctx.pp_wrap_grad;
  auto a = (ctx.last_stage() ? fwd : bwd).send_async(s, ctx.last_stage() ? 0 : 1, 1);
  (ctx.first_stage() ? fwd : bwd).recv(got, ctx.first_stage() ? 1 : 0, 1);
  a->wait();
  EXPECT_EQ(got.f32()[0], float(want[ctx.first_stage() ? 1 : 0]));
}

// HSDP's instances: the gradient group (DP x CP of a (tp, pp)) cut into groups of consecutive
// ranks, and the ranks at the same place in each; a sum over both is the gradient group's.
TEST(ProcessGrid, OptimizerInstancesCutTheGradientGroup) {
  ProcessGrid grid(2, 1, 1);
  grid.use_optimizer_instances(2);
  const ParallelContext ctx = grid.context();
  const int r = grid.world_rank();
  const std::vector<int> grad = group_containing(grid.layout().grad_groups(), r);
  const int S = static_cast<int>(grad.size()) / 2;
  const int at = static_cast<int>(std::find(grad.begin(), grad.end(), r) - grad.begin());
  std::vector<int> shard(grad.begin() + at / S * S, grad.begin() + at / S * S + S);
  std::vector<int> replica{grad[static_cast<size_t>(at % S)],
                           grad[static_cast<size_t>(at % S + S)]};
  EXPECT_EQ(ctx.dp_instances, 2);
  EXPECT_EQ(members(*ctx.shard_group(), r), shard);
  EXPECT_EQ(members(*ctx.replica_group(), r), replica);
  EXPECT_EQ(members(*ctx.dp, r), grad);  // the whole gradient group stays
  Tensor x({1});
  x.f32()[0] = static_cast<float>(r + 1);
  ctx.shard_group()->all_reduce(x, ReduceOp::Sum);
  ctx.replica_group()->all_reduce(x, ReduceOp::Sum);
  float want = 0;
  for (int g : grad) want += static_cast<float>(g + 1);
  EXPECT_EQ(x.f32()[0], want);
  const std::string table = grid.layout_table();
  if (r == 0) {
    EXPECT_NE(table.find("2 optimizer instances of " + std::to_string(S)), std::string::npos)
        << table;
  }
}

TEST(MpiCommunicator, Collectives) {
  MpiCommunicator c(MPI_COMM_WORLD);
  const int n = c.size(), r = c.rank();
  Tensor t({5});
  for (int i = 0; i < 5; ++i) t.f32()[i] = float(r * 10 + i);
  c.all_reduce(t, ReduceOp::Sum);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(t.f32()[i], float(10 * n * (n - 1) / 2 + n * i));
  Tensor m({1});
  m.f32()[0] = float(r);
  c.all_reduce_async(m, ReduceOp::Max)->wait();
  EXPECT_EQ(m.f32()[0], float(n - 1));
  double d[2] = {1.0, double(r)};
  c.all_reduce_f64(d, 2, ReduceOp::Sum);
  EXPECT_EQ(d[0], double(n));
  Tensor in({n * 3}), out({3});
  for (int i = 0; i < n * 3; ++i) in.f32()[i] = float(i + r);
  c.reduce_scatter(out, in);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out.f32()[i], float(n * (r * 3 + i) + n * (n - 1) / 2));
  Tensor b({4});
  b.fill_(float(r));
  c.broadcast(b, n - 1);
  EXPECT_EQ(b.f32()[3], float(n - 1));
  // A ring: everyone sends to the right and receives from the left at the same time.
  Tensor s({7}), got({7});
  s.fill_(float(r));
  auto pending = c.send_async(s, (r + 1) % n, 5);
  c.recv(got, (r + n - 1) % n, 5);
  pending->wait();
  EXPECT_EQ(got.f32()[6], float((r + n - 1) % n));
}
