// nccl_communicator.cpp: the NCCL implementation of Communicator.
#include "comm/nccl/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device.hpp"
#include "comm/mpi/mpi.hpp"
#include "comm/mpi/mpi_check.hpp"
#include "comm/nccl/nccl_check.hpp"
#include "core/nvtx.hpp"
#include "core/test_hooks.hpp"

namespace tessera {

namespace {

ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::Sum ? ncclSum : ncclMax;
}

void expect_device_f32(const Tensor& t) {
  TESSERA_CHECK(t.device() == Device::CUDA && (t.dtype() == DType::F32 ||
                                               t.dtype() == DType::BF16 || t.dtype() == DType::F16),
                "the NCCL communicator moves device f32/bf16/f16 tensors (got ",
                device_name(t.device()), " ", dtype_name(t.dtype()), ")");
}

ncclDataType_t nccl_type(const Tensor& t) {
  return t.dtype() == DType::F32 ? ncclFloat : t.dtype() == DType::BF16 ? ncclBfloat16 : ncclHalf;
}

// Completion of work enqueued on the communication stream. wait() orders the compute stream
// after it (the device waits, not the host) and blocks the host too, so buffers the host hands
// back (pipeline sends) are free to reuse either way.
class EventPending final : public PendingOp {
 public:
  EventPending(cudaStream_t comm, cudaStream_t compute) : compute_(compute) {
    CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ev_, comm));
  }
  ~EventPending() override {
    if (!done_) cudaEventSynchronize(ev_);
    cudaEventDestroy(ev_);
  }
  void wait() override {
    if (done_) return;
    CUDA_CHECK(cudaStreamWaitEvent(compute_, ev_, 0));
    CUDA_CHECK(cudaEventSynchronize(ev_));
    done_ = true;
  }
  void wait_device() override {  // the event is released once it completes
    if (done_) return;
    CUDA_CHECK(cudaStreamWaitEvent(compute_, ev_, 0));
    done_ = true;
  }
  bool test() override {
    if (done_) return true;
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) return false;
    CUDA_CHECK(e);
    return true;
  }

 private:
  cudaStream_t compute_;
  cudaEvent_t ev_ = nullptr;
  bool done_ = false;
};

