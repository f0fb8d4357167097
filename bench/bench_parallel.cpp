// bench_parallel: communication volume and time per training step of one layout, the measured
// pipeline bubble next to the 1F1B theory (P-1)/(m+P-1), and with --sequence-parallel the
// activation memory of the regions it splits. Run it under mpirun for the layout and once on one
// rank for the reference (bench/run_parallel_bench.sh does both).
// Usage: bench_parallel TP PP [steps=5] [layers=8] [hidden=256] [seq=128] [global_batch=16]
// [micro=2] [--sequence-parallel] [--virtual-stages V] [--vocab N (8192)]
// [--num-experts E [--moe-router-topk K] [--expert-model-parallel-size EP]]
// With --num-experts every MLP is a MoE of E SwiGLU experts (top K): the bench adds the bytes
// each rank sends by all-to-all against the balanced-routing formula, and the step time of the
// dense model with the same active parameters (an MLP K experts wide) on the same ranks.
// The bubble is also printed as Megatron states it, blocked time over busy time, next to its
// theory (P-1)/(V m) for the interleaved schedule with V model chunks per rank (V = 1: 1F1B).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/timer.hpp"
#include "data/dataset.hpp"
#include "options/options.hpp"
#include "runtime/process_grid.hpp"
#include "train/rank_setup.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {
// An asynchronous collective whose completion time is added to `seconds` (the counting
// communicator's time covers the start; this its wait).
class TimedPending final : public PendingOp {
 public:
  TimedPending(std::unique_ptr<PendingOp> op, double& seconds)
      : op_(std::move(op)), seconds_(seconds) {}
  void wait() override {
    Timer w;
    op_->wait();
    seconds_ += w.seconds();
  }
  void wait_device() override {
    Timer w;
    op_->wait_device();
    seconds_ += w.seconds();
  }
  bool test() override { return op_->test(); }

 private:
  std::unique_ptr<PendingOp> op_;
  double& seconds_;
};

