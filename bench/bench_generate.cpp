// bench_generate: prefill and decode tokens/s of a GPT-2-small-shaped model (124M parameters).
// CPU mode: with the KV cache, next to the memory-bandwidth bound of decoding (every decoded token
// at batch 1 reads all weights once, so tokens/s <= measured bandwidth / bytes of weights).
// GPU mode (`gpu`): issue 16's table on the CUDA backend in bf16 (or f32/fp16): decode tokens/s at
// batch 1, 8 and 64 (256 new tokens after a 16-token prompt, greedy; batch 8 also with top-k/top-p
// sampling; batch 1 and 8 also op by op, without the CUDA graph), the decode rate at a 64-token
// and at a 1,024-token context, and prefill tokens/s, with the Hugging Face transformers figures
// measured on an H100 beside them (issue 16) and the targets. Usage: bench_generate [layers=12]
// [prompt=256] [new_tokens=32]
//        bench_generate gpu [bf16|fp16|f32] [batch1]   (batch1: the batch-1 decode row alone, for
//        ncu)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/timer.hpp"
#include "inference/generator.hpp"
#include "options/options.hpp"
#include "runtime/select.hpp"
#include "train/rank_setup.hpp"

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

GPTConfig gpt2_small(int layers) {
  GPTConfig cfg;
  cfg.num_layers = layers;
  cfg.hidden_size = 768;
  cfg.num_attention_heads = 12;
  cfg.seq_length = 1024;
  cfg.vocab_size = 50257;
  return cfg;
}

// Greedy generation of `new_tokens` after `batch` prompts of `prompt_len` ids, with no stop token
// (every sequence runs its full budget). Returns the result of the second of two runs (the first
// warms up allocations and cuBLAS).
GenerationResult run(GPTModel& model, int batch, int prompt_len, int new_tokens,
                     double temperature = 0, int top_k = 0, double top_p = 1, bool graphs = true) {
  ParallelContext ctx = ParallelContext::single();
  InferenceEngine engine(model, ctx, batch, prompt_len + new_tokens);
  engine.set_graphs(graphs);
  std::vector<std::vector<int32_t>> prompts(batch, std::vector<int32_t>(prompt_len));
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < prompt_len; ++i) prompts[b][i] = (i * 7919 + b * 104729) % 50000;
  GenerationOptions g;
  g.max_new_tokens = new_tokens;
  g.sampling.temperature = temperature;
  g.sampling.top_k = top_k;
  g.sampling.top_p = top_p;
  generate(engine, ctx, prompts, g);
  return generate(engine, ctx, prompts, g);
}

int gpu_mode(const std::string& dtype, bool batch1_only) {
  if (!cuda_built() || visible_gpus() == 0) {
    std::fprintf(stderr, "bench_generate gpu: no CUDA GPU visible (built with CUDA: %s)\n",
                 cuda_built() ? "yes" : "no");
    return 2;
  }
  const DType dt = dtype == "f32" ? DType::F32 : dtype == "fp16" ? DType::F16 : DType::BF16;
  auto be = make_backend("cuda", 0, 1, "localhost");
  ParallelContext ctx = ParallelContext::single();
  const GPTConfig cfg = gpt2_small(12);
  GPTModel model(cfg, model_shard_for(cfg, 1, 0, 1, 0), *be, *ctx.tp, dt);
  model.init_parameters(1);
  model.sync_compute_weights();
  std::printf("bench_generate gpu: GPT-2 124M (%.1fM parameters), %s, greedy, %s\n",
              model.params().numel() / 1e6, dtype_name(dt), backend_description(*be).c_str());
  std::printf("%-44s %12s %12s %26s\n", "case", "Tessera", "target", "HF transformers (H100)");
  auto decode_rate = [](const GenerationResult& r, int batch) {
    // tokens decoded after the prefill's first token of each sequence
    return (r.generated_tokens - batch) / r.decode_seconds;
  };
  struct Row {
    int batch;
    const char* target;
    const char* peer;
  };
  for (const Row& row :
       {Row{1, ">= 1,000", "132 fp32 / 157 bf16"}, Row{8, ">= 6,000", "1,294 fp32 / 1,263 bf16"},
        Row{64, ">= 25,000", "-"}}) {
    const GenerationResult r = run(model, row.batch, 16, 256);
    std::printf("%-44s %12.0f %12s %26s\n",
                ("decode tokens/s, batch " + std::to_string(row.batch) + ", 256 new").c_str(),
                decode_rate(r, row.batch), row.target, row.peer);
    if (batch1_only) return 0;  // `batch1`: the first row alone (a profiler's run)
  }
  // The same decode steps op by op (no CUDA graph): what the graphs save in launches.
  for (int batch : {1, 8}) {
    const GenerationResult r = run(model, batch, 16, 256, 0, 0, 1, false);
    std::printf(
        "%-44s %12.0f %12s %26s\n",
        ("decode tokens/s, batch " + std::to_string(batch) + ", op by op (no graph)").c_str(),
        decode_rate(r, batch), "-", "-");
  }
  // Sampled rows go through the device sort (greedy rows through an argmax).
  const GenerationResult sampled = run(model, 8, 16, 256, 0.8, 40, 0.9);
  std::printf("%-44s %12.0f %12s %26s\n", "decode tokens/s, batch 8, top-k 40 top-p 0.9",
              decode_rate(sampled, 8), "-", "-");
  const GenerationResult short_ctx = run(model, 1, 48, 32), long_ctx = run(model, 1, 976, 32);
  const double at64 = decode_rate(short_ctx, 1), at1024 = decode_rate(long_ctx, 1);
  std::printf("%-44s %12.0f %12s %26s\n", "decode tokens/s, batch 1, context 48-80", at64, "-",
              "-");
  std::printf("%-44s %12.0f %12s %26s\n", "decode tokens/s, batch 1, context 976-1008", at1024, "-",
              "-");
  std::printf("%-44s %11.0f%% %12s %26s\n", "rate at 1,024 / rate at 64", 100.0 * at1024 / at64,
              ">= 80%", "-");
  for (int b : {1, 8}) {
    const GenerationResult r = run(model, b, b == 1 ? 1000 : 125, 1);
    std::printf("%-44s %12.0f %12s %26s\n",
                ("prefill tokens/s, batch " + std::to_string(b) + " x " +
                 std::to_string(r.prompt_tokens / b) + " tokens")
                    .c_str(),
                r.prompt_tokens / r.prefill_seconds, ">= 100,000", "-");
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "gpu") == 0)
    return gpu_mode(argc > 2 ? argv[2] : "bf16", argc > 3 && std::strcmp(argv[3], "batch1") == 0);
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
