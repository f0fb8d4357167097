// bench_checkpoint: checkpoint save and load throughput (GB/s) for a ~1.5 GB state (model + Adam
// moments of a 128M-parameter GPT) next to a plain sequential write and read of the same bytes on
// the same disk, and resharding throughput. Target: save and load >= 70% of the plain rates.
// Then the trainer's save of the same model on the CPU backend, synchronous against --async-save:
// the time the training loop is blocked (goal: async <= 5% of the synchronous save).
// Usage: bench_checkpoint [DIR=/tmp] [hidden=1024] [layers=6]
#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "checkpoint/checkpoint.hpp"
#include "checkpoint/reshard.hpp"
#include "core/timer.hpp"
#include "data/dataset.hpp"
#include "train/trainer.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  const std::string base = std::string(argc > 1 ? argv[1] : "/tmp") + "/tessera_bench_ckpt";
  GPTConfig cfg;
  cfg.hidden_size = argc > 2 ? std::atoi(argv[2]) : 1024;
  cfg.num_layers = argc > 3 ? std::atoi(argv[3]) : 6;
  cfg.num_attention_heads = 16;
  cfg.seq_length = 1024;
  cfg.vocab_size = 50257;
  try {
    std::system(("rm -rf " + base + " && mkdir -p " + base).c_str());
    const ModelShard shard = model_shard_for(cfg, 1, 0, 1, 0);
    const auto specs = build_param_specs(cfg, shard);
    const int64_t n = specs.back().flat_offset + specs.back().numel();
    std::vector<float> p(n), m(n), v(n);
    std::mt19937 g(1);
    std::normal_distribution<float> d(0.f, 0.02f);
    for (int64_t i = 0; i < n; ++i) p[i] = d(g), m[i] = d(g) * 0.1f, v[i] = std::fabs(d(g)) * 1e-3f;
    for (const ParamSpec& s : specs)  // vocabulary padding rows are zero, as the model keeps them
      if (s.name == "wte")
        for (int64_t i = cfg.vocab_size * cfg.hidden_size; i < s.numel(); ++i)
          p[s.flat_offset + i] = 0.f;
    const double bytes = 3.0 * 4.0 * n;
    CheckpointMeta meta;
    meta.model = cfg;
    meta.iteration = 100;
    // Plain sequential write and read of the same bytes.
    const std::string plain = base + "/plain.bin";
    Timer tw;
    {
      const int fd = ::open(plain.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      for (const auto* buf : {&p, &m, &v})
        if (::write(fd, buf->data(), 4 * n) != 4 * n) throw Error("plain write failed");
      ::fsync(fd);
      ::close(fd);
    }
    const double plain_write = bytes / tw.seconds() / 1e9;
    std::vector<float> back(n);
    Timer tr;
    {
      const int fd = ::open(plain.c_str(), O_RDONLY);
      for (int k = 0; k < 3; ++k)
        if (::read(fd, back.data(), 4 * n) != 4 * n) throw Error("plain read failed");
      ::close(fd);
    }
    const double plain_read = bytes / tr.seconds() / 1e9;
    // Tessera save: write + read-back verification + atomic rename.
    const std::string ck = base + "/ckpt";
    Timer ts;
    begin_checkpoint_dir(ck, 100);
    ShardTensors t{&specs, p.data(), m.data(), v.data()};
    write_checkpoint_shard(ck + "/" + iteration_dir_name(100) + ".tmp/" + shard_file_name(0, 0),
                           meta, shard, t);
    commit_checkpoint_dir(ck, 100, 0);
    const double save = bytes / ts.seconds() / 1e9;
    // Tessera load: every tensor and moment through the slice reader.
    Timer tl;
    CheckpointReader r(ck);
    for (const ParamSpec& s : specs) {
      r.read_slice("model", s, back.data() + s.flat_offset);
      r.read_slice("optimizer/exp_avg", s, m.data() + s.flat_offset);
      r.read_slice("optimizer/exp_avg_sq", s, v.data() + s.flat_offset);
    }
    const double load = bytes / tl.seconds() / 1e9;
    if (back != p) throw Error("loaded parameters differ from the saved ones");
    // Resharding TP1 -> TP2 x PP2.
    CheckpointMeta target = r.meta();
    target.tp_size = 2;
    target.pp_size = 2;
    Timer tx;
    write_checkpoint(
        base + "/tp2pp2", target,
        [&](const std::string& grp, const ParamSpec& s, float* out) { r.read_slice(grp, s, out); },
        nullptr);
    const double reshard = bytes / tx.seconds() / 1e9;
    std::system(("rm -rf " + base).c_str());
    std::printf(
        "bench_checkpoint: %lld parameters (hidden %d, %d layers, vocab %lld), %.2f GB of "
        "parameters + Adam moments, in %s\n",
        (long long)n, cfg.hidden_size, cfg.num_layers, (long long)cfg.vocab_size, bytes / 1e9,
        base.c_str());
    std::printf("%-44s %10s %12s\n", "figure", "GB/s", "vs plain");
    std::printf("%-44s %10.2f %12s\n", "plain sequential write (+fsync)", plain_write, "-");
    std::printf("%-44s %10.2f %11.0f%%\n", "checkpoint save (write, verify, rename)", save,
                100 * save / plain_write);
    std::printf("%-44s %10.2f %12s\n", "plain sequential read", plain_read, "-");
    std::printf("%-44s %10.2f %11.0f%%\n", "checkpoint load (all tensors, checksums)", load,
                100 * load / plain_read);
    std::printf("%-44s %10.2f %12s\n", "reshard TP1 -> TP2 x PP2 (read + write)", reshard, "-");
    std::printf("target: save and load >= 70%% of the plain rates\n");
    // The trainer's save, as the step loop sees it: synchronous, then --async-save (blocked =
    // staging the state; the write completes in the background, waited for here).
    p = m = v = back = std::vector<float>();
    double blocked[2] = {0, 0}, total[2] = {0, 0};
    for (int async = 0; async < 2; ++async) {
      GPTConfig mc = cfg;
      mc.seq_length = 128;
      mc.max_position_embeddings = 1024;
      TrainConfig tc;
      tc.micro_batch_size = 1;
      tc.train_iters = 1;
      tc.async_save = async == 1;
      auto be = make_cpu_backend();
      auto data = make_mock_dataset(mc.vocab_size, mc.seq_length, 1);
      Trainer tr(mc, tc, *be, *data);
      const std::string dir = base + (async ? "/async" : "/sync");
      for (int rep = 0; rep < 2; ++rep) {  // the second save reuses the staging buffers
        Timer tb;
        tr.save_checkpoint(dir);
        blocked[async] = tb.seconds();
        tr.wait_for_saves();
        total[async] = tb.seconds();
      }
    }
    std::system(("rm -rf " + base).c_str());
    std::printf("%-44s %10s %12s\n", "trainer save (CPU backend, 2nd save)", "blocked s",
                "total s");
    std::printf("%-44s %10.3f %12.3f\n", "synchronous", blocked[0], total[0]);
    std::printf("%-44s %10.3f %12.3f\n", "--async-save", blocked[1], total[1]);
    std::printf("async blocks the loop %.1f%% of the synchronous save (goal <= 5%%)\n",
                100 * blocked[1] / blocked[0]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_checkpoint: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
