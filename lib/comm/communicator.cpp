// communicator.cpp: the one-rank communicator.
#include "comm/communicator.hpp"

namespace tessera {

namespace {
class DonePending final : public PendingOp {
 public:
  void wait() override {}
  bool test() override { return true; }
};
}  // namespace

std::unique_ptr<PendingOp> LocalCommunicator::all_reduce_async(Tensor&, ReduceOp) {
  return std::make_unique<DonePending>();
}
std::unique_ptr<PendingOp> LocalCommunicator::reduce_scatter_async(Tensor&) {
  return std::make_unique<DonePending>();
}
std::unique_ptr<PendingOp> LocalCommunicator::all_gather_async(Tensor&) {
  return std::make_unique<DonePending>();
}
std::unique_ptr<PendingOp> LocalCommunicator::send_async(const Tensor&, int, int) {
  throw Error("send on a one-rank group: there is no peer (a pipeline of one stage never sends)");
}
void LocalCommunicator::recv(Tensor&, int, int) {
  throw Error(
      "recv on a one-rank group: there is no peer (a pipeline of one stage never receives)");
}
std::unique_ptr<PendingOp> LocalCommunicator::send_recv_async(const Tensor& send, int to,
                                                              Tensor& recv, int from, int) {
  TESSERA_CHECK(to == 0 && from == 0, "send_recv on a one-rank group with peers ", to, " and ",
                from);
  if (send.raw() != recv.raw()) recv.copy_from(send);
  return std::make_unique<DonePending>();
}

ParallelContext ParallelContext::single() {
  static LocalCommunicator local;
  ParallelContext c;
  c.world = c.tp = c.pp = c.dp = c.model_parallel = c.embedding = c.ep = c.edp = c.cp = &local;
  c.dp_shard = c.dp_replica = c.edp_shard = c.edp_replica = &local;
  return c;
}

void LocalCommunicator::all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows,
                                   Tensor& recv, const std::vector<int64_t>& recv_rows,
                                   int64_t row_elems) {
  check_all_to_all(send, send_rows, recv, recv_rows, row_elems, 1);
  TESSERA_CHECK(send_rows[0] == recv_rows[0], "all_to_all with oneself: rows differ");
  const int64_t n = send_rows[0] * row_elems;
  if (n > 0 && send.raw() != recv.raw()) recv.view(0, {n}).copy_from(send.view(0, {n}));
}

}  // namespace tessera
