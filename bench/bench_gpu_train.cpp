// bench_gpu_train: training-step throughput of one GPU on GPT-2 124M (seq 1024) and a 1.3B
// config (24 layers, hidden 2048, 16 heads, seq 2048), printing tokens/s, achieved TFLOP/s and
// MFU against the device's peak dense bf16 rate, and the peak device memory against the
// --dry-run estimate, next to the PyTorch peer's figure for the same shape. Targets (issue 12):
// 124M >= 400,000 tokens/s, 1.3B >= 48% MFU on one H100 (docs/performance.md).
//
// FLOPs are Megatron's count (Narayanan et al. 2021, without recomputation):
//   per token = 72 L h^2 + 12 L s h + 6 h V   (= GPTConfig::train_flops_per_token)
// i.e. 6 x (matmul parameters) plus the attention score and value products, forward and backward.
//
// Usage: bench_gpu_train [124m|1.3b|llama1b|mixtral|all=all: 124m and 1.3b] [steps=10]
// [micro_batch=0: per model] [peak_tflops=0: from the device name] [dtype=bf16|fp16|f32]
// [--breakdown]
// [--recompute=full|selective]
// [--distributed-optimizer] [--max-micro-batch]
// [--fp8=e4m3|hybrid[:delayed|:tensorwise]] [--muon[=low|medium|high]]
//
// --muon trains with Muon (issue 59; docs/training.md "Muon": Megatron-Core's defaults, the
// Newton-Schulz GEMMs batched over same-shaped matrices, bf16 inputs unless =high): with
// --breakdown the muon-step phase is Newton-Schulz's time a step (docs/performance.md, "Muon",
// has the prediction).
//
// --fp8 runs the transformer layers' GEMMs in FP8 (docs/training.md, "FP8"; bf16 elsewhere):
// scripts/gpu-lease.sh's fp8 step runs the 1.3B step without and with it, one after the other on
// the same GPU (docs/performance.md, "FP8 GEMMs": 1.3x predicted, goal 1.5x).
//
// --recompute / --distributed-optimizer train with those memory features (issue 13; one GPU is
// DP 1, so the distributed optimizer's memory only falls with more ranks: --dry-run shows it).
// mixtral: Mixtral-8x7B's layer (8 SwiGLU experts, top 2, GQA 8, RMSNorm, RoPE 1e6, vocabulary
// 32000) at hidden 1024, experts of 3584, 16 layers, sequence 2048, micro-batch 4, with
// --moe-grouped-gemm (TESSERA_BENCH_NO_GROUPED_GEMM=1: one GEMM per expert, to compare). FLOPs and
// MFU count the active parameters (the 2 experts a token uses, and the router). No PyTorch peer has
// been measured at this shape.
// --max-micro-batch: instead of one timed size, tries micro-batches 8, 16, 24, 32, 48, 64, 96, 128
// (two steps each) and reports the largest that trains, with its step time and peak memory.
//
// --breakdown (anywhere on the line, or TESSERA_BENCH_BREAKDOWN=1): after the timed steps, as many
// steps again with the phase timer on (core/phase_timer.hpp: CUDA events around each op kind on
// the backend's stream), then a table of GPU time per phase per step, its share of the step, and
// calls per step, longest first (docs/profiling.md). The headline figures come from the steps
// without the timer.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/phase_timer.hpp"
#include "core/timer.hpp"
#include "data/dataset.hpp"
#include "options/options.hpp"
#include "runtime/process_grid.hpp"
#include "runtime/select.hpp"
#include "train/trainer.hpp"

#ifdef TESSERA_HAVE_CUDA
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"
#endif

using namespace tessera;

