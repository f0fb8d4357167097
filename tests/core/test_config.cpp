// test_config.cpp: INI config plus command-line overrides, and the errors for bad input.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/config_schema.hpp"
#include "options/options.hpp"

using namespace tessera;

namespace {
// A run needs its length: cases about other options get --train-iters 1 unless they set it.
bool parse(std::vector<std::string> args, RunOptions& o) {
  bool length = false;
  for (const std::string& a : args)
    length |=
        a == "--train-iters" || a == "--train-samples" || a == "--dry-run" || a == "--skip-train";
  if (!length) args.insert(args.end(), {"--train-iters", "1"});
  args.insert(args.begin(), "tessera-train");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return parse_run_options(static_cast<int>(argv.size()), argv.data(), o);
}
std::string error_of(std::vector<std::string> args) {
  RunOptions o;
  try {
    parse(std::move(args), o);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
std::string write_ini(const std::string& text) {
  char name[] = "/tmp/tessera_cfg_XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(name) << text;
  return name;
}
}  // namespace

TEST(Config, IniThenCommandLineOverride) {
  const std::string ini = write_ini(
      "# a comment\nnum-layers = 3\nhidden-size = 96\nnum-attention-heads = 6\nlr = 0.002\n"
      "lr-decay-style = cosine\n");
  RunOptions o;
  ASSERT_TRUE(parse({"--config", ini, "--hidden-size", "48", "--train-iters", "7"}, o));
  EXPECT_EQ(o.model.num_layers, 3);
  EXPECT_EQ(o.model.hidden_size, 48);  // command line wins
  EXPECT_EQ(o.model.num_attention_heads, 6);
  EXPECT_DOUBLE_EQ(o.train.lr, 0.002);
  EXPECT_EQ(o.train.lr_decay_style, "cosine");
  EXPECT_EQ(o.train.train_iters, 7);
  std::remove(ini.c_str());
}

// argparse's rule, which launch scripts rely on (`... --train-iters 10 $EXTRA_ARGS`): a repeated
// option takes its last value, on its own or over a config file's.
TEST(Config, ARepeatedOptionTakesItsLastValue) {
  RunOptions o;
  ASSERT_TRUE(parse({"--train-iters", "10", "--lr", "0.1", "--train-iters", "20", "--lr", "0.5",
                     "--train-iters", "30"},
                    o));
  EXPECT_EQ(o.train.train_iters, 30);
  EXPECT_DOUBLE_EQ(o.train.lr, 0.5);
  const std::string ini = write_ini("num-layers = 3\n");
  RunOptions p;
  ASSERT_TRUE(parse({"--config", ini, "--num-layers", "4", "--num-layers", "5"}, p));
  EXPECT_EQ(p.model.num_layers, 5);
  std::remove(ini.c_str());
}

// Found by tests/fuzz/fuzz_config.cpp: Boost.ProgramOptions loops forever building the message of
// a bad value that holds one of its placeholders. Refused first, from a file or the command line.
TEST(Config, APlaceholderInAValueIsRefusedNotLooped) {
  const std::string ini = write_ini("lr = argument ('%value%')\n");
  const std::string e = error_of({"--config", ini});
  EXPECT_NE(e.find("contains '%value%', which the option parser cannot report on"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find(ini), std::string::npos) << e;
  std::remove(ini.c_str());
  EXPECT_NE(error_of({"--lr", "%option%"}).find("command-line argument 2 contains '%option%'"),
            std::string::npos);
  // The second loop the fuzzer found: a line that is not "key = value" and names the
  // %invalid_line% placeholder (tests/fuzz/regressions/config/). Any %word% is refused.
  const std::string line = write_ini("%invalid_line%%\n");
  EXPECT_NE(error_of({"--config", line}).find("contains '%invalid_line%'"), std::string::npos);
  std::remove(line.c_str());
  EXPECT_NE(error_of({"--save", "/tmp/%any_future_name%"}).find("'%any_future_name%'"),
            std::string::npos);
  // A lone '%' (a path such as run_%j) is a value like any other.
  EXPECT_EQ(error_of({"--save", "/tmp/run_%j", "--load", "/tmp/50%"}), "");
}

TEST(Config, BadInputNamesTheOption) {
  EXPECT_NE(error_of({"--bogus-option", "1"}).find("bogus-option"), std::string::npos);
  const std::string heads = error_of({"--hidden-size", "64", "--num-attention-heads", "5"});
  EXPECT_NE(heads.find("--num-attention-heads=5"), std::string::npos) << heads;
  EXPECT_NE(heads.find("--hidden-size=64"), std::string::npos) << heads;
  const std::string seq = error_of({"--seq-length", "128", "--max-position-embeddings", "64"});
  EXPECT_NE(seq.find("--seq-length=128"), std::string::npos) << seq;
  EXPECT_NE(error_of({"--micro-batch-size", "0"}).find("--micro-batch-size=0"), std::string::npos);
  EXPECT_NE(error_of({"--global-batch-size", "6", "--micro-batch-size", "4"}).find("multiple"),
            std::string::npos);
  EXPECT_NE(error_of({"--lr-decay-style", "step"}).find("constant, linear, cosine"),
            std::string::npos);
  EXPECT_NE(error_of({"--config", "/nonexistent/x.ini"}).find("/nonexistent/x.ini"),
            std::string::npos);
  EXPECT_NE(error_of({"--num-layers", "abc"}).find("num-layers"), std::string::npos);
  const std::string ini = write_ini("hidden-sise = 64\n");
  const std::string bad_key = error_of({"--config", ini});
  EXPECT_NE(bad_key.find(ini), std::string::npos) << bad_key;
  EXPECT_NE(bad_key.find("hidden-sise"), std::string::npos) << bad_key;
  std::remove(ini.c_str());
}

TEST(Config, DryRunReportCountsGpt2Small) {
  RunOptions o;
  ASSERT_TRUE(parse({"--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                     "--seq-length", "1024", "--vocab-size", "50257"},
                    o));
  EXPECT_EQ(o.model.num_parameters(), 124439808);  // GPT-2 small, as Hugging Face counts it
  EXPECT_EQ(o.model.padded_vocab_size(1), 50304);
  const std::string r = dry_run_report(o, 1);
  EXPECT_NE(r.find("parameters: 124439808"), std::string::npos) << r;
  EXPECT_NE(r.find("activations"), std::string::npos) << r;
}

// Mixtral-8x7B's shape: the published 46.7B parameters, 12.9B active per token; Megatron's MoE
// options land in the model; bad ones are one line naming the option.
TEST(Config, MoEOptionsMixtralCountsAndBadInput) {
  RunOptions o;
  ASSERT_TRUE(parse({"--num-layers",
                     "32",
                     "--hidden-size",
                     "4096",
                     "--num-attention-heads",
                     "32",
                     "--group-query-attention",
                     "--num-query-groups",
                     "8",
                     "--ffn-hidden-size",
                     "14336",
                     "--swiglu",
                     "--num-experts",
                     "8",
                     "--moe-router-topk",
                     "2",
                     "--position-embedding-type",
                     "rope",
                     "--normalization",
                     "RMSNorm",
                     "--untie-embeddings-and-output-weights",
                     "--disable-bias-linear",
                     "--seq-length",
                     "4096",
                     "--vocab-size",
                     "32000",
                     "--dry-run"},
                    o));
  EXPECT_EQ(o.model.num_parameters(), 46702792704);
  EXPECT_EQ(o.model.num_active_parameters(), 12879925248);
  const std::string r = dry_run_report(o, 1);
  EXPECT_NE(r.find("parameters: 46702792704"), std::string::npos) << r;
  EXPECT_NE(r.find("MoE: 12879925248 parameters active per token"), std::string::npos) << r;
  RunOptions m;
  ASSERT_TRUE(
      parse({"--num-experts", "4", "--moe-layer-freq", "([1]*1+[0])*1",
             "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
             "--moe-router-score-function", "sigmoid", "--moe-shared-expert-intermediate-size",
             "32", "--moe-router-load-balancing-type", "seq_aux_loss"},
            m));
  EXPECT_TRUE(m.model.is_moe_layer(0));
  EXPECT_FALSE(m.model.is_moe_layer(1));
  EXPECT_DOUBLE_EQ(m.model.moe_expert_capacity_factor, 1.5);
  EXPECT_EQ(m.model.moe_token_drop_policy, "position");
  auto has = [](const std::string& e, const std::string& what) {
    EXPECT_NE(e.find(what), std::string::npos) << "error: '" << e << "' lacks '" << what << "'";
  };
  has(error_of({"--num-experts", "4", "--moe-router-topk", "5"}),
      "--moe-router-topk=5 is out of range for --num-experts=4");
  has(error_of({"--num-experts", "4", "--moe-token-drop-policy", "probs"}),
      "--moe-token-drop-policy needs --moe-expert-capacity-factor");
  has(error_of({"--num-experts", "4", "--moe-pad-expert-input-to-capacity"}),
      "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  has(error_of({"--num-experts", "6", "--expert-model-parallel-size", "4"}),
      "--expert-model-parallel-size=4 does not divide --num-experts=6");
  has(error_of({"--num-experts", "4", "--moe-layer-freq", "[1,0,1]"}),
      "--moe-layer-freq=[1,0,1] has 3 entries for 2 layers");
  has(error_of({"--num-experts", "4", "--moe-layer-freq", "[1,2]"}), "entry other than 0 or 1");
  has(error_of({"--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"}),
      "sinkhorn balancing is not offered by Tessera");
  has(error_of({"--num-experts", "4", "--moe-expert-capacity-factor", "-1"}),
      "--moe-expert-capacity-factor=-1 is out of range");
  has(error_of({"--expert-model-parallel-size", "2"}), "needs --num-experts");
  has(error_of({"--num-experts", "4", "--moe-token-dispatcher-type", "flex"}),
      "--moe-token-dispatcher-type=flex is not known");
  has(error_of({"--num-experts", "4", "--moe-grouped-gemm"}),
      "--moe-grouped-gemm: the grouped expert GEMMs take no biases; add --disable-bias-linear");
}

TEST(Config, DryRunBytesPerParameterFollowMegatronsTable) {
  // Mixed precision: 18 B per parameter replicated; 6 + 12/DP with the distributed optimizer.
  auto bytes = [](std::vector<std::string> args, int world) {
    RunOptions o;
    args.insert(args.end(),
                {"--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
                 "--seq-length", "128", "--vocab-size", "1000", "--global-batch-size", "64"});
    EXPECT_TRUE(parse(args, o));
    const std::string r = dry_run_report(o, world);
    const std::string key = "bytes per parameter ";
    const size_t at = r.find(key);
    EXPECT_NE(at, std::string::npos) << r;
    return std::atof(r.c_str() + at + key.size());
  };
  EXPECT_DOUBLE_EQ(bytes({"--bf16"}, 4), 18.0);
  EXPECT_DOUBLE_EQ(bytes({"--bf16", "--use-distributed-optimizer"}, 1), 18.0);
  EXPECT_DOUBLE_EQ(bytes({"--bf16", "--use-distributed-optimizer"}, 2), 12.0);
  EXPECT_DOUBLE_EQ(bytes({"--bf16", "--use-distributed-optimizer"}, 4), 9.0);
  EXPECT_DOUBLE_EQ(bytes({"--bf16", "--use-distributed-optimizer"}, 8), 7.5);
  EXPECT_DOUBLE_EQ(bytes({"--use-distributed-optimizer"}, 4), 10.0);  // f32: 8 + 8/DP
  EXPECT_DOUBLE_EQ(bytes({}, 4), 16.0);
}

TEST(Config, DryRunActivationsShrinkWithRecomputation) {
  auto act = [](std::vector<std::string> args) {
    RunOptions o;
    args.insert(args.end(), {"--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads",
                             "8", "--seq-length", "1024", "--vocab-size", "1000", "--bf16"});
    EXPECT_TRUE(parse(args, o));
    const std::string r = dry_run_report(o, 1);
    const std::string key = "activations kept per layer per micro-batch ";
    const size_t at = r.find(key);
    EXPECT_NE(at, std::string::npos) << r;
    return std::atof(r.c_str() + at + key.size());
  };
  // Per layer, N = 1024 tokens, C = 1024, bf16: none keeps 16 N C elements plus f32 statistics
  // (32.05 MiB); selective 9 N C (18.00 MiB); full only the layer output (N C x 2 B = 2 MiB).
  const double none = act({}), sel = act({"--recompute-granularity", "selective"}),
               full = act({"--checkpoint-activations"});
  EXPECT_DOUBLE_EQ(full, 2.0);
  EXPECT_DOUBLE_EQ(sel, 18.0);
  EXPECT_NEAR(none, 32.0 + 1024 * (4 + 8) * 4 / 1048576.0, 0.006);
}

// Issue 27: what a Megatron user's script and shell give the parser.
TEST(Config, EmptyValuesStrayWordsAndConfigDirectoriesAreOneLineErrors) {
  EXPECT_EQ(error_of({"--save", ""}), "--save is empty; give it a value or leave the option out");
  EXPECT_EQ(error_of({"--data-path", ""}),
            "--data-path is empty; give it a value or leave the option out");
  const std::string ini = write_ini("train-iters = 3\ntensorboard-dir =\n");
  EXPECT_EQ(error_of({"--config", ini}), "--tensorboard-dir is empty in config file '" + ini +
                                             "'; give it a value or leave the option out");
  std::remove(ini.c_str());
  EXPECT_EQ(error_of({"--bf16", "yes"}),
            "unexpected argument 'yes' after --bf16, a switch: leave the value out (on), or give "
            "true or false");
  EXPECT_EQ(error_of({"--lr", "0.1", "0.2"}),
            "unexpected argument '0.2' after --lr, which takes one value (quote a value that has "
            "spaces)");
  EXPECT_NE(error_of({"--config", "/tmp"}).find("--config '/tmp' is a directory"),
            std::string::npos);
  RunOptions o;
  EXPECT_THROW(parse_run_options(3, std::vector<const char*>{"t", "--num-layers", "2"}.data(), o),
               ConfigError);  // no --train-iters / --train-samples
}

TEST(Config, TheCommandLineReplacesTheConfigFilesAlternatives) {
  const std::string ini = write_ini(
      "train-iters = 200\nlr-warmup-iters = 10\nlr-decay-iters = 150\nbf16 = true\n"
      "global-batch-size = 8\n");
  RunOptions o;
  ASSERT_TRUE(parse(
      {"--config", ini, "--train-samples", "640", "--lr-warmup-fraction", "0.1", "--fp16"}, o));
  EXPECT_EQ(o.train.train_iters, 0);
  EXPECT_EQ(o.train.train_samples, 640);
  EXPECT_EQ(o.train.lr_warmup_iters, 0);
  EXPECT_DOUBLE_EQ(o.train.lr_warmup_fraction, 0.1);
  EXPECT_EQ(o.train.lr_decay_iters, 150);  // no alternative given: the config's stays
  EXPECT_EQ(o.train.compute_dtype, DType::F16);
  ASSERT_EQ(o.notes.size(), 3u);
  EXPECT_EQ(o.notes[0],
            "--train-samples on the command line replaces train-iters = 200 of config "
            "file '" +
                ini + "'");
  // A conflict that is left names the options that came from the config file.
  RunOptions r;
  std::string e;
  try {
    parse({"--config", ini, "--rampup-batch-size", "4", "4", "8", "--train-samples", "64"}, r);
  } catch (const ConfigError& x) {
    e = r.with_origins(x.what());
  }
  EXPECT_NE(e.find("(--lr-warmup-iters and --lr-decay-iters are set in config file '" + ini + "')"),
            std::string::npos)
      << e;
  std::remove(ini.c_str());
}

TEST(Config, MegatronLaunchLineOptions) {
  RunOptions o;
  ASSERT_TRUE(parse({"--data-path", "1.0", "corpus/web", "--use-flash-attn", "--DDP-impl", "local",
                     "--tokenizer-type", "GPT2BPETokenizer"},
                    o));
  EXPECT_EQ(o.data_path.prefixes, std::vector<std::string>{"corpus/web"});
  EXPECT_TRUE(o.tokenizer_given);
  ASSERT_EQ(o.notes.size(), 3u);
  EXPECT_EQ(o.notes[0].rfind("--use-flash-attn: accepted without effect", 0), 0u) << o.notes[0];
  EXPECT_EQ(o.notes[1].rfind("--DDP-impl local: accepted without effect", 0), 0u) << o.notes[1];
  EXPECT_EQ(o.notes[2],
            "--data-path 1.0 corpus/web: a blend of one dataset, which is all of "
            "'corpus/web'");
  RunOptions b;
  ASSERT_TRUE(parse({"--data-path", "0.3", "a", "0.7", "b"}, b));
  EXPECT_EQ(b.data_path.prefixes, (std::vector<std::string>{"a", "b"}));
  EXPECT_DOUBLE_EQ(b.data_path.weights[0], 0.3);
  EXPECT_NE(error_of({"--DDP-impl", "fast"}).find("(allowed: local,torch)"), std::string::npos);
  EXPECT_NE(error_of({"--async-save"}).find("--async-save needs --save"), std::string::npos);
  EXPECT_NE(error_of({"--num-query-groups", "2"}).find("needs --group-query-attention"),
            std::string::npos);
}

TEST(Config, LoadOnADirectoryWithoutACheckpointStartsFresh) {
  char dir[] = "/tmp/tessera_load_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir;
  EXPECT_EQ(no_checkpoint_in(d + "/absent"), "it does not exist yet");
  EXPECT_EQ(no_checkpoint_in(d), "it is empty");
  std::ofstream(d + "/notes.txt") << "x";
  EXPECT_EQ(no_checkpoint_in(d), "it holds no latest_checkpointed_iteration.txt or iter_N");
  ASSERT_EQ(mkdir((d + "/iter_0000010.tmp").c_str(), 0755), 0);  // a first save that died
  EXPECT_NE(no_checkpoint_in(d), "");
  ASSERT_EQ(mkdir((d + "/iter_0000010").c_str(), 0755), 0);  // a checkpoint: loading judges it
  EXPECT_EQ(no_checkpoint_in(d), "");
  RunOptions o;
  ASSERT_TRUE(parse({"--load", d + "/absent", "--use-checkpoint-args"}, o));
  EXPECT_TRUE(o.load_fresh);
  std::filesystem::remove_all(d);
}

// The model's options come from one table (model/config_schema.hpp, issue 55): each row declares
// its option with its GPTConfig field as the target, every declared option is in --help, no two
// options set one field, and --dry-run's architecture line is the rows' words.
namespace {
struct Declared {
  std::string name;
  size_t offset;  // of the target in GPTConfig
  bool flag = false, when_given = true;
};
class RecordingDeclarer : public OptionDeclarer {
 public:
  explicit RecordingDeclarer(const GPTConfig& m) : base_(reinterpret_cast<const char*>(&m)) {}
  std::vector<Declared> seen;
  void integer(const std::string& n, int* t, const std::string&) override { add(n, t); }
  void integer(const std::string& n, int64_t* t, const std::string&) override { add(n, t); }
  void real(const std::string& n, double* t, const std::string&) override { add(n, t); }
  void text(const std::string& n, std::string* t, const std::string&) override { add(n, t); }
  void flag(const std::string& n, bool* t, bool given, const std::string&) override {
    add(n, t);
    seen.back().flag = true;
    seen.back().when_given = given;
  }

 private:
  void add(const std::string& n, const void* t) {
    const auto at = static_cast<size_t>(reinterpret_cast<const char*>(t) - base_);
    ASSERT_LT(at, sizeof(GPTConfig)) << n << " does not set a field of the GPTConfig given";
    seen.push_back({n, at});
  }
  const char* base_;
};
}  // namespace

TEST(ConfigSchema, EveryModelOptionIsDeclaredFromTheTable) {
  GPTConfig m;
  RecordingDeclarer d(m);
  for (const char* g : {"Model", "Multi-latent attention (DeepSeek)", "Mixture of Experts"})
    declare_model_options(g, d, m);
  std::set<std::string> names;
  std::map<size_t, std::string> fields;
  for (const Declared& x : d.seen) {
    EXPECT_TRUE(names.insert(x.name).second) << x.name << " declared twice";
    const auto [it, fresh] = fields.emplace(x.offset, x.name);
    EXPECT_TRUE(fresh) << x.name << " and " << it->second << " set the same field";
  }
  // Every row that names an option of a --help group declares it; the rest are by hand.
  size_t rows = 0;
  for (const ModelField& f : model_fields())
    if (!f.group.empty()) {
      ++rows;
      EXPECT_TRUE(f.declare) << f.option;
    }
  EXPECT_EQ(d.seen.size(), rows);
  EXPECT_GE(rows, 60u);  // 65 when written
  // The table's switches: --disable-bias-linear clears its field, the others set theirs.
  for (const Declared& x : d.seen)
    if (x.flag) EXPECT_EQ(x.when_given, x.name != "disable-bias-linear") << x.name;
  // Every one is in --help, and parsing sets its field (three kinds).
  RunOptions o;
  testing::internal::CaptureStdout();
  EXPECT_FALSE(parse({"--help"}, o));
  const std::string help = testing::internal::GetCapturedStdout();
  for (const Declared& x : d.seen)
    EXPECT_NE(help.find("  --" + x.name + " "), std::string::npos) << x.name << " not in --help";
  ASSERT_TRUE(parse({"--disable-bias-linear", "--kv-channels", "24", "--rotary-base", "500000",
                     "--num-experts", "2", "--moe-layer-freq", "[1,0]", "--hidden-dropout", "0.25"},
                    o));
  EXPECT_FALSE(o.model.add_bias_linear);
  EXPECT_EQ(o.model.kv_channels, 24);
  EXPECT_EQ(o.model.rotary_base, 500000);
  EXPECT_EQ(o.model.moe_layer_freq, "[1,0]");
  EXPECT_EQ(o.model.hidden_dropout, 0.25);
  RunOptions plain;
  ASSERT_TRUE(parse({}, plain));
  EXPECT_TRUE(plain.model.add_bias_linear);
}

TEST(ConfigSchema, ArchitectureLineIsTheRowsWordsInOrder) {
  RunOptions o;
  ASSERT_TRUE(
      parse({"--config", std::string(TESSERA_SOURCE_DIR) + "/configs/deepseek-tiny.ini"}, o));
  EXPECT_EQ(o.model.describe(),
            "RoPE (base 10000, 8 of 24 features), RMSNorm, SwiGLU, multi-head attention, untied "
            "output layer, no linear biases, interleaved rotary pairs, multi-latent attention "
            "(query rank 32, key/value rank 24, heads of 16 + 8 RoPE features, values of 16, "
            "latent norms), YaRN x4 over 32 positions, MoE in 3 of 4 layers (8 experts of width "
            "32, top-2 sigmoid within the best 2 of 4 groups (a group's score: its top 2), expert "
            "bias (aux-loss-free), a shared expert of width 64, dropless)");
  RunOptions g;
  ASSERT_TRUE(
      parse({"--position-embedding-type", "alibi", "--squared-relu", "--group-query-attention",
             "--num-query-groups", "1", "--apply-layernorm-1p", "--kv-channels", "8"},
            g));
  EXPECT_EQ(g.model.describe(),
            "ALiBi, LayerNorm (1 + w), squared ReLU, multi-query attention (1 key/value head for "
            "4), output layer tied to the embedding, 8 channels per head");
}
