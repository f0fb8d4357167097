// test_options_golden.cpp: tessera-train's --help text, a full config's to_ini() text (what every
// checkpoint stores) and its start-up notes, byte for byte against golden files (issue 36: the
// options may be reorganized, never changed for a user).
//
// After an intended change to an option, regenerate the files and review the diff:
//   TESSERA_UPDATE_GOLDEN=1 build/bin/test_core --gtest_filter='OptionsGolden.*'
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "options/options.hpp"

using namespace tessera;

namespace {

const std::string kGolden = std::string(TESSERA_SOURCE_DIR) + "/tests/train/golden/";

bool parse_args(std::vector<std::string> args, RunOptions& o) {
  args.insert(args.begin(), "tessera-train");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return parse_run_options(static_cast<int>(argv.size()), argv.data(), o);
}

// `text` with the source directory written as <source> (config paths appear in the notes).
std::string without_source_dir(std::string text) {
  const std::string dir = TESSERA_SOURCE_DIR;
  for (size_t at = text.find(dir); at != std::string::npos; at = text.find(dir, at))
    text.replace(at, dir.size(), "<source>");
  return text;
}

// `text` against the golden file `name`; with TESSERA_UPDATE_GOLDEN=1 the file is rewritten.
void expect_golden(const std::string& name, const std::string& text) {
  const std::string path = kGolden + name;
  const std::string actual = without_source_dir(text);
  const char* update = std::getenv("TESSERA_UPDATE_GOLDEN");
  if (update && std::string(update) == "1") {
    std::ofstream(path, std::ios::binary) << actual;
    return;
  }
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << "missing golden file " << path;
  std::ostringstream want;
  want << in.rdbuf();
  ASSERT_FALSE(actual.empty());
  if (want.str() == actual) return;
  // Name the first line that differs (the whole texts are long).
  std::istringstream a(actual), w(want.str());
  std::string la, lw;
  int line = 1;
  while (true) {
    const bool ga = static_cast<bool>(std::getline(a, la)),
               gw = static_cast<bool>(std::getline(w, lw));
    if (!ga && !gw) break;
    if (!ga || !gw || la != lw) {
      ADD_FAILURE() << path << " differs at line " << line << ":\n  golden: " << (gw ? lw : "<end>")
                    << "\n  actual: " << (ga ? la : "<end>")
                    << "\n(TESSERA_UPDATE_GOLDEN=1 rewrites the file after an intended change)";
      return;
    }
    ++line;
  }
  ADD_FAILURE() << path << " differs (line endings or a final newline)";
}

// A config with a value other than the default in every group of options, given through a config
// file and the command line (which replaces some of the file's alternatives).
std::vector<std::string> full_config() {
  return {"--config", std::string(TESSERA_SOURCE_DIR) + "/configs/gpt2-tiny.ini",
          // Model
          "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
          "--ffn-hidden-size", "192", "--seq-length", "64", "--max-position-embeddings", "128",
          "--make-vocab-size-divisible-by", "64", "--init-method-std", "0.01", "--norm-epsilon",
          "1e-06", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
          "--position-embedding-type", "rope", "--rotary-base", "500000", "--rotary-percent", "0.5",
          "--use-rope-scaling", "--rope-scaling-factor", "8", "--normalization", "RMSNorm",
          "--swiglu", "--group-query-attention", "--num-query-groups", "2",
          "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias",
          "--kv-channels", "16", "--apply-layernorm-1p", "--rotary-interleaved",
          // Mixture of Experts
          "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
          "--moe-layer-freq", "2", "--moe-router-load-balancing-type", "seq_aux_loss",
          "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
          "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "64",
          "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
          "--moe-pad-expert-input-to-capacity", "--expert-model-parallel-size", "2",
          "--moe-token-dispatcher-type", "allgather", "--moe-grouped-gemm",
          // Parallelism
          "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--context-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--sequence-parallel", "--ddp-bucket-size", "1000", "--use-distributed-optimizer",
          "--overlap-grad-reduce", "true", "--overlap-param-gather",
          // Training
          "--micro-batch-size", "2", "--global-batch-size", "16", "--train-samples", "1600", "--lr",
          "0.0003", "--min-lr", "3e-05", "--lr-decay-style", "WSD", "--lr-warmup-samples", "80",
          "--lr-wsd-decay-style", "cosine", "--lr-wsd-decay-samples", "160", "--lr-decay-samples",
          "1600", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01",
          "--end-weight-decay", "0.1", "--clip-grad", "0.5", "--adam-beta1", "0.8", "--adam-beta2",
          "0.9", "--adam-eps", "1e-06", "--seed", "7", "--fp16", "--initial-loss-scale", "65536",
          "--min-loss-scale", "2", "--loss-scale-window", "500", "--hysteresis", "3",
          // Memory
          "--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "1",
          // Data
          "--data-path", "1", "/nonexistent/tessera-golden/prefix", "--split", "90,9,1",
          "--data-cache-path", "/nonexistent/tessera-golden/cache", "--tokenizer-type",
          "GPT2BPETokenizer",
          // Checkpoints and evaluation
          "--save", "/nonexistent/tessera-golden/save", "--save-interval", "5",
          "--keep-checkpoints", "2", "--load", "/nonexistent/tessera-golden/load",
          "--no-load-optim", "--no-load-rng", "--no-save-optim", "--async-save", "--exit-interval",
          "100", "--exit-duration-in-mins", "60", "--eval-interval", "10", "--eval-iters", "2",
          "--full-validation",
          // Logging and system
          "--log-interval", "1", "--log-level", "debug", "--log-file", "/tmp/golden.log",
          "--log-all-ranks", "--metrics-file", "/tmp/golden.jsonl", "--peak-tflops", "100",
          "--timing-log-level", "2", "--timing-log-option", "all", "--log-params-norm",
          "--log-num-zeros-in-grad", "--tensorboard-dir", "/tmp/golden-tb",
          "--tensorboard-log-interval", "2", "--log-timers-to-tensorboard",
          "--log-validation-ppl-to-tensorboard", "--memory-report-interval", "5",
          "--distributed-timeout-minutes", "5", "--threads", "1", "--device", "cpu", "--profile",
          "--profile-step-start", "2", "--profile-step-end", "3", "--profile-ranks", "0,1",
          // Accepted for Megatron-LM's scripts
          "--use-flash-attn", "--DDP-impl", "local", "--num-workers", "2", "--transformer-impl",
          "local", "--override-opt_param-scheduler"};
}

}  // namespace