// Collectives run on the communicator's own stream. Each one first waits (on the device) for the
// work already queued on the compute stream, so it sees the tensor the backend just wrote; the
// blocking forms then make the compute stream wait for the collective, so the backend's next op
// sees its result. The host never blocks except where a result must be on the host.
class NcclCommunicator final : public Communicator {
 public:
  // `trace`: the process grid's group (comm/mpi/collective_trace.hpp). Its collectives are counted
  // as they are issued (the host does not wait in them: a hang shows as members behind in the
  // count); host waits (all_reduce_f64, barrier) are marked.
  NcclCommunicator(MPI_Comm group, cudaStream_t compute, TraceGroup trace)
      : group_(group), compute_(compute) {
    MPI_CHECK(MPI_Comm_rank(group, &rank_));
    MPI_CHECK(MPI_Comm_size(group, &size_));
    if (trace != TraceGroup::None) trace_ = TraceHandle(trace, world_ranks_of(group));
    ncclUniqueId id;
    if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, group));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  }
  ~NcclCommunicator() override {  // reverse order of creation
    if (comm_) ncclCommDestroy(comm_);
    cudaEventDestroy(done_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce(Tensor& t, ReduceOp op) override {
    NVTX_RANGE("nccl-all-reduce");
    expect_device_f32(t);
    after_compute();
    trace_.issue(TraceOp::AllReduce);
    NCCL_CHECK(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t),
                             nccl_op(op), comm_, stream_));
    before_compute();
  }
  std::unique_ptr<PendingOp> all_reduce_async(Tensor& t, ReduceOp op) override {
    NVTX_RANGE("nccl-all-reduce-async");
    expect_device_f32(t);
    after_compute();
    trace_.issue(TraceOp::AllReduce);
    NCCL_CHECK(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t),
                             nccl_op(op), comm_, stream_));
    return std::make_unique<EventPending>(stream_, compute_);
  }
  void all_reduce_f64(double* data, int64_t n, ReduceOp op) override {
    const TraceWait traced(&trace_, TraceOp::AllReduce, trace_.issue(TraceOp::AllReduce));
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_DOUBLE,
                            op == ReduceOp::Sum ? MPI_SUM : MPI_MAX, group_));
  }
  void broadcast(Tensor& t, int root) override {
    NVTX_RANGE("nccl-broadcast");
    expect_device_f32(t);
    after_compute();
    trace_.issue(TraceOp::Broadcast);
    NCCL_CHECK(ncclBroadcast(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t), root,
                             comm_, stream_));
    before_compute();
  }
  void all_gather(Tensor& out, const Tensor& in) override {
    NVTX_RANGE("nccl-all-gather");
    expect_device_f32(in);
    expect_device_f32(out);
    TESSERA_CHECK(out.numel() == in.numel() * size_, "all_gather output size");
    after_compute();
    trace_.issue(TraceOp::AllGather);
    NCCL_CHECK(ncclAllGather(in.raw(), out.raw(), static_cast<size_t>(in.numel()), nccl_type(in),
                             comm_, stream_));
    before_compute();
  }
  void reduce_scatter(Tensor& out, const Tensor& in) override {
    NVTX_RANGE("nccl-reduce-scatter");
    expect_device_f32(in);
    expect_device_f32(out);
    TESSERA_CHECK(in.numel() == out.numel() * size_, "reduce_scatter input size");
    after_compute();
    trace_.issue(TraceOp::ReduceScatter);
    NCCL_CHECK(ncclReduceScatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()),
                                 nccl_type(in), ncclSum, comm_, stream_));
    before_compute();
  }
  std::unique_ptr<PendingOp> reduce_scatter_async(Tensor& buf) override {
    NVTX_RANGE("nccl-reduce-scatter-async");
    const Blocks b = blocks_of(buf);
    after_compute();  // in place: the output is this rank's block of the input
    trace_.issue(TraceOp::ReduceScatter);
    NCCL_CHECK(ncclReduceScatter(b.base, b.mine, b.count, nccl_type(buf), ncclSum, comm_, stream_));
    return std::make_unique<EventPending>(stream_, compute_);
  }
  std::unique_ptr<PendingOp> all_gather_async(Tensor& buf) override {
    NVTX_RANGE("nccl-all-gather-async");
    const Blocks b = blocks_of(buf);
    after_compute();  // in place: the input is this rank's block of the output
    trace_.issue(TraceOp::AllGather);
    NCCL_CHECK(ncclAllGather(b.mine, b.base, b.count, nccl_type(buf), comm_, stream_));
    return std::make_unique<EventPending>(stream_, compute_);
  }
  std::unique_ptr<PendingOp> send_async(const Tensor& t, int peer, int) override {
    NVTX_RANGE("nccl-send");
    expect_device_f32(t);
    after_compute();
    NCCL_CHECK(
        ncclSend(t.raw(), static_cast<size_t>(t.numel()), nccl_type(t), peer, comm_, stream_));
    return std::make_unique<EventPending>(stream_, compute_);
  }
  void recv(Tensor& t, int peer, int) override {
    NVTX_RANGE("nccl-recv");
    expect_device_f32(t);
    after_compute();
    NCCL_CHECK(
        ncclRecv(t.raw(), static_cast<size_t>(t.numel()), nccl_type(t), peer, comm_, stream_));
    before_compute();
  }
  std::unique_ptr<PendingOp> send_recv_async(const Tensor& send, int to, Tensor& recv, int from,
                                             int) override {
    NVTX_RANGE("nccl-send-recv");
    expect_device_f32(send);
    expect_device_f32(recv);
    after_compute();
    NCCL_CHECK(ncclGroupStart());
    NCCL_CHECK(ncclSend(send.raw(), static_cast<size_t>(send.numel()), nccl_type(send), to, comm_,
                        stream_));
    NCCL_CHECK(ncclRecv(recv.raw(), static_cast<size_t>(recv.numel()), nccl_type(recv), from, comm_,
                        stream_));
    NCCL_CHECK(ncclGroupEnd());
    return std::make_unique<EventPending>(stream_, compute_);
  }
  void barrier() override {
    const TraceWait traced(&trace_, TraceOp::Barrier, trace_.issue(TraceOp::Barrier));
    MPI_CHECK(MPI_Barrier(group_));
  }
  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows, int64_t row_elems) override {
    NVTX_RANGE("nccl-all-to-all");
    expect_device_f32(send);
    expect_device_f32(recv);
    check_all_to_all(send, send_rows, recv, recv_rows, row_elems, size_);
    trace_.issue(TraceOp::AllToAll);
    const size_t width = dtype_size(send.dtype()) * static_cast<size_t>(row_elems);
    after_compute();
    NCCL_CHECK(ncclGroupStart());
    int64_t so = 0, ro = 0;
    for (int p = 0; p < size_; ++p) {
      const int64_t s = send_rows[static_cast<size_t>(p)], r = recv_rows[static_cast<size_t>(p)];
      if (s > 0)
        NCCL_CHECK(ncclSend(static_cast<const char*>(send.raw()) + so * width,
                            static_cast<size_t>(s * row_elems), nccl_type(send), p, comm_,
                            stream_));
      if (r > 0)
        NCCL_CHECK(ncclRecv(static_cast<char*>(recv.raw()) + ro * width,
                            static_cast<size_t>(r * row_elems), nccl_type(recv), p, comm_,
                            stream_));
      so += s;
      ro += r;
    }
    NCCL_CHECK(ncclGroupEnd());
    before_compute();
  }

 private:
  // `buf` cut into size_ equal blocks (the in-place collectives): its start, this rank's block
  // and the elements per block.
  struct Blocks {
    char *base, *mine;
    size_t count;
  };
  Blocks blocks_of(Tensor& buf) const {
    expect_device_f32(buf);
    TESSERA_CHECK(buf.numel() % size_ == 0, "in-place collective over ", buf.numel(),
                  " elements, not divisible by the group size ", size_);
    const size_t count = static_cast<size_t>(buf.numel() / size_);
    char* base = static_cast<char*>(buf.raw());
    return {base, base + count * dtype_size(buf.dtype()) * rank_, count};
  }
  // The communication stream waits for everything queued on the compute stream so far.
  // The test hooks' delays (core/test_hooks.hpp): the collective late, or the compute stream's
  // next work late.
  void after_compute() {
    CUDA_CHECK(cudaEventRecord(ready_, compute_));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    cuda::sleep_on_stream(stream_, test_hooks::delay_comm_us());
    cuda::sleep_on_stream(compute_, test_hooks::delay_compute_us());
  }
  // The compute stream waits for the collective just queued.
  void before_compute() {
    CUDA_CHECK(cudaEventRecord(done_, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(compute_, done_, 0));
  }

  MPI_Comm group_;
  cudaStream_t compute_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  ncclComm_t comm_ = nullptr;
  TraceHandle trace_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm group, void* compute_stream,
                                                     TraceGroup trace) {
  TESSERA_CHECK(compute_stream != nullptr, "make_nccl_communicator needs the compute stream");
  return std::make_unique<NcclCommunicator>(group, static_cast<cudaStream_t>(compute_stream),
                                            trace);
}

}  // namespace tessera
