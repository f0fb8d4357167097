// test_config.cpp: INI config plus command-line overrides, and the errors for bad input.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "train/options.hpp"

using namespace tessera;

namespace {
bool parse(std::vector<std::string> args, RunOptions& o) {
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
