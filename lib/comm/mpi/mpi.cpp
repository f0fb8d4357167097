// mpi.cpp: MPI runtime, communicator handles and host collectives.
#include "comm/mpi/mpi.hpp"

#include "core/nvtx.hpp"

#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "comm/mpi/mpi_check.hpp"

namespace tessera {

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  try {
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    if (!initialized) {
      // A process started without mpirun or srun is an Open MPI "singleton", which forks a local
      // daemon (orted) before MPI_Init returns: 0.2 s and one more process per start. Tessera never
      // spawns processes, so it needs none (Open MPI 4.1; other MPIs ignore the variable, and an
      // explicit setting wins).
      setenv("OMPI_MCA_ess_singleton_isolated", "1", 0);
      int provided = 0;
      // MULTIPLE: the watchdog thread sends heartbeats while the main thread is in a collective.
      MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
      owns_ = true;
    }
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  } catch (const std::exception& e) {
    abort_job(std::string("MPI start-up failed: ") + e.what());
  }
}

MpiRuntime::~MpiRuntime() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

void abort_job(const std::string& message, int exit_code) {
  int initialized = 0, finalized = 0, rank = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::fprintf(stderr, "rank %d (%s): error: %s\n", rank, host, message.c_str());
  std::fflush(stderr);
  int size = 1;
  if (initialized && !finalized) MPI_Comm_size(MPI_COMM_WORLD, &size);
  // One rank: nothing to bring down, and MPI_Abort would add Open MPI's banner to the one line.
  // (No MPI_Finalize either: another thread, the watchdog's, may be inside MPI.)
  if (initialized && !finalized && size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

MpiComm& MpiComm::operator=(MpiComm&& o) noexcept {
  if (this != &o) {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = o.comm_;
    o.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

int MpiComm::rank() const {
  int r = 0;
  MPI_CHECK(MPI_Comm_rank(comm_, &r));
  return r;
}
int MpiComm::size() const {
  int s = 0;
  MPI_CHECK(MPI_Comm_size(comm_, &s));
  return s;
}

namespace {

MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
}

int count_of(const Tensor& t) {
  TESSERA_CHECK(t.numel() <= INT_MAX, "MPI message of ", t.numel(), " elements exceeds INT_MAX");
  return static_cast<int>(t.numel());
}

void expect_host_float(const Tensor& t) {
  TESSERA_CHECK(t.device() == Device::CPU && (t.dtype() == DType::F32 || t.dtype() == DType::BF16 ||
                                              t.dtype() == DType::F16),
                "the MPI communicator moves host f32/bf16/f16 tensors (got ",
                device_name(t.device()), " ", dtype_name(t.dtype()), ")");
}

MPI_Datatype mpi_type(const Tensor& t) {
  return t.dtype() == DType::F32 ? MPI_FLOAT : MPI_UINT16_T;  // bf16 / f16: 2-byte words
}

// bf16 and f16 reductions as MPI user operations: each element in f32, rounded back once.
template <float (*Load)(uint16_t), uint16_t (*Store)(float), bool Max>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = Load(a[i]), y = Load(b[i]);
    b[i] = Store(Max ? (x > y ? x : y) : x + y);
  }
}
uint16_t to_bf16(float f) {
  return f32_to_bf16(f);
}
float from_bf16(uint16_t h) {
  return bf16_to_f32(h);
}
uint16_t to_f16(float f) {
  return f32_to_f16(f);
}
float from_f16(uint16_t h) {
  return f16_to_f32(h);
}
MPI_Op make_op(MPI_User_function* f) {
  MPI_Op op;
  MPI_CHECK(MPI_Op_create(f, 1, &op));
  return op;
}

MPI_Op reduce_op(const Tensor& t, ReduceOp op) {
  if (t.dtype() == DType::F32) return mpi_op(op);
  static const MPI_Op bf16_sum = make_op(&half_op<from_bf16, to_bf16, false>);
  static const MPI_Op bf16_max = make_op(&half_op<from_bf16, to_bf16, true>);
  static const MPI_Op f16_sum = make_op(&half_op<from_f16, to_f16, false>);
  static const MPI_Op f16_max = make_op(&half_op<from_f16, to_f16, true>);
  if (t.dtype() == DType::BF16) return op == ReduceOp::Sum ? bf16_sum : bf16_max;
  return op == ReduceOp::Sum ? f16_sum : f16_max;
}

// What a pending operation's wait marks in the collective trace (values: the operation may
// outlive its communicator).
struct TraceMark {
  TraceGroup group = TraceGroup::None;
  TraceOp op = TraceOp::None;
  int64_t seq = 0;
  int world_peer = -1;
  TraceMark() = default;
  TraceMark(const TraceHandle& h, TraceOp o, int64_t s, int peer = -1)
      : group(h.group()), op(o), seq(s), world_peer(peer >= 0 ? h.world_rank_of(peer) : -1) {}
};

class MpiPending final : public PendingOp {
 public:
  // `then` runs once, on the host, when the request is complete.
  explicit MpiPending(MPI_Request r, TraceMark mark = {}, std::function<void()> then = {})
      : req_(r), mark_(mark), then_(std::move(then)) {}
  ~MpiPending() override {
    if (req_ != MPI_REQUEST_NULL) {
      const TraceWait w(mark_.group, mark_.op, mark_.seq, mark_.world_peer);
      MPI_Wait(&req_, MPI_STATUS_IGNORE);
    }
    complete();
  }
  void wait() override {
    {
      const TraceWait w(mark_.group, mark_.op, mark_.seq, mark_.world_peer);
      MPI_CHECK(MPI_Wait(&req_, MPI_STATUS_IGNORE));
    }
    complete();
  }
  bool test() override {
    int done = 0;
    MPI_CHECK(MPI_Test(&req_, &done, MPI_STATUS_IGNORE));
    if (done) complete();
    return done != 0;
  }

 private:
  void complete() {
    if (!then_) return;
    auto f = std::move(then_);
    then_ = nullptr;
    f();
  }
  MPI_Request req_;
  TraceMark mark_;
  std::function<void()> then_;
};

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, TraceGroup trace) : comm_(comm) {
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
  if (trace != TraceGroup::None) trace_ = TraceHandle(trace, world_ranks_of(comm_));
}

void MpiCommunicator::all_reduce(Tensor& t, ReduceOp op) {
  NVTX_RANGE("mpi-all-reduce");
  expect_host_float(t);
  if (size_ == 1) return;
  trace_.log(TraceOp::AllReduce, t.numel(), dtype_size(t.dtype()));
  const TraceWait traced(&trace_, TraceOp::AllReduce, trace_.issue(TraceOp::AllReduce), -1);
  MPI_CHECK(
      MPI_Allreduce(MPI_IN_PLACE, t.raw(), count_of(t), mpi_type(t), reduce_op(t, op), comm_));
}

std::unique_ptr<PendingOp> MpiCommunicator::all_reduce_async(Tensor& t, ReduceOp op) {
  NVTX_RANGE("mpi-all-reduce-async");
  expect_host_float(t);
  MPI_Request req = MPI_REQUEST_NULL;
  if (size_ > 1) trace_.log(TraceOp::AllReduce, t.numel(), dtype_size(t.dtype()));
  if (size_ > 1)
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, t.raw(), count_of(t), mpi_type(t), reduce_op(t, op),
                             comm_, &req));
  return std::make_unique<MpiPending>(
      req, TraceMark(trace_, TraceOp::AllReduce, trace_.issue(TraceOp::AllReduce)));
}