namespace {

// The per-phase table of `steps` profiled steps that took `step_ms` each on average.
void print_breakdown(const std::vector<PhaseTotal>& phases, int steps, double step_ms) {
  double sum = 0;
  for (const PhaseTotal& p : phases) sum += p.ms / steps;
  std::printf("  %-26s %12s %10s %12s\n", "phase", "ms/step", "% of step", "calls/step");
  for (const PhaseTotal& p : phases)
    std::printf("  %-26s %12.3f %9.1f%% %12.1f\n", p.name.c_str(), p.ms / steps,
                100.0 * p.ms / steps / step_ms, double(p.calls) / steps);
  std::printf("  %-26s %12.3f %9.1f%%\n", "(sum of phases)", sum, 100.0 * sum / step_ms);
  std::printf("  %-26s %12.3f %9.1f%%\n", "(outside any phase)", std::max(0.0, step_ms - sum),
              100.0 * std::max(0.0, step_ms - sum) / step_ms);
}

struct Preset {
  const char* name;
  int layers, hidden, heads, seq, micro_batch;
  double peer_tokens_per_s, peer_mfu;  // PyTorch on one H100 at this shape (issue 12; 0: none)
  bool llama = false;    // Llama 3.2 1B's architecture (issue 15): 8 query groups, SwiGLU 8192, ...
  bool in_all = true;    // run by "all"
  bool mixtral = false;  // Mixtral's layer (issue 29): 8 SwiGLU experts of 3584, top 2, GQA 8
};
// The shapes of the PyTorch peer of issue 12 (bf16 autocast, SDPA flash attention, torch.compile,
// fused AdamW), measured on the same H100 as Tessera's first run; and Llama 3.2 1B at sequence
// 2048 (configs/llama3-1b.ini's model; no peer measured yet), run when named.
const Preset kPresets[] = {{"124m", 12, 768, 12, 1024, 16, 400066, 34.6},
                           {"1.3b", 24, 2048, 16, 2048, 8, 52704, 48.4},
                           {"llama1b", 16, 2048, 32, 2048, 4, 0, 0, true, false},
                           {"mixtral", 16, 1024, 16, 2048, 4, 0, 0, false, false, true}};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args;  // the positional arguments, the flags taken out
  const char* env = std::getenv("TESSERA_BENCH_BREAKDOWN");
  bool breakdown = env && *env && std::strcmp(env, "0") != 0;
  bool distributed = false, max_mbs = false;
  RecomputeConfig recompute;
  Fp8Config fp8;
  std::string muon;  // --muon[=PREC]: Muon's Newton-Schulz precision, "" for AdamW
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--breakdown") == 0) {
      breakdown = true;
    } else if (std::strcmp(argv[i], "--distributed-optimizer") == 0) {
      distributed = true;
    } else if (std::strcmp(argv[i], "--max-micro-batch") == 0) {
      max_mbs = true;
    } else if (std::strncmp(argv[i], "--fp8=", 6) == 0) {
      const std::string v = argv[i] + 6, format = v.substr(0, v.find(':'));
      const std::string recipe =
          v.find(':') == std::string::npos ? "delayed" : v.substr(v.find(':') + 1);
      if ((format != "e4m3" && format != "hybrid") ||
          (recipe != "delayed" && recipe != "tensorwise")) {
        std::fprintf(stderr, "bench_gpu_train: --fp8=%s: give e4m3|hybrid[:delayed|:tensorwise]\n",
                     v.c_str());
        return 2;
      }
      fp8.enabled = true;
      fp8.hybrid = format == "hybrid";
      fp8.recipe = recipe == "delayed" ? Fp8Recipe::Delayed : Fp8Recipe::Tensorwise;
    } else if (std::strncmp(argv[i], "--muon", 6) == 0 && (argv[i][6] == 0 || argv[i][6] == '=')) {
      muon = argv[i][6] ? argv[i] + 7 : "medium";
      if (muon != "low" && muon != "medium" && muon != "high") {
        std::fprintf(stderr, "bench_gpu_train: %s: give --muon or --muon=low|medium|high\n",
                     argv[i]);
        return 2;
      }
    } else if (std::strncmp(argv[i], "--recompute=", 12) == 0) {
      try {
        recompute.granularity = parse_recompute_granularity(argv[i] + 12);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_gpu_train: %s\n", e.what());
        return 2;
      }
    } else {
      args.push_back(argv[i]);
    }
  }
  auto arg = [&](size_t i, const char* def) {
    return i < args.size() ? args[i] : std::string(def);
  };
  const std::string which = arg(0, "all");
  const int steps = std::atoi(arg(1, "10").c_str());
  const int mbs_arg = std::atoi(arg(2, "0").c_str());
  double peak = std::atof(arg(3, "0").c_str());
  const std::string dtype_arg = arg(4, "bf16");
