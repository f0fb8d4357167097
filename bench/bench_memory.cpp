// bench_memory: what activation recomputation and the distributed optimizer save and cost on the
// CPU (issue 13). For each mode -- no recomputation, selective, full (uniform, 1 layer) -- with the
// replicated and the distributed optimizer, it trains a few steps and prints this rank's peak
// host memory held in tensors (the CPU allocator's high-water mark over the Trainer's life)
// against the --dry-run estimate (target: within 10%), and the step time against the run without
// recomputation. Run it under mpirun for DP > 1 (one rank per DP replica, TP = PP = 1 unless
// given). GPU figures: bench_gpu_train --recompute=... / --max-micro-batch.
//
// Usage: [mpirun -np DP] bench_memory [layers=12] [hidden=512] [heads=8] [seq=512] [micro_batch=4]
//        [steps=2] [dtype=f32|bf16] [tp=1] [pp=1] [vocab=8192]
// (a small vocabulary so the layers' activations, not the logits, dominate as in large models)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/mpi/mpi.hpp"
#include "core/timer.hpp"
#include "data/dataset.hpp"
#include "options/options.hpp"
#include "runtime/process_grid.hpp"
#include "train/rank_setup.hpp"
#include "train/trainer.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  auto arg = [&](int i, const char* def) { return std::string(argc > i ? argv[i] : def); };
  GPTConfig m;
  m.num_layers = std::atoi(arg(1, "12").c_str());
  m.hidden_size = std::atoi(arg(2, "512").c_str());
  m.num_attention_heads = std::atoi(arg(3, "8").c_str());
  m.seq_length = std::atoi(arg(4, "512").c_str());
  m.max_position_embeddings = m.seq_length;
  m.vocab_size = std::atoll(arg(10, "8192").c_str());
  const int mbs = std::atoi(arg(5, "4").c_str()), steps = std::atoi(arg(6, "2").c_str());
  const DType dtype = dtype_from_name(arg(7, "f32"));
  const int tp = std::atoi(arg(8, "1").c_str()), pp = std::atoi(arg(9, "1").c_str());
  ProcessGrid grid(tp, pp);
  const ParallelContext ctx = grid.context();
  set_num_threads(std::max(1, affinity_cores() / std::max(1, grid.local_size())));
  const bool root = grid.world_rank() == 0;
  if (root)
    std::printf(
        "bench_memory: %d layers, hidden %d, %d heads, seq %d, vocab %lld, micro-batch %d, "
        "%s, TP %d x PP %d x DP %d; per rank (rank 0), host tensors\n",
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, (long long)m.vocab_size,
        mbs, dtype_name(dtype), grid.layout().tp, grid.layout().pp, grid.layout().dp);
  auto backend = make_cpu_backend();
  double base_ms = 0;
  for (bool dist : {false, true}) {
    for (RecomputeGranularity g : {RecomputeGranularity::None, RecomputeGranularity::Selective,
                                   RecomputeGranularity::Full}) {
      TrainConfig t;
      t.micro_batch_size = mbs;
      t.global_batch_size = mbs * grid.layout().dp;
      t.train_iters = steps + 1;
      t.log_interval = 1 << 30;
      t.compute_dtype = dtype;
      t.recompute.granularity = g;
      t.use_distributed_optimizer = dist;
      const MemoryEstimate est = estimate_rank_memory(m, t, grid.layout(), ctx.pp_rank);
      auto data = make_mock_dataset(m.vocab_size, m.seq_length, 1);
      const size_t before = host_allocated_bytes();
      reset_host_peak_allocated_bytes();
      double ms = 0, loss = 0;
      {
        Trainer trainer(m, t, *backend, *data, ctx);
        trainer.train_step();  // warm-up
        Timer timer;
        for (int i = 0; i < steps; ++i) loss = trainer.train_step().loss;
        ms = timer.seconds() * 1e3 / steps;
      }
      const double peak = double(host_peak_allocated_bytes() - before);
      if (g == RecomputeGranularity::None && !dist) base_ms = ms;
      if (root)
        std::printf(
            "%-33s recomputation, %-11s optimizer: peak %8.1f MiB, estimate %8.1f MiB (%+.1f%%) "
            "[weights %.1f, gradients %.1f, optimizer %.1f, activations %.1f MiB] | %.0f ms/step "
            "(%.3fx) | loss %.4f\n",
            g == RecomputeGranularity::None ? "no" : t.recompute.describe().c_str(),
            dist ? "distributed" : "replicated", peak / 1048576.0, est.total_bytes() / 1048576.0,
            100.0 * (est.total_bytes() - peak) / peak, est.param_bytes / 1048576.0,
            est.grad_bytes / 1048576.0, est.optimizer_bytes / 1048576.0,
            est.activation_bytes / 1048576.0, ms, ms / base_ms, loss);
    }
  }
  return 0;
}
