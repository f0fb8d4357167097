// test_nccl.cpp (issue 56): Tessera's NCCL communicators (comm/nccl/nccl_communicator.hpp) between
// several ranks, each on its own GPU or all on one (--ranks-per-gpu's case: every rank started
// through scripts/nccl-share-gpu.sh, which gives it its own NCCL_HOSTID, so NCCL joins them over
// its socket transport). Every collective the trainer uses, on two communicators at once, against
// the values each rank can compute for itself. Skipped where no GPU is visible; run by
// scripts/gpu-run.sh --steps=nccl:
//   mpirun -np 2 scripts/nccl-share-gpu.sh build/bin/test_nccl
#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>
#include <numeric>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"
#include "comm/nccl/nccl_communicator.hpp"
#include "runtime/select.hpp"

using namespace tessera;

namespace {

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local = 0, locals = 1;
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &locals);
    MPI_Comm_free(&node);
    // As tessera-train --ranks-per-gpu N places them: local rank r on GPU r % GPUs.
    cuda::set_device(choose_gpu(local, locals, cuda::device_count(), "this node", locals));
    be_ = make_cuda_backend();
  }
  Tensor dev(const std::vector<float>& v) {
    Tensor t({static_cast<int64_t>(v.size())}, DType::F32, be_->allocator());
    be_->copy_from_host(t, v.data());
    return t;
  }
  std::vector<float> host(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    be_->copy_to_host(v.data(), t);
    return v;
  }
  // Rank r's value at element i: distinct per rank and element, exact in f32 sums.
  static float value(int r, int64_t i) { return float((r + 1) * 1000 + i % 997); }
  std::unique_ptr<Communicator> comm(MPI_Comm group) {
    return make_nccl_communicator(group, be_->stream());
  }
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Backend> be_;
};

TEST_F(Nccl, AllReduceOnTwoCommunicators) {
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  auto a = comm(MPI_COMM_WORLD), b = comm(dup);
  ASSERT_EQ(a->size(), size_);
  const int64_t n = 1 << 20;  // 4 MiB: several of NCCL's chunks
  std::vector<float> mine(static_cast<size_t>(n)), want(static_cast<size_t>(n), 0.f);
  for (int64_t i = 0; i < n; ++i) {
    mine[size_t(i)] = value(rank_, i);
    for (int r = 0; r < size_; ++r) want[size_t(i)] += value(r, i);
  }
  Tensor x = dev(mine), y = dev(mine);
  a->all_reduce(x, ReduceOp::Sum);
  auto op = b->all_reduce_async(y, ReduceOp::Sum);  // on the second communicator, overlapping
  op->wait();
  EXPECT_EQ(host(x), want);
  EXPECT_EQ(host(y), want);
  Tensor m = dev(mine);
  a->all_reduce(m, ReduceOp::Max);
  EXPECT_EQ(host(m)[0], value(size_ - 1, 0));
  double d[2] = {double(rank_), 1.0};
  b->all_reduce_f64(d, 2, ReduceOp::Sum);
  EXPECT_EQ(d[1], double(size_));
  a.reset();
  b.reset();
  MPI_Comm_free(&dup);
}

TEST_F(Nccl, GathersReduceScattersAndTheirInPlaceForms) {
  auto c = comm(MPI_COMM_WORLD);
  const int64_t block = 4099;  // not a multiple of anything
  std::vector<float> mine(static_cast<size_t>(block));
  for (int64_t i = 0; i < block; ++i) mine[size_t(i)] = value(rank_, i);
  Tensor in = dev(mine), out({block * size_}, DType::F32, be_->allocator());
  c->all_gather(out, in);
  std::vector<float> got = host(out);
  for (int r = 0; r < size_; ++r)
    for (int64_t i = 0; i < block; i += 97)
      ASSERT_EQ(got[size_t(r * block + i)], value(r, i)) << "all_gather, rank " << r;
  // reduce_scatter: block `rank` of the sum of every rank's (size x block) input.
  std::vector<float> whole(static_cast<size_t>(block * size_));
  for (int64_t i = 0; i < block * size_; ++i) whole[size_t(i)] = value(rank_, i);
  Tensor w = dev(whole), mineblock({block}, DType::F32, be_->allocator());
  c->reduce_scatter(mineblock, w);
  got = host(mineblock);
  for (int64_t i = 0; i < block; i += 89) {
    float s = 0;
    for (int r = 0; r < size_; ++r) s += value(r, rank_ * block + i);
    ASSERT_EQ(got[size_t(i)], s) << "reduce_scatter at " << i;
  }
  // In place (the distributed optimizer's): reduce-scatter, then each rank's block to every rank.
  Tensor buf = dev(whole);
  c->reduce_scatter_async(buf)->wait();
  c->all_gather_async(buf)->wait();
  got = host(buf);
  for (int64_t i = 0; i < block * size_; i += 101) {
    float s = 0;
    for (int r = 0; r < size_; ++r) s += value(r, i);
    ASSERT_EQ(got[size_t(i)], s) << "in-place reduce-scatter + all-gather at " << i;
  }
  Tensor bc = dev(mine);
  c->broadcast(bc, size_ - 1);
  EXPECT_EQ(host(bc)[5], value(size_ - 1, 5));
}

TEST_F(Nccl, RingSendRecvAndAllToAll) {
  auto c = comm(MPI_COMM_WORLD);
  const int64_t n = 3001;
  std::vector<float> mine(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) mine[size_t(i)] = value(rank_, i);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  Tensor s = dev(mine), r({n}, DType::F32, be_->allocator());
  c->send_recv_async(s, next, r, prev, 7)->wait();  // context parallelism's ring
  EXPECT_EQ(host(r)[11], value(prev, 11));
  if (size_ > 1) {  // pipeline's pair: rank 0 sends to 1
    Tensor p = dev(mine);
    if (rank_ == 0) c->send_async(p, 1, 3)->wait();
    if (rank_ == 1) {
      c->recv(p, 0, 3);
      EXPECT_EQ(host(p)[13], value(0, 13));
    }
  }
  // All-to-all of rows (MoE's dispatch): rank r sends p + r + 1 rows of 5 elements to rank p.
  const int64_t row = 5;
  std::vector<int64_t> send_rows(static_cast<size_t>(size_)), recv_rows(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) send_rows[size_t(p)] = p + rank_ + 1;
  for (int p = 0; p < size_; ++p) recv_rows[size_t(p)] = rank_ + p + 1;
  const int64_t sent = std::accumulate(send_rows.begin(), send_rows.end(), int64_t(0));
  const int64_t got_rows = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t(0));
  std::vector<float> out(static_cast<size_t>(sent * row));
  for (int64_t i = 0; i < sent * row; ++i) out[size_t(i)] = value(rank_, i);
  Tensor send = dev(out), recv({got_rows * row}, DType::F32, be_->allocator());
  c->all_to_all(send, send_rows, recv, recv_rows, row);
  const std::vector<float> in = host(recv);
  int64_t at = 0;
  for (int p = 0; p < size_; ++p) {  // rank p's rows for me start after its rows to ranks < me
    int64_t offset = 0;
    for (int q = 0; q < rank_; ++q) offset += q + p + 1;
    EXPECT_EQ(in[size_t(at * row)], value(p, offset * row)) << "rows from rank " << p;
    at += recv_rows[size_t(p)];
  }
}

}  // namespace
