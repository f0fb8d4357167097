// training.cpp: the training options (batch, length of the run, learning-rate and weight-decay
// schedules, AdamW, mixed precision and loss scaling, --dry-run) and their checks.
#include <sstream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"

namespace tessera {
namespace {

// --rampup-batch-size START INCR SAMPLES: three integers, on the command line or as one INI value.
std::vector<int64_t> parse_rampup(const std::vector<std::string>& tokens) {
  std::string text;
  for (const std::string& t : tokens) text += (text.empty() ? "" : " ") + t;
  std::vector<int64_t> values;
  std::istringstream in(text);
  std::string item;
  while (in >> item) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size())
      throw ConfigError("--rampup-batch-size " + text + ": '" + item +
                        "' is not an integer (give START INCR SAMPLES, e.g. 16 16 "
                        "500000)");
    values.push_back(v);
  }
  if (!tokens.empty() && values.size() != 3)
    throw ConfigError("--rampup-batch-size " + text +
                      ": give three numbers, START INCR SAMPLES (e.g. --rampup-batch-size 16 16 "
                      "500000)");
  return values;
}

class TrainingOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    TrainConfig& t = o.train;
    p.group("Training")
        .add_options()("micro-batch-size", po::value(&t.micro_batch_size)->default_value(1),
                       "samples per micro-batch")(
            "global-batch-size", po::value(&t.global_batch_size)->default_value(0),
            "samples per iteration (0: micro-batch-size * DP); "
            "gradients accumulate over micro-batches")(
            "train-iters", po::value(&t.train_iters)->default_value(0), "iterations to train")(
            "lr", po::value(&t.lr)->default_value(1e-4), "peak learning rate")(
            "min-lr", po::value(&t.min_lr)->default_value(0.0),
            "learning rate at the end of decay")(
            "lr-decay-style", po::value(&t.lr_decay_style)->default_value("linear"),
            "constant | linear | cosine | inverse-square-root | WSD (docs/training.md)")(
            "lr-warmup-iters", po::value(&t.lr_warmup_iters)->default_value(0),
            "linear warm-up iterations")("lr-warmup-init",
                                         po::value(&t.lr_warmup_init)->default_value(0.0),
                                         "learning rate the warm-up starts from")(
            "lr-wsd-decay-style", po::value(&t.lr_wsd_decay_style),
            "WSD's final decay: exponential (the default) | linear | cosine | minus_sqrt")(
            "lr-wsd-decay-iters", po::value(&t.lr_wsd_decay_iters)->default_value(0),
            "WSD: iterations of the final decay, the last ones of the decay phase")(
            "lr-wsd-decay-samples", po::value(&t.lr_wsd_decay_samples)->default_value(0),
            "WSD: samples of the final decay (instead of --lr-wsd-decay-iters)")(
            "lr-decay-iters", po::value(&t.lr_decay_iters)->default_value(0),
            "iterations over which to decay (0: train-iters)")(
            "lr-warmup-fraction", po::value(&t.lr_warmup_fraction)->default_value(0.0),
            "warm-up as a fraction of the decay iterations (instead of --lr-warmup-iters)")(
            "train-samples", po::value(&t.train_samples)->default_value(0),
            "samples to train (instead of --train-iters): train-samples / global batch iterations")(
            "lr-decay-samples", po::value(&t.lr_decay_samples)->default_value(0),
            "samples over which to decay (instead of --lr-decay-iters)")(
            "lr-warmup-samples", po::value(&t.lr_warmup_samples)->default_value(0),
            "warm-up samples (instead of --lr-warmup-iters)")(
            "rampup-batch-size", po::value(&rampup_)->multitoken(),
            "START INCR SAMPLES: grow the global batch from START by INCR over the first SAMPLES "
            "samples (needs --train-samples)")(
            "weight-decay", po::value(&t.weight_decay)->default_value(0.01),
            "decoupled weight decay for weight matrices and embeddings (not biases or LayerNorm)")(
            "weight-decay-incr-style",
            po::value(&t.weight_decay_incr_style)->default_value("constant"),
            "constant (--weight-decay) | linear | cosine: from --start-weight-decay to "
            "--end-weight-decay over the run")(
            "start-weight-decay", po::value(&start_weight_decay_),
            "weight decay at the start (--weight-decay-incr-style linear or cosine)")(
            "end-weight-decay", po::value(&end_weight_decay_),
            "weight decay at the end of the run (--weight-decay-incr-style linear or cosine)")(
            "clip-grad", po::value(&t.clip_grad)->default_value(1.0),
            "clip the global gradient norm to this (0: off)")(
            "adam-beta1", po::value(&t.adam_beta1)->default_value(0.9), "Adam beta1")(
            "adam-beta2", po::value(&t.adam_beta2)->default_value(0.999), "Adam beta2")(
            "adam-eps", po::value(&t.adam_eps)->default_value(1e-8), "Adam epsilon")(
            "seed", po::value(&t.seed)->default_value(1234),
            "seed of initialization and data order")(
            "bf16", po::bool_switch(&bf16_),
            "mixed precision: bf16 activations and weights in the passes, f32 master weights, "
            "gradients and Adam moments")("fp16", po::bool_switch(&fp16_),
                                          "mixed precision in fp16, with loss scaling")(
            "loss-scale", po::value(&t.loss_scale)->default_value(0.0),
            "--fp16: a constant loss scale (0: dynamic scaling)")(
            "initial-loss-scale", po::value(&t.initial_loss_scale)->default_value(4294967296.0),
            "--fp16 dynamic scaling: the first scale")(
            "min-loss-scale", po::value(&t.min_loss_scale)->default_value(1.0),
            "--fp16 dynamic scaling: the scale never goes below this")(
            "loss-scale-window", po::value(&t.loss_scale_window)->default_value(1000),
            "--fp16 dynamic scaling: good steps in a row before the scale doubles")(
            "hysteresis", po::value(&t.hysteresis)->default_value(2),
            "--fp16 dynamic scaling: overflows in a row before the scale halves")(
            "dry-run", po::bool_switch(&t.dry_run),
            "print parameter count and memory estimate, then exit");
    // A command-line option replaces the config file's alternatives to it (configs/*.ini set
    // train-iters and lr-warmup-iters; `--train-samples N` on the command line switches the run).
    p.alternatives({"train-iters", "train-samples"});
    p.alternatives({"train-iters", "rampup-batch-size"});
    p.alternatives({"lr-warmup-iters", "lr-warmup-samples", "lr-warmup-fraction"});
    p.alternatives({"lr-decay-iters", "lr-decay-samples"});
    p.alternatives({"lr-wsd-decay-iters", "lr-wsd-decay-samples"});
    p.alternatives({"bf16", "fp16"});
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes&) override {
    TrainConfig& t = o.train;
    if (p.given("start-weight-decay")) t.start_weight_decay = start_weight_decay_;
    if (p.given("end-weight-decay")) t.end_weight_decay = end_weight_decay_;
    t.rampup_batch_size = parse_rampup(rampup_);
    if (bf16_ && fp16_) throw ConfigError("--bf16 and --fp16 both given; choose one");
    t.compute_dtype = bf16_ ? DType::BF16 : fp16_ ? DType::F16 : DType::F32;
  }

 private:
  std::vector<std::string> rampup_;
  bool bf16_ = false, fp16_ = false;
  double start_weight_decay_ = 0, end_weight_decay_ = 0;
};

}  // namespace

std::unique_ptr<OptionGroup> make_training_options() {
  return std::make_unique<TrainingOptions>();
}

}  // namespace tessera