void MpiCommunicator::all_reduce_f64(double* data, int64_t n, ReduceOp op) {
  NVTX_RANGE("mpi-all-reduce-f64");
  if (size_ == 1) return;
  const TraceWait traced(&trace_, TraceOp::AllReduce, trace_.issue(TraceOp::AllReduce), -1);
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_DOUBLE, mpi_op(op), comm_));
}

void MpiCommunicator::broadcast(Tensor& t, int root) {
  NVTX_RANGE("mpi-broadcast");
  expect_host_float(t);
  if (size_ > 1) trace_.log(TraceOp::Broadcast, t.numel(), dtype_size(t.dtype()));
  const TraceWait traced(&trace_, TraceOp::Broadcast, trace_.issue(TraceOp::Broadcast), -1);
  MPI_CHECK(MPI_Bcast(t.raw(), count_of(t), mpi_type(t), root, comm_));
}

void MpiCommunicator::all_gather(Tensor& out, const Tensor& in) {
  NVTX_RANGE("mpi-all-gather");
  expect_host_float(in);
  TESSERA_CHECK(out.numel() == in.numel() * size_, "all_gather output of ", out.numel(),
                " elements for ", size_, " x ", in.numel());
  TESSERA_CHECK(out.dtype() == in.dtype(), "all_gather dtypes differ");
  if (size_ > 1) trace_.log(TraceOp::AllGather, out.numel(), dtype_size(out.dtype()));
  const TraceWait traced(&trace_, TraceOp::AllGather, trace_.issue(TraceOp::AllGather), -1);
  MPI_CHECK(MPI_Allgather(in.raw(), count_of(in), mpi_type(in), out.raw(), count_of(in),
                          mpi_type(in), comm_));
}

