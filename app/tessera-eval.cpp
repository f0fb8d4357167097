// tessera-eval: the loss and perplexity of a checkpoint (any layout) on one split of the data
// (a prefix: every sample of its split exactly once; a blend: as many samples in its order), or
// on --eval-iters batches as training evaluates them, at the TP x PP (x DP) layout of this run.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "backend/backend.hpp"
#include "checkpoint/checkpoint.hpp"
#include "comm/mpi/mpi.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/logging.hpp"
#include "data/blended_dataset.hpp"
#include "data/gpt_dataset.hpp"
#include "options/options.hpp"
#include "run/run_data.hpp"
#include "runtime/process_grid.hpp"
#include "runtime/select.hpp"
#include "train/rank_setup.hpp"
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
  bool has_loss_mask() const override { return d_.has_loss_mask(); }
  void get_loss_mask(int64_t i, uint8_t* out) const override {
    if (i < n_)
      d_.get_loss_mask(i, out);
    else
      std::fill(out, out + d_.seq_length() + 1, uint8_t(0));
  }

 private:
  const TokenDataset& d_;
  int64_t n_;
};
}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const bool root = mpi.world_rank() == 0;
  std::vector<std::string> data_words, train_words, valid_words, test_words;
  std::string load, split = "969,30,1", which = "valid";
  std::string device;
  int tp = 1, pp = 1, cp = 1, mbs = 4, threads = 0, seq = 0;
  int64_t eval_iters = 0, seed = -1, global_batch = 0;
  LtorOptions docs;  // documents inside a sample, as the training run had them
  try {
    OptionParser p("tessera-eval",
                   "--load CKPT --data-path PREFIX|BLEND [--split 949,50,1] [--eval-split valid] "
                   "[--eval-iters N]");
    p.group("Evaluation")
        .add_options()("load", po::value(&load)->required(), "checkpoint directory (any layout)")(
            "data-path", po::value(&data_words)->multitoken(),
            "the data as training names it: a prefix of HDF5 token shards, or Megatron's blend "
            "`W1 PREFIX1 W2 PREFIX2 ...`; --split cuts each dataset")(
            "train-data-path", po::value(&train_words)->multitoken(),
            "the train split's own data (a prefix or a blend), instead of --data-path")(
            "valid-data-path", po::value(&valid_words)->multitoken(),
            "the valid split's own data (a prefix or a blend)")(
            "test-data-path", po::value(&test_words)->multitoken(),
            "the test split's own data (a prefix or a blend)")(
            "split", po::value(&split)->default_value(split),
            "train,valid,test weights (as in training)")(
            "eval-split", po::value(&which)->default_value(which), "train | valid | test")(
            "eval-iters", po::value(&eval_iters)->default_value(0),
            "global batches to evaluate, as training's --eval-iters (the same samples as "
            "`tessera-train --load CKPT --skip-train`); 0: every sample of the split once (a "
            "blend: as many samples as its datasets' splits hold, in the blend's order, as "
            "--full-validation)")(
            "seed", po::value(&seed)->default_value(-1),
            "the seed that orders the samples (-1: the checkpoint's, as training drew them)")(
            "micro-batch-size", po::value(&mbs)->default_value(mbs), "samples per forward pass")(
            "global-batch-size", po::value(&global_batch)->default_value(0),
            "samples per evaluated batch, as training's (0: micro-batch size x DP)")(
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
            "cpu | cuda | auto (cuda when a GPU is visible)")(
            "reset-position-ids", po::bool_switch(&docs.reset_position_ids),
            "as training: positions restart after every end-of-document token")(
            "reset-attention-mask", po::bool_switch(&docs.reset_attention_mask),
            "as training: no attention across an end-of-document token")(
            "eod-mask-loss", po::bool_switch(&docs.eod_mask_loss),
            "as training: no loss where the input token is the end-of-document token")(
            "sft", po::bool_switch(&docs.packed),
            "as training: whole documents packed into samples, reset per document");
    if (!p.parse(argc, argv)) return 0;
    const Split sp = which == "train"   ? Split::Train
                     : which == "valid" ? Split::Valid
                     : which == "test"  ? Split::Test
                                        : Split(-1);
    if (static_cast<int>(sp) < 0)
      throw ConfigError("--eval-split '" + which +
                        "' is not a split (allowed: train, valid, test)");
    if (eval_iters < 0)
      throw ConfigError("--eval-iters " + std::to_string(eval_iters) +
                        " is negative: give the global batches to evaluate, or 0 for the whole "
                        "split");
    if (seed < -1)
      throw ConfigError("--seed " + std::to_string(seed) +
                        " is negative: give a seed (>= 0), or -1 for the checkpoint's");
    RunOptions data;
    data.data_path = parse_data_blend(data_words, "data-path");
    data.train_data_path = parse_data_blend(train_words, "train-data-path");
    data.valid_data_path = parse_data_blend(valid_words, "valid-data-path");
    data.test_data_path = parse_data_blend(test_words, "test-data-path");
    const bool per_split = !data.train_data_path.empty() || !data.valid_data_path.empty() ||
                           !data.test_data_path.empty();
    if (data.data_path.empty() == !per_split)
      throw ConfigError(per_split ? "give either --data-path or the per-split paths "
                                    "(--train-data-path, --valid-data-path, --test-data-path), "
                                    "not both"
                                  : "give the data: --data-path PREFIX (or a blend), or --" +
                                        which + "-data-path");
    data.split = split;
    parse_split(split);  // a bad --split is named before anything is opened
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
    data.model.seq_length = cfg.seq_length;
    data.train.seed = seed >= 0 ? static_cast<uint64_t>(seed) : ckpt.meta().seed;
    if (docs.packed) docs.reset_position_ids = docs.reset_attention_mask = true;
    data.train.documents = docs;  // --sft packs the split's documents
    std::unique_ptr<BlendedDataset> ds = open_split_data(data, sp);
    const ShardMeta& m = ds->dataset(0).corpus().meta();
    if (m.vocab_size != cfg.vocab_size)
      throw ConfigError(detail::concat("the data '", ds->blend().prefixes[0],
                                       "' has a vocabulary of ", m.vocab_size,
                                       " tokens, the checkpoint ", cfg.vocab_size));
    TrainConfig t;
    t.documents = docs;
    t.documents.eod = m.eod_id;
    if (const std::string why = documents_problem(docs, device, cfg.alibi()); !why.empty())
      throw ConfigError(why);
    t.micro_batch_size = mbs;
    t.global_batch_size = global_batch > 0 ? global_batch : mbs * ctx.dp_size;
    t.log_interval = 1 << 30;
    validate_layout(cfg, t, tp, pp, ctx.dp_size, cp);
    auto be = make_rank_backend(grid, device);
    ctx = grid.context();  // NCCL groups on CUDA
    const int64_t G = t.global_batch_size;
    // The whole split: its samples once (a blend: that many in its order; the last batch filled
    // with samples without loss);
    // --eval-iters N: N global batches of the blend's order, as training's evaluation draws them.
    const int64_t samples = eval_iters > 0 ? eval_iters * G : ds->num_samples();
    FirstSamples first(*ds, samples);
    Trainer trainer(cfg, t, *be, first, ctx);
    trainer.load_checkpoint(load, /*model_only=*/true);
    const int64_t iters = eval_iters > 0 ? eval_iters : (samples + G - 1) / G;
    if (root && eval_iters > 0 && samples > ds->num_samples())
      std::fprintf(stderr,
                   "tessera-eval: note: --eval-iters %lld x %lld samples = %lld samples, the %s "
                   "split holds %lld: its samples repeat (in further epochs, as training's "
                   "evaluation draws them)\n",
                   (long long)eval_iters, (long long)G, (long long)samples, which.c_str(),
                   (long long)ds->num_samples());
    Timer clock;
    double said = 0;  // a progress line every 10 s
    const double loss = trainer.evaluate(first, 0, iters, [&](int64_t done, int64_t total) {
      if (!root || done == total || clock.seconds() - said < 10) return;
      said = clock.seconds();
      std::fprintf(stderr, "tessera-eval: %lld of %lld batches evaluated (%.0f s)\n",
                   (long long)done, (long long)total, said);
    });
    if (std::isnan(loss))
      throw ConfigError("no token of the " + which + " split's " + std::to_string(samples) +
                        " samples evaluated counts toward the loss (the data's /loss_mask is 0 "
                        "there): there is no loss to report");
    if (root)
      std::printf(
          "tessera-eval: %s | iteration %lld | %s split of %s: %lld samples, %lld tokens "
          "evaluated%s | loss %.9f | perplexity %.6f\n",
          ckpt.path().c_str(), (long long)ckpt.meta().iteration, which.c_str(),
          ds->blend().describe().c_str(), (long long)samples, (long long)samples * cfg.seq_length,
          eval_iters > 0
              ? (" (" + std::to_string(eval_iters) + " batches of " + std::to_string(G) + ")")
                    .c_str()
              : "",
          loss, std::exp(loss));
  } catch (const ConfigError& e) {
    if (root) std::fprintf(stderr, "tessera-eval: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
  return 0;
}
