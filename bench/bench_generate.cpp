// bench_generate: prefill and decode tokens/s of a GPT-2-small-shaped model (124M parameters) on
// CPU with the KV cache, next to the memory-bandwidth bound of decoding: every decoded token (batch
// 1) reads all weights once, so tokens/s <= measured bandwidth / bytes of weights.
// Usage: bench_generate [layers=12] [prompt=256] [new_tokens=32]
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/backend.hpp"
#include "core/timer.hpp"
#include "inference/generator.hpp"
#include "train/options.hpp"

using namespace tessera;

namespace {
// Best of a few passes of a[i] = b[i] + s * c[i] over 3 x 256 MB (STREAM triad; 3 x 4 bytes/elem).
double triad_gbs() {
  const size_t n = 64u << 20;
  std::vector<float> a(n, 0.f), b(n, 1.f), c(n, 2.f);
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    Timer t;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
    best = std::max(best, 12.0 * n / t.seconds() / 1e9);
  }
  return best + a[n / 2] * 0;
}
}  // namespace

int main(int argc, char** argv) {
  GPTConfig cfg;
  cfg.num_layers = argc > 1 ? std::atoi(argv[1]) : 12;
  cfg.hidden_size = 768;
  cfg.num_attention_heads = 12;
  cfg.seq_length = 1024;
  cfg.vocab_size = 50257;
  const int prompt_len = argc > 2 ? std::atoi(argv[2]) : 256;
  const int new_tokens = argc > 3 ? std::atoi(argv[3]) : 32;
  set_num_threads(affinity_cores());
  auto be = make_cpu_backend();
  ParallelContext ctx = ParallelContext::single();
  GPTModel model(cfg, model_shard_for(cfg, 1, 0, 1, 0), *be, *ctx.tp);
  model.init_parameters(1);
  InferenceEngine engine(model, ctx, 1, cfg.max_positions());
  std::vector<int32_t> prompt(prompt_len);
  for (int i = 0; i < prompt_len; ++i) prompt[i] = (i * 7919) % 50000;
  GenerationOptions g;
  g.max_new_tokens = new_tokens;
  g.sampling.temperature = 0;
  const GenerationResult r = generate(engine, ctx, {prompt}, g);
  const double prefill = prompt_len / r.prefill_seconds;
  const double decode = (r.generated_tokens - 1) / r.decode_seconds;
  const double weight_bytes = 4.0 * model.params().numel();
  const double bw = triad_gbs();
  std::printf(
      "bench_generate: GPT-2-small-shaped (%d layers, hidden 768, vocab 50257), %.1fM parameters, "
      "fp32, CPU %d threads, batch 1\n",
      cfg.num_layers, model.params().numel() / 1e6, affinity_cores());
  std::printf("%-48s %12s\n", "figure", "value");
  std::printf("%-48s %12.0f\n",
              ("prefill tokens/s (prompt " + std::to_string(prompt_len) + ")").c_str(), prefill);
  std::printf("%-48s %12.1f\n",
              ("decode tokens/s (" + std::to_string(new_tokens) + " tokens, KV cache)").c_str(),
              decode);
  std::printf("%-48s %12.2f\n", "memory bandwidth, STREAM triad (GB/s)", bw);
  std::printf("%-48s %12.3f\n", "weights read per decoded token (GB)", weight_bytes / 1e9);
  std::printf("%-48s %12.1f\n", "decode bound = bandwidth / weight bytes (tok/s)",
              bw * 1e9 / weight_bytes);
  std::printf("%-48s %11.0f%%\n", "decode / bound", 100.0 * decode / (bw * 1e9 / weight_bytes));
  return 0;
}