void MpiCommunicator::reduce_scatter(Tensor& out, const Tensor& in) {
  NVTX_RANGE("mpi-reduce-scatter");
  expect_host_float(in);
  TESSERA_CHECK(in.numel() == out.numel() * size_, "reduce_scatter input of ", in.numel(),
                " elements for ", size_, " x ", out.numel());
  TESSERA_CHECK(out.dtype() == in.dtype(), "reduce_scatter dtypes differ");
  if (size_ > 1) trace_.log(TraceOp::ReduceScatter, in.numel(), dtype_size(in.dtype()));
  const TraceWait traced(&trace_, TraceOp::ReduceScatter, trace_.issue(TraceOp::ReduceScatter), -1);
  MPI_CHECK(MPI_Reduce_scatter_block(in.raw(), out.raw(), count_of(out), mpi_type(in),
                                     reduce_op(in, ReduceOp::Sum), comm_));
}

std::unique_ptr<PendingOp> MpiCommunicator::reduce_scatter_async(Tensor& buf) {
  NVTX_RANGE("mpi-reduce-scatter-async");
  expect_host_float(buf);
  TESSERA_CHECK(buf.numel() % size_ == 0, "reduce_scatter_async over ", buf.numel(),
                " elements, not divisible by the group size ", size_);
  if (size_ == 1) return std::make_unique<MpiPending>(MPI_REQUEST_NULL);
  trace_.log(TraceOp::ReduceScatter, buf.numel(), dtype_size(buf.dtype()));
  const int count = static_cast<int>(buf.numel() / size_);
  MPI_Request req = MPI_REQUEST_NULL;
  // MPI_IN_PLACE leaves the result at the start of the buffer; it moves to this rank's block.
  MPI_CHECK(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buf.raw(), count, mpi_type(buf),
                                      reduce_op(buf, ReduceOp::Sum), comm_, &req));
  const TraceMark mark(trace_, TraceOp::ReduceScatter, trace_.issue(TraceOp::ReduceScatter));
  if (rank_ == 0) return std::make_unique<MpiPending>(req, mark);
  char* base = static_cast<char*>(buf.raw());
  const size_t bytes = static_cast<size_t>(count) * dtype_size(buf.dtype());
  const size_t to = bytes * static_cast<size_t>(rank_);
  return std::make_unique<MpiPending>(req, mark,
                                      [base, bytes, to] { std::memmove(base + to, base, bytes); });
}

std::unique_ptr<PendingOp> MpiCommunicator::all_gather_async(Tensor& buf) {
  NVTX_RANGE("mpi-all-gather-async");
  expect_host_float(buf);
  TESSERA_CHECK(buf.numel() % size_ == 0, "all_gather_async over ", buf.numel(),
                " elements, not divisible by the group size ", size_);
  MPI_Request req = MPI_REQUEST_NULL;
  if (size_ > 1) trace_.log(TraceOp::AllGather, buf.numel(), dtype_size(buf.dtype()));
  if (size_ > 1)
    MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf.raw(),
                             static_cast<int>(buf.numel() / size_), mpi_type(buf), comm_, &req));
  return std::make_unique<MpiPending>(
      req, TraceMark(trace_, TraceOp::AllGather, trace_.issue(TraceOp::AllGather)));
}

std::unique_ptr<PendingOp> MpiCommunicator::send_async(const Tensor& t, int peer, int tag) {
  NVTX_RANGE("mpi-send");
  expect_host_float(t);
  MPI_Request req = MPI_REQUEST_NULL;
  trace_.log(TraceOp::Send, t.numel(), dtype_size(t.dtype()), peer);
  MPI_CHECK(MPI_Isend(t.raw(), count_of(t), mpi_type(t), peer, tag, comm_, &req));
  return std::make_unique<MpiPending>(req, TraceMark(trace_, TraceOp::Send, 0, peer));
}