// Wraps a communicator and adds up the bytes each rank sends into it and the time spent inside.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : in_(inner) {}
  double bytes = 0, seconds = 0;
  int rank() const override { return in_.rank(); }
  int size() const override { return in_.size(); }
  void all_reduce(Tensor& t, ReduceOp op) override {
    Timer w;
    in_.all_reduce(t, op);
    account(t.nbytes() * ring_factor(), w);
  }
  std::unique_ptr<PendingOp> all_reduce_async(Tensor& t, ReduceOp op) override {
    Timer w;
    auto p = in_.all_reduce_async(t, op);
    account(t.nbytes() * ring_factor(), w);
    return p;
  }
  void all_reduce_f64(double* d, int64_t n, ReduceOp op) override {
    Timer w;
    in_.all_reduce_f64(d, n, op);
    account(8.0 * n * ring_factor(), w);
  }
  void broadcast(Tensor& t, int root) override { in_.broadcast(t, root); }
  void all_gather(Tensor& out, const Tensor& in) override { in_.all_gather(out, in); }
  void reduce_scatter(Tensor& out, const Tensor& in) override { in_.reduce_scatter(out, in); }
  // Ring reduce-scatter and all-gather each send (n-1)/n of the buffer.
  std::unique_ptr<PendingOp> reduce_scatter_async(Tensor& t) override {
    Timer w;
    auto p = in_.reduce_scatter_async(t);
    account(t.nbytes() * ring_factor() / 2, w);
    return std::make_unique<TimedPending>(std::move(p), seconds);
  }
  std::unique_ptr<PendingOp> all_gather_async(Tensor& t) override {
    Timer w;
    auto p = in_.all_gather_async(t);
    account(t.nbytes() * ring_factor() / 2, w);
    return std::make_unique<TimedPending>(std::move(p), seconds);
  }
  std::unique_ptr<PendingOp> send_async(const Tensor& t, int peer, int tag) override {
    Timer w;
    auto p = in_.send_async(t, peer, tag);
    account(t.nbytes(), w);
    return p;
  }
  void recv(Tensor& t, int peer, int tag) override {
    Timer w;
    in_.recv(t, peer, tag);
    seconds += w.seconds();
  }
  // Context parallelism's ring: the bytes sent; the time spent waiting is the TimedPending's.
  std::unique_ptr<PendingOp> send_recv_async(const Tensor& send, int to, Tensor& recv, int from,
                                             int tag) override {
    Timer w;
    auto p = in_.send_recv_async(send, to, recv, from, tag);
    account(send.nbytes(), w);
    return std::make_unique<TimedPending>(std::move(p), seconds);
  }
  void barrier() override { in_.barrier(); }
  // The rows this rank sends to the other ranks (its own stay).
  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, Tensor& recv,
                  const std::vector<int64_t>& recv_rows, int64_t row_elems) override {
    Timer w;
    in_.all_to_all(send, send_rows, recv, recv_rows, row_elems);
    int64_t rows = 0;
    for (int p = 0; p < size(); ++p)
      if (p != rank()) rows += send_rows[static_cast<size_t>(p)];
    account(double(rows) * row_elems * dtype_size(send.dtype()), w);
  }

 private:
  // Bytes a rank sends in a bandwidth-optimal (ring) all-reduce: 2 (n-1)/n of the buffer.
  double ring_factor() const { return size() > 1 ? 2.0 * (size() - 1) / size() : 0.0; }
  void account(double b, const Timer& w) {
    bytes += b;
    seconds += w.seconds();
  }
  Communicator& in_;
};
}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  std::vector<const char*> pos{argv[0]};
  bool sequence_parallel = false;
  int virtual_stages = 1, vocab = 8192;
  int experts = 0, topk = 2, ep = 1;  // MoE (--num-experts E --moe-router-topk K --ep EP)
  int cp = 1;                         // --context-parallel-size CP
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sequence-parallel") == 0)
      sequence_parallel = true;
    else if (std::strcmp(argv[i], "--num-experts") == 0 && i + 1 < argc)
      experts = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--moe-router-topk") == 0 && i + 1 < argc)
      topk = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--expert-model-parallel-size") == 0 && i + 1 < argc)
      ep = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--context-parallel-size") == 0 && i + 1 < argc)
      cp = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--virtual-stages") == 0 && i + 1 < argc)
      virtual_stages = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--vocab") == 0 && i + 1 < argc)
      vocab = std::atoi(argv[++i]);
    else
      pos.push_back(argv[i]);
  }
  auto arg = [&](size_t i, int def) { return pos.size() > i ? std::atoi(pos[i]) : def; };
  const int tp = arg(1, 1), pp = arg(2, 1), steps = arg(3, 5);
  GPTConfig m;
  m.num_layers = arg(4, 8);
  m.hidden_size = arg(5, 256);
  m.num_attention_heads = 8;
  m.seq_length = arg(6, 128);
  m.vocab_size = vocab;
  if (experts > 0) {  // Mixtral's MLP: SwiGLU experts of the dense width, top-k routing
    m.swiglu = true;
    m.num_experts = experts;
    m.moe_router_topk = topk;
    m.moe_aux_loss_coeff = 0.01;
  }
  TrainConfig t;
  t.global_batch_size = arg(7, 16);
  t.micro_batch_size = arg(8, 2);
  t.train_iters = steps + 1;
  t.log_interval = 1 << 30;
  t.sequence_parallel = sequence_parallel;
  t.virtual_pipeline_size = virtual_stages;
  try {
    ProcessGrid grid(tp, pp, cp);
    validate_layout(m, t, tp, pp, grid.layout().dp, cp);
    if (virtual_stages > 1) grid.use_pipeline_ring();  // as tessera-train does
    grid.use_expert_parallel(ep);
    ParallelContext ctx = grid.context();
    set_num_threads(default_threads(grid.node_comm()));
    CountingCommunicator ctp(*ctx.tp), cpp(*ctx.pp), cdp(*ctx.dp), cemb(*ctx.embedding);
    CountingCommunicator cep(*ctx.ep), cedp(*ctx.edp), ccp(*ctx.cp);
    ctx.cp = &ccp;
    ctx.ep = &cep;
    ctx.edp = ep > 1 ? &cedp : &cdp;
    ctx.tp = &ctp;
    if (ctx.pp_grad == ctx.pp) ctx.pp_grad = &cpp;  // MPI: one communicator carries both ways
    ctx.pp = &cpp;
    ctx.dp = &cdp;
    ctx.embedding = &cemb;
    // The ring's wrap-around (virtual stages) counts as pipeline traffic.
    std::unique_ptr<CountingCommunicator> cwrap, cwrap_grad;
    if (ctx.pp_wrap) {
      cwrap = std::make_unique<CountingCommunicator>(*ctx.pp_wrap);
      cwrap_grad = std::make_unique<CountingCommunicator>(*ctx.pp_wrap_grad);
      ctx.pp_wrap = cwrap.get();
      ctx.pp_wrap_grad = cwrap_grad.get();
    }
    auto pp_bytes = [&] { return cpp.bytes + (cwrap ? cwrap->bytes + cwrap_grad->bytes : 0.0); };
    auto be = make_cpu_backend();
    auto data = make_mock_dataset(m.vocab_size, m.seq_length, 1);
    Trainer tr(m, t, *be, *data, ctx);
    tr.train_step();  // warm-up
    ctp.bytes = cpp.bytes = cdp.bytes = cemb.bytes = cep.bytes = cedp.bytes = ccp.bytes = 0;
    ccp.seconds = 0;
    if (cwrap) cwrap->bytes = cwrap_grad->bytes = 0;
    ctp.seconds = cpp.seconds = cdp.seconds = cemb.seconds = 0;
    // Megatron's bubble: the schedule's wall time over all pipeline ranks (from a common start:
    // a barrier before each step) minus the ideal time (a rank's forwards and backwards without
    // waits, the mean over ranks), over the ideal time.
    double step = 0, bubble = 0;
    std::vector<double> ratios;
    for (int i = 0; i < steps; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const StepStats s = tr.train_step();
      step += s.seconds;
      bubble += s.pipeline_wait_seconds;
      double t[2] = {s.pipeline_start, -(s.pipeline_start + s.pipeline_seconds)};
      double busy = s.pipeline_seconds - s.pipeline_wait_seconds;
      MPI_Allreduce(MPI_IN_PLACE, t, 2, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, &busy, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
      busy /= grid.world_size();
      ratios.push_back((-t[1] - t[0] - busy) / busy);
    }
    std::sort(ratios.begin(), ratios.end());  // the median step: robust to a noisy one
    const double ratio = ratios[ratios.size() / 2];
    // Per-rank figures, averaged over steps; then the max over ranks (the slowest sets the pace).
    double mine[11] = {step / steps,        ctp.bytes / steps,
                       pp_bytes() / steps,  (cdp.bytes + cemb.bytes + cedp.bytes) / steps,
                       ctp.seconds / steps, (cdp.seconds + cemb.seconds) / steps,
                       bubble / step,       ratio,
                       cep.bytes / steps,   ccp.bytes / steps,
                       ccp.seconds / steps};
    double most[11], sum[11];
    MPI_Reduce(mine, most, 11, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(mine, sum, 11, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    // MoE: the same model with a dense MLP of the experts' active width (k x the expert width,
    // so the same active parameters per token), timed the same way on the same ranks.
    double dense_step = 0;
    if (experts > 0) {
      GPTConfig d = m;
      d.num_experts = 0;
      d.ffn_hidden_size = topk * m.ffn();
      ParallelContext dctx = ctx;
      dctx.ep_size = 1;
      dctx.ep_rank = 0;
      dctx.edp = dctx.dp;
      Trainer dense(d, t, *be, *data, dctx);
      dense.train_step();  // warm-up
      for (int i = 0; i < steps; ++i) {
        MPI_Barrier(MPI_COMM_WORLD);
        dense_step += dense.train_step().seconds;
      }
      dense_step /= steps;
      MPI_Allreduce(MPI_IN_PLACE, &dense_step, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
    if (grid.world_rank() == 0) {
      const int world = grid.world_size();
      const int micro = tr.num_micro_batches();
      std::printf(
          "bench_parallel: TP %d x CP %d x PP %d x DP %d (%d ranks)%s%s%s, %d layers, hidden %d, "
          "seq %d, global batch %d, micro-batch %d (%d per DP rank per step)\n",
          tp, cp, pp, ctx.dp_size, world, sequence_parallel ? " + sequence parallelism" : "",
          experts > 0 ? (", MoE " + std::to_string(experts) + " experts top-" +
                         std::to_string(topk) + " at EP " + std::to_string(ep))
                            .c_str()
                      : "",
          virtual_stages > 1 ? (" + " + std::to_string(virtual_stages) + " virtual stages").c_str()
                             : "",
          m.num_layers, m.hidden_size, m.seq_length, t.global_batch_size, t.micro_batch_size,
          micro);
      std::printf("%-46s %14s\n", "figure (per step)", "value");
      std::printf("%-46s %14.1f\n", "step time, slowest rank (ms)", most[0] * 1e3);
      std::printf("%-46s %14.0f\n", "tokens/s",
                  t.global_batch_size * double(m.seq_length) / most[0]);
      std::printf("%-46s %14.3f\n",
                  sequence_parallel ? "TP all-gather + reduce-scatter MB per rank (mean)"
                                    : "TP all-reduce MB sent per rank (mean)",
                  sum[1] / world / 1e6);
      std::printf("%-46s %14.3f\n", "PP p2p MB sent per rank (mean)", sum[2] / world / 1e6);
      std::printf("%-46s %14.3f\n", "DP + embedding all-reduce MB per rank (mean)",
                  sum[3] / world / 1e6);
      std::printf("%-46s %14.1f\n", "TP collective time per rank (ms, mean)", sum[4] / world * 1e3);
      std::printf("%-46s %14.1f\n", "DP wait after backward (ms, mean)", sum[5] / world * 1e3);
      std::printf("%-46s %13.1f%%\n", "pipeline bubble measured (mean over ranks)",
                  100.0 * sum[6] / world);
      std::printf("%-46s %13.1f%%\n", "pipeline bubble theory (P-1)/(m+P-1)",
                  100.0 * theoretical_bubble(pp, micro));
      std::printf("%-46s %13.1f%%\n", "bubble / ideal time measured (median step)",
                  100.0 * most[7]);
      std::printf("%-46s %13.1f%%\n", "bubble / ideal time theory (P-1)/(V m)",
                  100.0 * theoretical_bubble_ratio(pp, micro, virtual_stages));
      if (experts > 0) {
        // Balanced routing: of a micro-batch's N*K token copies, (EP-1)/EP leave for other EP
        // ranks; dispatch and combine, forward and backward: 4 all-to-alls per MoE layer.
        const double N = double(t.micro_batch_size) * m.seq_length;
        const double formula =
            4.0 * m.num_layers * micro * N * topk * (ep - 1) / ep * m.hidden_size * 4.0;
        std::printf("%-46s %14.3f\n", "MoE all-to-all MB sent per rank (mean)",
                    sum[8] / world / 1e6);
        std::printf("%-46s %14.3f\n", "  formula, balanced routing 4 L m N K (EP-1)/EP C 4",
                    formula / 1e6);
        std::printf("%-46s %14.1f\n", "dense step, same active parameters (ms)", dense_step * 1e3);
        std::printf("%-46s %14.2f\n", "MoE step / dense step", most[0] / dense_step);
        std::printf("%-46s %14lld / %lld\n", "parameters total / active per token",
                    (long long)m.num_parameters(), (long long)m.num_active_parameters());
      }
      if (cp > 1) {
        // The ring per layer per micro-batch (run/context_parallel.hpp cp_ring_traffic), over the
        // stage's layers and the step's micro-batches.
        const RingTraffic ring = cp_ring_traffic(m, t, tp, cp);
        const double formula = ring.per_layer() * (m.num_layers / pp) * micro;
        std::printf("%-46s %14.3f\n", "CP ring MB sent per rank (mean)", sum[9] / world / 1e6);
        std::printf("%-46s %14.3f\n", "  formula (3 CP - 2) K/V blocks x L/PP x m", formula / 1e6);
        std::printf("%-46s %14.1f\n", "CP ring time inside sends/waits (ms, mean)",
                    sum[10] / world * 1e3);
      }
      const MemoryEstimate e =
          estimate_rank_memory(m, t, GridLayout::make(world, tp, pp, cp), 0, ep);
      std::printf("%-46s %14.3f\n", "activations kept per layer per micro-batch MiB",
                  e.activation_layer_bytes / (1024.0 * 1024.0));
      if (tp > 1)
        std::printf("%-46s %14.3f\n",
                    sequence_parallel ? "  of it LN/dropout/residual regions MiB"
                                      : "  of it LN/dropout/residual MiB (SP: / TP)",
                    e.sp_region_layer_bytes / (1024.0 * 1024.0));
    }
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
  return 0;
}
