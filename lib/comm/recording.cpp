// recording.cpp: the recording communicators and the grid of them (comm/recording.hpp).
#include "comm/recording.hpp"

#include <algorithm>

#include "core/dtype.hpp"

namespace tessera {

std::string CollectiveCall::line() const {
  std::string s = group + " " + op + " " + std::to_string(elements) + " " + std::to_string(bytes);
  if (peer >= 0) s += " " + std::to_string(peer);
  return s;
}

void CallRecorder::record(TraceGroup group, TraceOp op, int64_t elements, size_t bytes,
                          int world_peer) {
  if (!on) return;
  CollectiveCall c;
  c.group = trace_group_key(group);
  c.op = trace_op_name(op);
  c.elements = elements;
  c.bytes = static_cast<int>(bytes);
  c.peer = world_peer;
  c.mark = mark;
  calls.push_back(std::move(c));
}

namespace {

class RecordedOp final : public PendingOp {
 public:
  void wait() override {}
  bool test() override { return true; }
};

// One group: logs what MpiCommunicator logs (comm/mpi/mpi.cpp), under the same conditions.
class RecordingCommunicator final : public Communicator {
 public:
  RecordingCommunicator(CallRecorder& rec, TraceGroup g, int rank, std::vector<int> members)
      : rec_(rec), group_(g), rank_(rank), members_(std::move(members)) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  void all_reduce(Tensor& t, ReduceOp) override { collective(TraceOp::AllReduce, t); }
  std::unique_ptr<PendingOp> all_reduce_async(Tensor& t, ReduceOp) override {
    collective(TraceOp::AllReduce, t);
    return done();
  }
  void all_reduce_f64(double*, int64_t, ReduceOp) override {}
  void all_gather_f64(const double* mine, int64_t n, double* all) override {
    for (int r = 0; r < size(); ++r) std::copy(mine, mine + n, all + int64_t(r) * n);
  }
  void broadcast(Tensor& t, int) override { collective(TraceOp::Broadcast, t); }
  void all_gather(Tensor& out, const Tensor&) override { collective(TraceOp::AllGather, out); }
  void reduce_scatter(Tensor&, const Tensor& in) override {
    collective(TraceOp::ReduceScatter, in);
  }
  std::unique_ptr<PendingOp> reduce_scatter_async(Tensor& buf) override {
    collective(TraceOp::ReduceScatter, buf);
    return done();
  }
  std::unique_ptr<PendingOp> all_gather_async(Tensor& buf) override {
    collective(TraceOp::AllGather, buf);
    return done();
  }
  std::unique_ptr<PendingOp> send_async(const Tensor& t, int peer, int) override {
    rec_.record(group_, TraceOp::Send, t.numel(), dtype_size(t.dtype()), world(peer));
    return done();
  }
  void recv(Tensor& t, int peer, int) override {
    rec_.record(group_, TraceOp::Recv, t.numel(), dtype_size(t.dtype()), world(peer));
  }
  std::unique_ptr<PendingOp> send_recv_async(const Tensor& send, int to, Tensor&, int,
                                             int) override {
    rec_.record(group_, TraceOp::SendRecv, send.numel(), dtype_size(send.dtype()), world(to));
    return done();
  }
  void barrier() override {
    if (size() > 1) rec_.record(group_, TraceOp::Barrier, 0, 0, -1);
  }
  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor&,
                  const std::vector<int64_t>&, int64_t row_elems) override {
    int64_t rows = 0;
    for (int64_t r : send_rows) rows += r;
    if (size() > 1)
      rec_.record(group_, TraceOp::AllToAll, rows * row_elems, dtype_size(send.dtype()), -1);
  }

 private:
  void collective(TraceOp op, const Tensor& t) {
    if (size() > 1) rec_.record(group_, op, t.numel(), dtype_size(t.dtype()), -1);
  }
  int world(int peer) const {
    return peer >= 0 && peer < size() ? members_[static_cast<size_t>(peer)] : -1;
  }
  static std::unique_ptr<PendingOp> done() { return std::make_unique<RecordedOp>(); }

  CallRecorder& rec_;
  TraceGroup group_;
  int rank_;
  std::vector<int> members_;  // world ranks, in group-rank order
};

}  // namespace

Communicator* RecordingGrid::make(TraceGroup g, int rank, std::vector<int> members) {
  comms_.push_back(
      std::make_unique<RecordingCommunicator>(*recorder_, g, rank, std::move(members)));
  return comms_.back().get();
}