namespace {
// Two requests (a send and a receive) completed together.
class MpiPendingPair final : public PendingOp {
 public:
  MpiPendingPair(MPI_Request a, MPI_Request b, TraceMark mark) : req_{a, b}, mark_(mark) {}
  ~MpiPendingPair() override {
    const TraceWait w(mark_.group, mark_.op, mark_.seq, mark_.world_peer);
    MPI_Waitall(2, req_, MPI_STATUSES_IGNORE);
  }
  void wait() override {
    const TraceWait w(mark_.group, mark_.op, mark_.seq, mark_.world_peer);
    MPI_CHECK(MPI_Waitall(2, req_, MPI_STATUSES_IGNORE));
  }
  bool test() override {
    int done = 0;
    MPI_CHECK(MPI_Testall(2, req_, &done, MPI_STATUSES_IGNORE));
    return done != 0;
  }

 private:
  MPI_Request req_[2];
  TraceMark mark_;  // names the rank received from
};
}  // namespace

std::unique_ptr<PendingOp> MpiCommunicator::send_recv_async(const Tensor& send, int to,
                                                            Tensor& recv, int from, int tag) {
  NVTX_RANGE("mpi-send-recv");
  expect_host_float(send);
  expect_host_float(recv);
  MPI_Request s = MPI_REQUEST_NULL, r = MPI_REQUEST_NULL;
  trace_.log(TraceOp::SendRecv, send.numel(), dtype_size(send.dtype()), to);
  MPI_CHECK(MPI_Irecv(recv.raw(), count_of(recv), mpi_type(recv), from, tag, comm_, &r));
  MPI_CHECK(MPI_Isend(send.raw(), count_of(send), mpi_type(send), to, tag, comm_, &s));
  return std::make_unique<MpiPendingPair>(s, r, TraceMark(trace_, TraceOp::SendRecv, 0, from));
}

void MpiCommunicator::recv(Tensor& t, int peer, int tag) {
  NVTX_RANGE("mpi-recv");
  expect_host_float(t);
  trace_.log(TraceOp::Recv, t.numel(), dtype_size(t.dtype()), peer);
  const TraceWait traced(&trace_, TraceOp::Recv, trace_.issue(TraceOp::Recv), peer);
  MPI_CHECK(MPI_Recv(t.raw(), count_of(t), mpi_type(t), peer, tag, comm_, MPI_STATUS_IGNORE));
}

void MpiCommunicator::barrier() {
  if (size_ > 1) trace_.log(TraceOp::Barrier, 0, 0);
  const TraceWait traced(&trace_, TraceOp::Barrier, trace_.issue(TraceOp::Barrier), -1);
  MPI_CHECK(MPI_Barrier(comm_));
}

void MpiCommunicator::all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows,
                                 Tensor& recv, const std::vector<int64_t>& recv_rows,
                                 int64_t row_elems) {
  NVTX_RANGE("mpi-all-to-all");
  expect_host_float(send);
  expect_host_float(recv);
  check_all_to_all(send, send_rows, recv, recv_rows, row_elems, size_);
  // Counts and displacements in elements of the tensors' MPI type.
  std::vector<int> sc(static_cast<size_t>(size_)), sd(sc.size()), rc(sc.size()), rd(sc.size());
  int64_t so = 0, ro = 0;
  for (int p = 0; p < size_; ++p) {
    const int64_t s = send_rows[static_cast<size_t>(p)] * row_elems;
    const int64_t r = recv_rows[static_cast<size_t>(p)] * row_elems;
    TESSERA_CHECK(so + s <= INT_MAX && ro + r <= INT_MAX,
                  "all_to_all of more than INT_MAX elements");
    sc[static_cast<size_t>(p)] = static_cast<int>(s);
    sd[static_cast<size_t>(p)] = static_cast<int>(so);
    rc[static_cast<size_t>(p)] = static_cast<int>(r);
    rd[static_cast<size_t>(p)] = static_cast<int>(ro);
    so += s;
    ro += r;
  }
  if (size_ > 1) trace_.log(TraceOp::AllToAll, so, dtype_size(send.dtype()));
  const TraceWait traced(&trace_, TraceOp::AllToAll, trace_.issue(TraceOp::AllToAll), -1);
  MPI_CHECK(MPI_Alltoallv(send.raw(), sc.data(), sd.data(), mpi_type(send), recv.raw(), rc.data(),
                          rd.data(), mpi_type(recv), comm_));
}

}  // namespace tessera