#ifndef TESSERA_HAVE_CUDA
  (void)which, (void)steps, (void)mbs_arg, (void)peak, (void)dtype_arg, (void)breakdown;
  (void)distributed, (void)max_mbs, (void)fp8, (void)muon;
  std::fprintf(stderr, "bench_gpu_train: this build has no CUDA backend\n");
  return 2;
#else
  if (cuda::device_count() == 0) {
    std::fprintf(stderr,
                 "bench_gpu_train: no CUDA device is visible; run it on the GPU machine "
                 "(scripts/gpu-check.sh)\n");
    return 2;
  }
  DType dtype = DType::BF16;
  try {
    dtype = dtype_from_name(dtype_arg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_train: %s\n", e.what());
    return 2;
  }
  cuda::set_device(0);
  const std::string device = cuda::device_description(0);
  if (peak <= 0) peak = peak_tflops(device, DType::BF16);
  std::printf(
      "bench_gpu_train: %s; peak dense bf16 %.1f TFLOP/s%s; %s training%s; activation "
      "recomputation %s; %s %s optimizer\n",
      device.c_str(), peak, peak > 0 ? "" : " (unknown device: MFU not printed)", dtype_name(dtype),
      fp8.enabled ? (std::string(", FP8 GEMMs (") + (fp8.hybrid ? "hybrid" : "e4m3") + ", " +
                     (fp8.recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise") + ")")
                        .c_str()
                  : "",
      recompute.describe().c_str(), distributed ? "distributed" : "replicated",
      muon.empty() ? "AdamW" : ("Muon (Newton-Schulz " + muon + ")").c_str());
  for (const Preset& p : kPresets) {
    if (which == "all" ? !p.in_all : which != p.name) continue;
    GPTConfig m;
    m.num_layers = p.layers;
    m.hidden_size = p.hidden;
    m.num_attention_heads = p.heads;
    m.seq_length = p.seq;
    m.max_position_embeddings = p.seq;
    m.vocab_size = 50257;
    if (p.llama) {  // configs/llama3-1b.ini's architecture
      m.vocab_size = 128256;
      m.ffn_hidden_size = 8192;
      m.position_embedding_type = "rope";
      m.rotary_base = 500000;
      m.use_rope_scaling = true;
      m.rope_scaling_factor = 32;
      m.normalization = "RMSNorm";
      m.swiglu = true;
      m.group_query_attention = true;
      m.num_query_groups = 8;
      m.add_bias_linear = false;
    }
    if (p.mixtral) {  // Mixtral-8x7B's layer at a quarter of its width: 1.5B parameters, 0.5B
                      // active
      m.vocab_size = 32000;
      m.position_embedding_type = "rope";
      m.rotary_base = 1000000;
      m.normalization = "RMSNorm";
      m.swiglu = true;
      m.group_query_attention = true;
      m.num_query_groups = 8;
      m.add_bias_linear = false;
      m.ffn_hidden_size = 3584;
      m.num_experts = 8;
      m.moe_router_topk = 2;
      m.moe_aux_loss_coeff = 0.02;  // Mixtral's router_aux_loss_coef
      m.moe_grouped_gemm = std::getenv("TESSERA_BENCH_NO_GROUPED_GEMM") == nullptr;
    }
    TrainConfig t;
    t.micro_batch_size = mbs_arg > 0 ? mbs_arg : p.micro_batch;
    t.global_batch_size = t.micro_batch_size;
    t.train_iters = steps + 2;
    t.lr = 1e-4;
    t.log_interval = 1 << 30;
    t.compute_dtype = dtype;
    t.recompute = recompute;
    t.use_distributed_optimizer = distributed;
    t.fp8 = fp8;
    if (!muon.empty()) {
      t.optimizer = "muon";
      t.muon.matmul_prec = muon;
    }
    if (max_mbs) {  // the largest micro-batch that trains (two steps), smallest first
      int best = 0;
      for (int mbs : {8, 16, 24, 32, 48, 64, 96, 128}) {
        t.micro_batch_size = t.global_batch_size = mbs;
        t.train_iters = 2;
        const MemoryEstimate e = estimate_rank_memory(m, t, GridLayout::make(1, 1, 1), 0);
        try {
          cuda::reset_peak_allocated_bytes();
          auto be = make_cuda_backend();
          auto data = make_mock_dataset(m.vocab_size, m.seq_length, 1);
          Trainer trainer(m, t, *be, *data);
          trainer.train_step();
          Timer timer;
          trainer.train_step();
          const double sec = timer.seconds();
          std::printf(
              "%-5s: micro-batch %3d trains: %.1f ms/step, %.0f tokens/s, peak %.2f GiB "
              "(estimate %.2f GiB)\n",
              p.name, mbs, sec * 1e3, double(mbs) * m.seq_length / sec,
              cuda::peak_allocated_bytes() / 1073741824.0, e.total_bytes() / 1073741824.0);
          best = mbs;
        } catch (const std::exception& e) {
          std::printf("%-5s: micro-batch %3d does not fit: %s\n", p.name, mbs, e.what());
          break;
        }
      }
      std::printf("%-5s: largest micro-batch that trains (%s recomputation): %d\n", p.name,
                  recompute.describe().c_str(), best);
      continue;
    }
    const MemoryEstimate est = estimate_rank_memory(m, t, GridLayout::make(1, 1, 1), 0);
    try {
      cuda::reset_peak_allocated_bytes();
      auto be = make_cuda_backend();
      auto data = make_mock_dataset(m.vocab_size, m.seq_length, 1);
      Trainer trainer(m, t, *be, *data);
      for (int i = 0; i < 2; ++i) trainer.train_step();  // warm-up: cuBLAS heuristics, caches
      be->synchronize();
      Timer timer;
      double loss = 0;
      for (int i = 0; i < steps; ++i) loss = trainer.train_step().loss;
      be->synchronize();
      const double sec = timer.seconds() / steps;
      const double tokens = double(t.micro_batch_size) * m.seq_length;
      const double tflops = m.train_flops_per_token() * tokens / sec / 1e12;
      std::printf(
          "%-5s: %d layers, hidden %d, seq %d, micro-batch %d, %lld parameters | %.1f ms/step | "
          "%.0f tokens/s | %.1f TFLOP/s",
          p.name, p.layers, p.hidden, p.seq, t.micro_batch_size, (long long)m.num_parameters(),
          sec * 1e3, tokens / sec, tflops);
      if (m.num_experts > 0)
        std::printf(" (active %lld; %d experts, top %d, %s)", (long long)m.num_active_parameters(),
                    m.num_experts, m.moe_router_topk,
                    m.moe_grouped_gemm ? "grouped GEMM" : "one GEMM per expert");
      if (peak > 0) std::printf(" | MFU %.1f%%", 100.0 * tflops / peak);
      std::printf(
          " | peak memory %.2f GiB held by Tessera (--dry-run estimate %.2f GiB) | loss %.3f\n",
          cuda::peak_allocated_bytes() / 1073741824.0, est.total_bytes() / 1073741824.0, loss);
      if (t.micro_batch_size == p.micro_batch && dtype == DType::BF16 && p.peer_tokens_per_s > 0)
        std::printf(
            "%-5s: PyTorch peer on an H100 at this shape: %.0f tokens/s, %.1f%% MFU (%.2fx)\n",
            p.name, p.peer_tokens_per_s, p.peer_mfu, tokens / sec / p.peer_tokens_per_s);
      if (breakdown && steps > 0) {
        // The same number of steps again with a timestamp around each phase; train_step ends with
        // a synchronize, so collecting after each step waits for nothing more.
        PhaseTimer& pt = PhaseTimer::global();
        struct Off {  // on an error: the clock goes before the backend whose stream it uses
          ~Off() { PhaseTimer::global().discard(); }
        } off;
        pt.reset();
        pt.enable(make_phase_clock(*be));
        double timed_sec = 0;
        for (int i = 0; i < steps; ++i) {
          timed_sec += trainer.train_step().seconds;
          pt.collect();
        }
        pt.disable();
        const double step_ms = timed_sec * 1e3 / steps;
        std::printf(
            "%-5s: time per phase over %d steps with the phase timer on: %.1f ms/step (%.1f "
            "ms/step without it)\n",
            p.name, steps, step_ms, sec * 1e3);
        print_breakdown(pt.totals(), steps, step_ms);
        pt.reset();
      }
    } catch (const std::exception& e) {
      std::printf("%-5s: failed: %s\n", p.name, e.what());
    }
  }
  return 0;
#endif
}
