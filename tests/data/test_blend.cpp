// test_blend.cpp: Megatron's data blends. The blend order against a direct transcription of the
// formula over tens of thousands of samples (any access order), the blend's parsing and its
// errors, each sample read from the right dataset, and tessera-inspect's reads against the
// batches the trainer fed the model.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "data/blended_dataset.hpp"
#include "data/shard.hpp"
#include "options/options.hpp"
#include "run/inspect.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {

// The statement of the order: sample i takes the dataset d maximizing
// w_d * max(i, 1) - count_d (the first on ties), and that dataset's next sample.
std::vector<std::pair<int, int64_t>> reference_order(const std::vector<double>& w, int64_t n) {
  std::vector<int64_t> count(w.size(), 0);
  std::vector<std::pair<int, int64_t>> out;
  for (int64_t i = 0; i < n; ++i) {
    int best = -1;
    double best_error = 0;
    for (size_t d = 0; d < w.size(); ++d) {
      const double e = w[d] * std::max<double>(double(i), 1.0) - double(count[d]);
      if (best < 0 || e > best_error) {
        best = int(d);
        best_error = e;
      }
    }
    out.emplace_back(best, count[best]++);
  }
  return out;
}

std::vector<double> normalized(std::vector<double> w) {
  double s = 0;
  for (double x : w) s += x;
  for (double& x : w) x /= s;
  return w;
}

