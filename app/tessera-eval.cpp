// tessera-eval: the loss and perplexity of a checkpoint (any layout) on one split of a dataset,
// every sample of the split exactly once, at the TP x PP (x DP) layout of this run.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "backend/backend.hpp"
#include "backend/select.hpp"
#include "checkpoint/checkpoint.hpp"
#include "comm/mpi.hpp"
#include "comm/process_grid.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/logging.hpp"
#include "data/gpt_dataset.hpp"
#include "train/options.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {
// The first n samples of a dataset, then samples without loss (all ids -1) to fill the last batch.
class FirstSamples final : public TokenDataset {
 public:
  FirstSamples(const TokenDataset& d, int64_t n) : d_(d), n_(n) {}
  std::string describe() const override { return d_.describe(); }
  int seq_length() const override { return d_.seq_length(); }
  int64_t num_samples() const override { return n_; }
  void get(int64_t i, int32_t* out) const override {
    if (i < n_)
      d_.get(i, out);
    else
      std::fill(out, out + d_.seq_length() + 1, -1);
  }

 private:
  const TokenDataset& d_;
  int64_t n_;
};
}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const bool root = mpi.world_rank() == 0;
  std::string load, data_path, split = "969,30,1", which = "valid";
  std::string device;
  int tp = 1, pp = 1, cp = 1, mbs = 4, threads = 0, seq = 0;
  try {
    OptionParser p("tessera-eval",
                   "--load CKPT --data-path PREFIX [--split 949,50,1] [--eval-split valid]");
    p.group("Evaluation")
        .add_options()("load", po::value(&load)->required(), "checkpoint directory (any layout)")(
            "data-path", po::value(&data_path)->required(), "prefix of the HDF5 token shards")(
            "split", po::value(&split)->default_value(split),
            "train,valid,test weights (as in training)")(
            "eval-split", po::value(&which)->default_value(which), "train | valid | test")(
            "micro-batch-size", po::value(&mbs)->default_value(mbs), "samples per forward pass")(
            "seq-length", po::value(&seq)->default_value(0),
            "tokens per sample (0: the checkpoint's); at most the model's positions")(
            "tensor-model-parallel-size", po::value(&tp)->default_value(1),
            "tensor-parallel ranks")("pipeline-model-parallel-size",
                                     po::value(&pp)->default_value(1), "pipeline stages")(
            "context-parallel-size", po::value(&cp)->default_value(1),
            "context-parallel ranks: each holds 1/CP of every sequence (same loss)")(
            "threads", po::value(&threads)->default_value(0),
            "threads per rank (0: this rank's share)")(
            "device", po::value(&device)->default_value("auto"),
            "cpu | cuda | auto (cuda when a GPU is visible)");
    if (!p.parse(argc, argv)) return 0;
    const Split sp = which == "train"   ? Split::Train
                     : which == "valid" ? Split::Valid
                     : which == "test"  ? Split::Test
                                        : Split(-1);
    if (static_cast<int>(sp) < 0)
      throw ConfigError("--eval-split '" + which +
                        "' is not a split (allowed: train, valid, test)");
    ProcessGrid grid(tp, pp, cp);
    device = resolve_device(device, grid.host());
    ParallelContext ctx = grid.context();
    LogOptions lo;
    lo.rank = grid.world_rank();
    lo.host = grid.host();
    lo.level = LogLevel::warning;
    init_logging(lo);
    set_num_threads(threads > 0 ? threads : default_threads(grid.node_comm()));
    CheckpointReader ckpt(load);
    GPTConfig cfg = ckpt.meta().model;
    set_seq_length(cfg, seq, ckpt.path());
    auto corpus = std::make_shared<const ShardedCorpus>(data_path);
    if (corpus->meta().vocab_size != cfg.vocab_size)
      throw ConfigError(detail::concat("--data-path '", data_path, "' has a vocabulary of ",
                                       corpus->meta().vocab_size, " tokens, the checkpoint ",
                                       cfg.vocab_size));
    GPTDataset ds(corpus, sp, parse_split(split), cfg.seq_length, 0);
    if (ds.num_samples() == 0)
      throw ConfigError("the " + which + " split of '" + data_path + "' (--split " + split +
                        ") has no sample: " + ds.describe());
    TrainConfig t;
    t.micro_batch_size = mbs;
    t.global_batch_size = mbs * ctx.dp_size;
    t.log_interval = 1 << 30;
    validate_layout(cfg, t, tp, pp, ctx.dp_size, cp);
    auto be = make_rank_backend(grid, device);
    ctx = grid.context();  // NCCL groups on CUDA
    FirstSamples data(ds, ds.num_samples());
    Trainer trainer(cfg, t, *be, data, ctx);
    trainer.load_checkpoint(load, /*model_only=*/true);
    const int64_t G = t.global_batch_size, iters = (ds.num_samples() + G - 1) / G;
    const double loss = trainer.evaluate(data, 0, iters);
    if (root)
      std::printf(
          "tessera-eval: %s | iteration %lld | %s split: %lld samples, %lld tokens evaluated | "
          "loss %.9f | perplexity %.6f\n",
          ckpt.path().c_str(), (long long)ckpt.meta().iteration, which.c_str(),
          (long long)ds.num_samples(), (long long)ds.num_samples() * cfg.seq_length, loss,
          std::exp(loss));
  } catch (const ConfigError& e) {
    if (root) std::fprintf(stderr, "tessera-eval: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
  return 0;
}
