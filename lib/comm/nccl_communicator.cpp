// nccl_communicator.cpp: the NCCL implementation of Communicator.
#include "comm/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include "backend/cuda/cuda_check.hpp"
#include "comm/mpi_check.hpp"
#include "comm/nccl_check.hpp"

namespace tessera {

namespace {

ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::Sum ? ncclSum : ncclMax;
}

void expect_device_f32(const Tensor& t) {
  TESSERA_CHECK(t.device() == Device::CUDA && t.dtype() == DType::F32,
                "the NCCL communicator moves device f32 tensors (got ", device_name(t.device()),
                " ", dtype_name(t.dtype()), ")");
}

class EventPending final : public PendingOp {
 public:
  explicit EventPending(cudaStream_t s) {
    CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ev_, s));
  }
  ~EventPending() override {
    cudaEventSynchronize(ev_);
    cudaEventDestroy(ev_);
  }
  void wait() override { CUDA_CHECK(cudaEventSynchronize(ev_)); }
  bool test() override {
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) return false;
    CUDA_CHECK(e);
    return true;
  }

 private:
  cudaEvent_t ev_ = nullptr;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm group, cudaStream_t stream) : group_(group) {
    MPI_CHECK(MPI_Comm_rank(group, &rank_));
    MPI_CHECK(MPI_Comm_size(group, &size_));
    ncclUniqueId id;
    if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, group));
    if (stream) {
      stream_ = stream;
    } else {
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      owns_stream_ = true;
    }
    NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  }
  ~NcclCommunicator() override {  // reverse order of creation
    if (comm_) ncclCommDestroy(comm_);
    if (owns_stream_) cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce(Tensor& t, ReduceOp op) override {
    all_reduce_async(t, op);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  std::unique_ptr<PendingOp> all_reduce_async(Tensor& t, ReduceOp op) override {
    expect_device_f32(t);
    NCCL_CHECK(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), ncclFloat,
                             nccl_op(op), comm_, stream_));
    return std::make_unique<EventPending>(stream_);
  }
  void all_reduce_f64(double* data, int64_t n, ReduceOp op) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_DOUBLE,
                            op == ReduceOp::Sum ? MPI_SUM : MPI_MAX, group_));
  }
  void broadcast(Tensor& t, int root) override {
    expect_device_f32(t);
    NCCL_CHECK(ncclBroadcast(t.raw(), t.raw(), static_cast<size_t>(t.numel()), ncclFloat, root,
                             comm_, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void all_gather(Tensor& out, const Tensor& in) override {
    expect_device_f32(in);
    TESSERA_CHECK(out.numel() == in.numel() * size_, "all_gather output size");
    NCCL_CHECK(ncclAllGather(in.raw(), out.raw(), static_cast<size_t>(in.numel()), ncclFloat, comm_,
                             stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void reduce_scatter(Tensor& out, const Tensor& in) override {
    expect_device_f32(in);
    TESSERA_CHECK(in.numel() == out.numel() * size_, "reduce_scatter input size");
    NCCL_CHECK(ncclReduceScatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()), ncclFloat,
                                 ncclSum, comm_, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  std::unique_ptr<PendingOp> send_async(const Tensor& t, int peer, int) override {
    expect_device_f32(t);
    NCCL_CHECK(ncclSend(t.raw(), static_cast<size_t>(t.numel()), ncclFloat, peer, comm_, stream_));
    return std::make_unique<EventPending>(stream_);
  }
  void recv(Tensor& t, int peer, int) override {
    expect_device_f32(t);
    NCCL_CHECK(ncclRecv(t.raw(), static_cast<size_t>(t.numel()), ncclFloat, peer, comm_, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void barrier() override { MPI_CHECK(MPI_Barrier(group_)); }

 private:
  MPI_Comm group_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm group, void* stream) {
  return std::make_unique<NcclCommunicator>(group, static_cast<cudaStream_t>(stream));
}

}  // namespace tessera