std::string error_of(const std::vector<std::string>& words) {
  try {
    parse_data_blend(words, "data-path");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(BlendIndex, FollowsMegatronsFormulaOverTensOfThousandsOfSamples) {
  const std::vector<std::vector<double>> cases = {
      {0.7, 0.2, 0.1}, {1, 1},          {1, 1, 1}, {0.5, 0.25, 0.125, 0.125},
      {3, 1e-3},       {0.3, 0.3, 0.4}, {1}};
  for (const auto& raw : cases) {
    const std::vector<double> w = normalized(raw);
    const int64_t n = 3 * BlendIndex::kBlock * 5 + 123;  // blocks, and a partial one
    const auto want = reference_order(w, n);
    BlendIndex index(w);
    // Sequential, then from the end backwards, then at random: the order does not depend on how
    // it is asked.
    for (int64_t i = 0; i < n; ++i) {
      const BlendIndex::Entry e = index.at(i);
      ASSERT_EQ(e.dataset, want[i].first) << "weights " << raw.size() << " sample " << i;
      ASSERT_EQ(e.sample, want[i].second) << "sample " << i;
    }
    BlendIndex cold(w);
    for (int64_t i = n - 1; i >= 0; i -= 997) ASSERT_EQ(cold.at(i).dataset, want[i].first) << i;
    std::mt19937_64 rng(7);
    for (int k = 0; k < 2000; ++k) {
      const int64_t i = int64_t(rng() % uint64_t(n));
      ASSERT_EQ(cold.at(i).sample, want[i].second) << i;
    }
    // counts_before(n): how many samples each dataset gave to the first n.
    for (int64_t m : {int64_t(0), int64_t(1), int64_t(4095), int64_t(4096), int64_t(4097), n}) {
      std::vector<int64_t> c(w.size(), 0);
      for (int64_t i = 0; i < m; ++i) ++c[want[i].first];
      EXPECT_EQ(index.counts_before(m), c) << m;
    }
  }
}

TEST(BlendIndex, SharesStayWithinOneSampleOfTheWeights) {
  const std::vector<double> w = normalized({0.7, 0.2, 0.1});
  BlendIndex index(w);
  for (int64_t n : {10, 100, 1000, 50000}) {
    const std::vector<int64_t> c = index.counts_before(n);
    for (size_t d = 0; d < w.size(); ++d)
      EXPECT_LE(std::abs(double(c[d]) - w[d] * double(n)), 1.0 + 1e-9) << d << " of " << n;
  }
  // The first samples, worked by hand: errors at i = 0 and 1 are the weights themselves (max(i,1)).
  // i=0: web (0.7); i=1: 0.7-1 < 0.2 -> code; i=2: 1.4-1=0.4 > 0.2 -> web; ...
  EXPECT_EQ(index.at(0).dataset, 0);
  EXPECT_EQ(index.at(1).dataset, 1);
  EXPECT_EQ(index.at(2).dataset, 0);
  // Ties go to the first: equal weights alternate 0, 1, 0, 1 ...
  BlendIndex even(normalized({1, 1}));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(even.at(i).dataset, i == 1 ? 1 : (i % 2)) << i;
}

TEST(DataBlend, ParsesWeightsAndPrefixes) {
  DataBlend one = parse_data_blend({"corpus/web"}, "data-path");
  EXPECT_EQ(one.prefixes, std::vector<std::string>{"corpus/web"});
  EXPECT_EQ(one.weights, std::vector<double>{1.0});
  // A config file's value is one word with spaces.
  DataBlend b = parse_data_blend({"0.7 web 0.2", "code", "0.1 books"}, "data-path");
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b.prefixes[2], "books");
  EXPECT_DOUBLE_EQ(b.weights[0], 0.7 / (0.7 + 0.2 + 0.1));
  EXPECT_DOUBLE_EQ(b.weights[1] + b.weights[0] + b.weights[2], 1.0);
  EXPECT_EQ(b.text, "0.7 web 0.2 code 0.1 books");
  DataBlend unnormalized = parse_data_blend({"30", "a", "10", "b"}, "data-path");
  EXPECT_DOUBLE_EQ(unnormalized.weights[0], 0.75);
  EXPECT_TRUE(parse_data_blend({}, "data-path").empty());

  EXPECT_NE(error_of({"0.7", "web", "0.3"}).find("--data-path 0.7 web 0.3: 3 words"),
            std::string::npos)
      << error_of({"0.7", "web", "0.3"});
  EXPECT_NE(error_of({"0.7", "web", "0", "code"}).find("the weight 0 of 'code' must be positive"),
            std::string::npos);
  EXPECT_NE(error_of({"web", "code"}).find("'web' (word 1) is not a weight"), std::string::npos);
  EXPECT_NE(error_of({"1", "web", "nan", "code"}).find("'nan' (word 3) is not a weight"),
            std::string::npos);
  EXPECT_NE(error_of({"1", "web", "2", "web"}).find("'web' is given twice"), std::string::npos);
}

// ---- over real shards --------------------------------------------------------------------------

namespace {

// Dataset d's tokens are d*1000 + (position in its corpus % 997) + 1, so a token names its
// dataset; documents of 20 to 59 tokens end with the end-of-document token 0.
class BlendShards : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera_blend_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::mt19937 rng(3);
    for (int d = 0; d < 3; ++d) {
      std::vector<uint32_t> tokens;
      std::vector<uint64_t> offsets{0};
      for (int doc = 0; doc < 60 + 40 * d; ++doc) {
        const int len = 20 + int(rng() % 40);
        for (int k = 0; k < len - 1; ++k)
          tokens.push_back(uint32_t(d * 1000 + tokens.size() % 997 + 1));
        tokens.push_back(0);
        offsets.push_back(tokens.size());
      }
      ShardMeta meta;
      meta.vocab_size = 4000;
      meta.eod_id = 0;
      meta.tokenizer = "test";
      write_shard(shard_path(prefix(d), 0), tokens, offsets, meta);
    }
  }
  void TearDown() override {
    for (int d = 0; d < 3; ++d) std::remove(shard_path(prefix(d), 0).c_str());
    rmdir(dir_.c_str());
  }
  std::string prefix(int d) const { return dir_ + "/ds" + std::to_string(d); }

  RunOptions options(const std::vector<std::string>& words) const {
    RunOptions o;
    o.data_path = parse_data_blend(words, "data-path");
    o.model = testing_util::small_gpt(32, 4, 16, 0);
    o.train = testing_util::tiny_schedule();
    o.train.global_batch_size = 8;
    o.train.micro_batch_size = 2;
    o.train.train_iters = 6;
    o.split = "90,10,0";
    return o;
  }

  std::string dir_;
};

// Records every sample the trainer reads (index -> tokens).
class Recording final : public TokenDataset {
 public:
  explicit Recording(const TokenDataset& d) : d_(d) {}
  std::string describe() const override { return d_.describe(); }
  int seq_length() const override { return d_.seq_length(); }
  int64_t num_samples() const override { return d_.num_samples(); }
  void get(int64_t i, int32_t* out) const override {
    d_.get(i, out);
    std::lock_guard<std::mutex> lock(mu_);
    read_[i] = std::vector<int32_t>(out, out + seq_length() + 1);
  }
  bool has_loss_mask() const override { return d_.has_loss_mask(); }
  void get_loss_mask(int64_t i, uint8_t* out) const override { d_.get_loss_mask(i, out); }
  std::map<int64_t, std::vector<int32_t>> read() const {
    std::lock_guard<std::mutex> lock(mu_);
    return read_;
  }

 private:
  const TokenDataset& d_;
  mutable std::mutex mu_;
  mutable std::map<int64_t, std::vector<int32_t>> read_;
};

}  // namespace