// ProcessGrid's splits (runtime/process_grid.cpp) as member lists: each group's world ranks in
// the order of the split's key.
RecordingGrid::RecordingGrid(const RecordingGridSpec& spec, int world_rank, CallRecorder& recorder)
    : recorder_(&recorder) {
  const GridLayout& L = spec.layout;
  const GridCoords c = L.coords(world_rank);
  const int TP = L.tp, PP = L.pp, DP = L.dp, CP = L.cp;
  const int ep = std::max(1, spec.ep), N = std::max(1, spec.instances);
  auto members = [](int n, auto&& of) {
    std::vector<int> m(static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) m[static_cast<size_t>(k)] = of(k);
    return m;
  };
  const std::vector<int> alone{world_rank};
  ParallelContext& x = ctx_;
  x.tp_size = TP, x.pp_size = PP, x.dp_size = DP, x.cp_size = CP;
  x.tp_rank = c.tp, x.pp_rank = c.pp, x.dp_rank = c.dp, x.cp_rank = c.cp;
  x.world_rank = world_rank;
  x.world = make(TraceGroup::World, world_rank, members(L.world, [](int k) { return k; }));
  x.tp = make(TraceGroup::TensorParallel, c.tp,
              members(TP, [&](int k) { return L.rank_of(k, c.pp, c.dp, c.cp); }));
  const std::vector<int> stages =
      members(PP, [&](int k) { return L.rank_of(c.tp, k, c.dp, c.cp); });
  x.pp = make(TraceGroup::Pipeline, c.pp, stages);
  x.pp_grad = spec.device ? make(TraceGroup::PipelineGrad, c.pp, stages) : x.pp;
  // The gradient group: DP x CP of the same (tp, pp), rank cp + CP * dp.
  const int dc = c.cp + CP * c.dp;
  auto grad_member = [&](int k) { return L.rank_of(c.tp, c.pp, k / CP, k % CP); };
  x.dp = make(TraceGroup::DataParallel, dc, members(DP * CP, grad_member));
  x.model_parallel =
      make(TraceGroup::ModelParallel, c.pp * TP + c.tp,
           members(TP * PP, [&](int k) { return L.rank_of(k % TP, k / TP, c.dp, c.cp); }));
  // The first and last stage of (tp, cp, dp): the embedding group, and with virtual stages the
  // pipeline's wrap-around.
  const bool in_embedding = c.pp == 0 || c.pp == PP - 1;
  const std::vector<int> ends = PP == 1 ? stages : std::vector<int>{stages.front(), stages.back()};
  const int end_rank = c.pp == 0 ? 0 : 1;
  x.embedding = in_embedding ? make(TraceGroup::Embedding, end_rank, ends)
                             : make(TraceGroup::Embedding, 0, alone);
  if (spec.pipeline_ring && PP > 1 && in_embedding) {
    x.pp_wrap = make(TraceGroup::PipelineWrap, end_rank, ends);
    x.pp_wrap_grad = make(TraceGroup::PipelineWrapGrad, end_rank, ends);
  }
  x.cp = CP > 1 ? make(TraceGroup::ContextParallel, c.cp,
                       members(CP, [&](int k) { return L.rank_of(c.tp, c.pp, c.dp, k); }))
                : make(TraceGroup::ContextParallel, 0, alone);
  // Expert parallelism: ep consecutive DP ranks split the experts; the expert-data-parallel
  // group holds the same ones (rank cp + CP * (dp / ep)).
  x.ep_size = ep;
  x.ep_rank = c.dp % ep;
  const int edp_rank = c.dp / ep;
  auto edp_member = [&](int k) { return L.rank_of(c.tp, c.pp, (k / CP) * ep + x.ep_rank, k % CP); };
  if (ep > 1) {
    x.ep = make(TraceGroup::Expert, x.ep_rank,
                members(ep, [&](int k) { return L.rank_of(c.tp, c.pp, edp_rank * ep + k, c.cp); }));
    x.edp = make(TraceGroup::ExpertData, c.cp + CP * edp_rank, members(DP / ep * CP, edp_member));
  } else {
    x.ep = make(TraceGroup::Expert, 0, alone);
    x.edp = x.dp;
  }
  // HSDP's instances: S consecutive ranks of the gradient group each, and the same rank of
  // every instance.
  x.dp_instances = N;
  if (N == 1) {
    x.dp_shard = x.dp;
    x.edp_shard = x.edp;
    x.dp_replica = x.edp_replica = make(TraceGroup::DataParallelReplica, 0, alone);
    return;
  }
  const int S = DP * CP / N;
  x.dp_shard = make(TraceGroup::DataParallelShard, dc % S,
                    members(S, [&](int k) { return grad_member(dc / S * S + k); }));
  x.dp_replica = make(TraceGroup::DataParallelReplica, dc / S,
                      members(N, [&](int j) { return grad_member(j * S + dc % S); }));
  if (ep == 1) {
    x.edp_shard = x.dp_shard;
    x.edp_replica = x.dp_replica;
    return;
  }
  const int e = c.cp + CP * edp_rank, ES = DP / ep * CP / N;
  x.edp_shard = make(TraceGroup::ExpertDataShard, e % ES,
                     members(ES, [&](int k) { return edp_member(e / ES * ES + k); }));
  x.edp_replica = make(TraceGroup::ExpertDataReplica, e / ES,
                       members(N, [&](int j) { return edp_member(j * ES + e % ES); }));
}

RecordingGrid::~RecordingGrid() = default;

}  // namespace tessera