TEST(OptionsGolden, HelpTextIsUnchanged) {
  RunOptions o;
  testing::internal::CaptureStdout();
  const bool ran = parse_args({"--help"}, o);
  const std::string help = testing::internal::GetCapturedStdout();
  EXPECT_FALSE(ran);
  EXPECT_NE(help.find("--tensor-model-parallel-size"), std::string::npos);
  expect_golden("help.txt", help);
}

TEST(OptionsGolden, FullConfigIniAndNotesAreUnchanged) {
  RunOptions o;
  ASSERT_TRUE(parse_args(full_config(), o));
  EXPECT_NE(o.train.config_text.find("num-experts = 4"), std::string::npos);
  expect_golden("full_config.ini", o.train.config_text);
  std::string notes;
  for (const std::string& n : o.notes) notes += n + "\n";
  EXPECT_GE(o.notes.size(), 5u);
  expect_golden("full_config_notes.txt", notes);
}

// The notes the full config does not reach: a virtual pipeline of one chunk and a fresh
// --use-checkpoint-args.
TEST(OptionsGolden, OtherNotesAreUnchanged) {
  RunOptions o;
  ASSERT_TRUE(parse_args(
      {"--config", std::string(TESSERA_SOURCE_DIR) + "/configs/gpt2-tiny.ini", "--train-samples",
       "320", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
       "--load", "/nonexistent/tessera-golden/load", "--use-checkpoint-args",
       "--exit-signal-handler", "--no-masked-softmax-fusion"},
      o));
  std::string notes;
  for (const std::string& n : o.notes) notes += n + "\n";
  EXPECT_GE(o.notes.size(), 4u);
  expect_golden("other_notes.txt", notes);
}

TEST(OptionsGolden, DefaultIniIsUnchanged) {
  RunOptions o;
  ASSERT_TRUE(parse_args({"--train-iters", "1"}, o));
  expect_golden("default_config.ini", o.train.config_text);
}
