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
ParallelContext ParallelContext::single() {
  static LocalCommunicator local;
  ParallelContext c;
  c.world = c.tp = c.pp = c.dp = c.model_parallel = c.embedding = c.ep = c.edp = &local;
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