TEST_F(BlendShards, EachSampleComesFromItsDatasetInTheBlendOrder) {
  RunOptions o = options({"0.5", prefix(0), "0.3", prefix(1), "0.2", prefix(2)});
  auto data = open_train_data(o);
  EXPECT_EQ(o.model.vocab_size, 4000);
  const auto& blend = dynamic_cast<const BlendedDataset&>(*data);
  ASSERT_EQ(blend.num_datasets(), 3);
  const auto want = reference_order(blend.blend().weights, 3000);
  std::vector<int32_t> got(17), direct(17);
  for (int64_t i = 0; i < 3000; ++i) {
    data->get(i, got.data());
    const int d = want[i].first;
    blend.dataset(d).get(want[i].second, direct.data());
    ASSERT_EQ(got, direct) << "sample " << i;
    for (int32_t t : got)
      if (t != 0) ASSERT_EQ(t / 1000, d) << "sample " << i << " holds a token of another dataset";
  }
  // Far past one epoch of the smallest dataset: later epochs reshuffle.
  EXPECT_GT(want.back().second, blend.dataset(2).num_samples());
  // The split is per dataset: dataset 2's train split is its first 90% of documents.
  EXPECT_EQ(blend.dataset(2).doc_begin(), 0);
  EXPECT_EQ(blend.dataset(2).doc_end(), 126);
  auto valid = open_valid_data(o);
  const auto& vb = dynamic_cast<const BlendedDataset&>(*valid);
  EXPECT_EQ(vb.dataset(2).doc_begin(), 126);
  EXPECT_EQ(vb.dataset(2).doc_end(), 140);
  // The log names every dataset with its weight and the samples the run draws from it.
  const std::vector<std::string> lines = data_report(*data, o.train, 1);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_NE(lines[0].find("48 samples over the run"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("weight 0.5: train split, documents 0-54 of 60"), std::string::npos)
      << lines[1];
  EXPECT_NE(lines[1].find("; 24 drawn over the run"), std::string::npos) << lines[1];
  EXPECT_NE(lines[3].find("; 10 drawn over the run"), std::string::npos) << lines[3];
}

TEST_F(BlendShards, BadBlendsAreOneLineErrors) {
  RunOptions o = options({"0.5", prefix(0), "0.5", dir_ + "/absent"});
  try {
    open_train_data(o);
    FAIL() << "a missing prefix was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + dir_ + "/absent' names no shards"),
              std::string::npos)
        << e.what();
  }
  // Another vocabulary in the blend.
  ShardMeta meta;
  meta.vocab_size = 5000;
  meta.eod_id = 0;
  meta.tokenizer = "test";
  write_shard(shard_path(dir_ + "/other", 0), {1, 2, 0}, {0, 3}, meta);
  o = options({"0.5", prefix(0), "0.5", dir_ + "/other"});
  try {
    open_train_data(o);
    FAIL() << "datasets of two vocabularies were blended";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "the shards of '" + dir_ +
                  "/other' were made with another tokenizer than those of '" + prefix(0) + "'"),
              std::string::npos)
        << e.what();
  }
  std::remove(shard_path(dir_ + "/other", 0).c_str());
  // A dataset too small for one sample of its split.
  o = options({"0.5", prefix(0), "0.5", prefix(1)});
  o.model.seq_length = 16;
  o.split = "0.1,99.9,0";
  try {
    open_train_data(o);
    FAIL() << "an empty train split was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the train split of '" + prefix(0) +
                                         "' (--data-path with --split 0.1,99.9,0) has no sample"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(BlendShards, InspectReadsWhatTheTrainerFeedsTheModel) {
  RunOptions o = options({"0.6", prefix(0), "0.3", prefix(1), "0.1", prefix(2)});
  o.train.rampup_batch_size = {4, 2, 12};  // iterations of 4, 4, 6, then 8 samples
  o.train.train_samples = 36;
  o.train.train_iters = 0;
  o.train.lr_warmup_iters = 0;
  o.train.lr_warmup_samples = 8;
  auto data = open_train_data(o);
  Recording rec(*data);
  const TrainConfig t = o.train.resolved(1);
  auto be = make_cpu_backend();
  Trainer trainer(o.model, o.train, *be, rec);
  trainer.train();
  const std::map<int64_t, std::vector<int32_t>> fed = rec.read();
  const int64_t run = t.samples_before_iteration(1, t.train_iters + 1);
  ASSERT_EQ(run, trainer.consumed_samples());
  const auto& blend = dynamic_cast<const BlendedDataset&>(*data);
  std::set<int> datasets;
  for (int64_t i = 0; i < run; ++i) {
    ASSERT_TRUE(fed.count(i)) << "the trainer never read sample " << i;
    const SampleRecord r = inspect_sample(blend, t, 1, i);
    EXPECT_EQ(r.tokens, fed.at(i)) << "sample " << i;
    datasets.insert(r.dataset);
    EXPECT_EQ(r.prefix, prefix(r.dataset));
    for (int32_t tok : r.tokens)
      if (tok != 0) ASSERT_EQ(tok / 1000, r.dataset);
  }
  EXPECT_EQ(datasets.size(), 3u);
  // Iterations under Megatron's ramp (4 + 2 x floor(consumed / 6) while consumed <= 12): 4, 4,
  // 6, then 8 samples.
  EXPECT_EQ(run, 30);
  const int64_t first_of[] = {0, 0, 4, 8, 14, 22, 30};
  for (int n = 1; n <= 6; ++n) EXPECT_EQ(t.samples_before_iteration(1, n), first_of[n]) << n;
  for (int64_t i = 0; i < run; ++i)
    EXPECT_EQ(inspect_sample(blend, t, 1, i).iteration,
              std::upper_bound(first_of + 1, first_of + 7, i) - (first_of + 1))
        << i;
  // The JSON line, exactly.
  const SampleRecord r = inspect_sample(blend, t, 1, 5);
  std::string tokens;
  for (size_t k = 0; k < r.tokens.size(); ++k)
    tokens += (k ? ", " : "") + std::to_string(r.tokens[k]);
  std::string docs, ones, positions;
  for (int64_t d = r.first_document; d <= r.last_document; ++d)
    docs += (d > r.first_document ? ", " : "") + std::to_string(d);
  for (size_t k = 0; k + 1 < r.tokens.size(); ++k) {  // no mask, no EOD inside: all count
    ones += k ? ", 1" : "1";
    positions += (k ? ", " : "") + std::to_string(k);
  }
  EXPECT_EQ(sample_json(r),
            "{\"sample\": 5, \"iteration\": 2, \"dataset\": " + std::to_string(r.dataset) +
                ", \"prefix\": \"" + r.prefix +
                "\", \"dataset_sample\": " + std::to_string(r.dataset_sample) +
                ", \"documents\": [" + docs + "], \"tokens\": [" + tokens + "], \"loss_mask\": [" +
                ones + "], \"position_ids\": [" + positions + "], \"document_starts\": [0]}");
}

TEST(BlendIndex, CacheFileIsReadBackAndNeverTrustedWhenDamaged) {
  char tmpl[] = "/tmp/tessera_blendcache_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::vector<double> w = normalized({0.5, 0.3, 0.2});
  const int64_t n = 10 * BlendIndex::kBlock + 17;
  const auto want = reference_order(w, n + 5000);
  BlendIndex first(w);
  const std::string made = first.use_cache(dir, n, true);
  EXPECT_NE(made.find("computed and cached in " + first.cache_file(dir)), std::string::npos)
      << made;
  // Other weights have another file.
  EXPECT_NE(BlendIndex(normalized({0.5, 0.3, 0.21})).cache_file(dir), first.cache_file(dir));
  BlendIndex second(w);
  EXPECT_NE(second.use_cache(dir, n, true).find("read from"), std::string::npos);
  for (int64_t i = n + 4999; i >= 0; i -= 7) ASSERT_EQ(second.at(i).sample, want[i].second) << i;
  // A longer run extends the file.
  BlendIndex third(w);
  EXPECT_NE(third.use_cache(dir, 2 * n, true).find("extended and cached"), std::string::npos);
  // One flipped bit: the file is not used (and is rewritten).
  {
    FILE* f = std::fopen(first.cache_file(dir).c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, 200, SEEK_SET);
    const int c = std::fgetc(f);
    std::fseek(f, 200, SEEK_SET);
    std::fputc(c ^ 4, f);
    std::fclose(f);
  }
  BlendIndex fourth(w);
  const std::string again = fourth.use_cache(dir, n, false);
  EXPECT_EQ(again.find("read from"), std::string::npos) << again;
  for (int64_t i = 0; i < n; i += 3) ASSERT_EQ(fourth.at(i).dataset, want[i].first) << i;
  std::remove(first.cache_file(dir).c_str());
  rmdir(dir.c_str());
}

// tessera-inspect's documents of a sample (issue 58): a range when they follow each other, else
// in their order (--sft's bins hold documents [43, 0], which is not "0-43").
TEST(InspectText, DocumentsAreARangeOnlyWhenTheyFollowEachOther) {
  SampleRecord r;
  r.documents = {43, 0};
  EXPECT_EQ(documents_text(r), "43, 0");
  r.documents = {3, 4, 5};
  EXPECT_EQ(documents_text(r), "3-5");
  r.documents = {7};
  EXPECT_EQ(documents_text(r), "7");
  r.documents = {5, 4};
  EXPECT_EQ(documents_text(r), "5, 4");
  r.documents.clear();  // none listed: the window's first and last
  r.first_document = 2;
  r.last_document = 6;
  EXPECT_EQ(documents_text(r), "2-6");
}
