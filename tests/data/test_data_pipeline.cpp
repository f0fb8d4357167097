// test_data_pipeline.cpp: text -> tessera-preprocess pipeline -> HDF5 shards -> GPTDataset ->
// prefetcher, on a small corpus: the schema, exact token contents, epochs, DP slices, resume, and
// every bad input of the issue.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>

#include "core/error.hpp"
#include "core/hdf5_handle.hpp"
#include "data/gpt_dataset.hpp"
#include "data/packing.hpp"
#include "data/prefetcher.hpp"
#include "data/preprocess.hpp"
#include "options/options.hpp"
#include "train/trainer.hpp"

#include "data/gpt2_vocab.hpp"

using namespace tessera;

using tessera::testing::gpt2;
using tessera::testing::kVocabDir;

namespace {
bool exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

class DataPipeline : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera_data_XXXXXX";
    dir_ = mkdtemp(tmpl);
    // 60 documents of varying length, with quotes, escapes and non-ASCII.
    std::ofstream out(dir_ + "/corpus.jsonl");
    for (int i = 0; i < 60; ++i) {
      std::string text = "Document " + std::to_string(i) + ": \\\"quoted\\\" caf\\u00e9 ";
      for (int k = 0; k <= i % 7; ++k)
        text += "the quick brown fox " + std::to_string(i * k) + ". ";
      out << "{\"id\": " << i << ", \"text\": \"" << text << "\", \"meta\": {\"a\": [1, 2]}}\n";
      docs_.push_back(text);
    }
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  PreprocessResult run(const std::string& prefix, int workers, int64_t shard_tokens = 300) {
    PreprocessOptions o;
    o.inputs = {dir_ + "/*.jsonl"};
    o.output_prefix = dir_ + "/" + prefix;
    o.workers = workers;
    o.shard_tokens = shard_tokens;
    return preprocess(o, *gpt2(), nullptr, false);
  }

  std::string dir_;
  std::vector<std::string> docs_;
};
}  // namespace

TEST_F(DataPipeline, ShardsHoldExactlyTheTokenizedDocuments) {
  const PreprocessResult r = run("c", 3);
  EXPECT_EQ(r.documents, 60);
  ASSERT_GE(r.shards.size(), 3u) << "shard size 300 should cut several shards";
  EXPECT_FALSE(exists(dir_ + "/c_00000.h5.part"));
  // Expected: each document's ids (JSON escapes decoded), then <|endoftext|>, in input order.
  std::vector<int32_t> want;
  for (std::string d : docs_) {
    size_t p;
    while ((p = d.find("\\\"")) != std::string::npos) d.replace(p, 2, "\"");
    while ((p = d.find("\\u00e9")) != std::string::npos) d.replace(p, 6, "\xc3\xa9");
    for (int32_t id : gpt2()->encode(d)) want.push_back(id);
    want.push_back(50256);
  }
  ShardedCorpus corpus(dir_ + "/c");
  EXPECT_EQ(corpus.num_docs(), 60);
  ASSERT_EQ(corpus.num_tokens(), static_cast<int64_t>(want.size()));
  std::vector<int32_t> got(want.size());
  corpus.read(0, static_cast<int64_t>(got.size()), got.data());
  EXPECT_EQ(got, want);
  // Schema of every shard.
  for (const std::string& s : r.shards) {
    ShardReader sr(s);
    EXPECT_EQ(sr.meta().vocab_size, 50257);
    EXPECT_EQ(sr.meta().eod_id, 50256);
    EXPECT_EQ(sr.meta().tokenizer, "gpt2-bpe");
    EXPECT_EQ(sr.meta().format_version, kShardFormatVersion);
    EXPECT_EQ(sr.doc_offsets().front(), 0u);
    EXPECT_EQ(sr.doc_offsets().back(), static_cast<uint64_t>(sr.num_tokens()));
    std::vector<int32_t> last(1);
    sr.read(sr.num_tokens() - 1, 1, last.data());
    EXPECT_EQ(last[0], 50256) << "every document ends with <|endoftext|>";
    hid_t f = H5Fopen(s.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "tokens", H5P_DEFAULT);
    hid_t t = H5Dget_type(d);
    EXPECT_EQ(H5Tget_size(t), 2u) << "uint16 tokens for a 50257 vocabulary";
    hid_t pl = H5Dget_create_plist(d);
    EXPECT_EQ(H5Pget_layout(pl), H5D_CHUNKED);
    H5Pclose(pl);
    H5Tclose(t);
    H5Dclose(d);
    H5Fclose(f);
  }
  // The worker count does not change the output.
  run("one", 1);
  ShardedCorpus c1(dir_ + "/one");
  std::vector<int32_t> got1(want.size());
  c1.read(0, static_cast<int64_t>(got1.size()), got1.data());
  EXPECT_EQ(got1, want);
}

TEST_F(DataPipeline, EpochsVisitEveryWindowOnceAndTokensAsOftenAsExpected) {
  run("c", 2);
  auto corpus = std::make_shared<const ShardedCorpus>(dir_ + "/c");
  const int seq = 16;
  GPTDataset train(corpus, Split::Train, parse_split("80,10,10"), seq, 1234);
  const auto bounds = split_doc_bounds(parse_split("80,10,10"), 60);
  EXPECT_EQ(bounds[1], 48);
  EXPECT_EQ(bounds[2], 54);
  EXPECT_EQ(train.num_docs(), 48);
  const int64_t N = train.num_samples();
  ASSERT_GT(N, 10);
  // Expected per epoch: every token of the split's first N*seq tokens once as an input.
  std::vector<int32_t> split_tokens(N * seq);
  corpus->read(train.first_token(), N * seq, split_tokens.data());
  std::map<int32_t, int64_t> want;
  for (int32_t t : split_tokens) want[t]++;
  std::vector<int32_t> sample(seq + 1);
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::map<int32_t, int64_t> got;
    std::set<int64_t> windows;
    for (int64_t i = epoch * N; i < (epoch + 1) * N; ++i) {
      windows.insert(train.window_of(i));
      train.get(i, sample.data());
      for (int t = 0; t < seq; ++t) got[sample[t]]++;
      // Targets are the inputs shifted by one: window w's last token is window w+1's first.
      std::vector<int32_t> direct(seq + 1);
      corpus->read(train.first_token() + train.window_of(i) * seq, seq + 1, direct.data());
      ASSERT_EQ(sample, direct);
    }
    EXPECT_EQ(static_cast<int64_t>(windows.size()), N) << "epoch " << epoch << " is a permutation";
    EXPECT_EQ(got, want) << "epoch " << epoch;
  }
  EXPECT_NE(train.window_of(0), train.window_of(N)) << "each epoch has its own order";
  GPTDataset again(corpus, Split::Train, parse_split("80,10,10"), seq, 1234);
  for (int64_t i = 0; i < 2 * N; i += 7) EXPECT_EQ(again.window_of(i), train.window_of(i));
  GPTDataset valid(corpus, Split::Valid, parse_split("80,10,10"), seq, 1234);
  EXPECT_EQ(valid.num_docs(), 6);
  EXPECT_EQ(valid.first_token(), corpus->doc_start(48));
}

TEST_F(DataPipeline, DpSlicesPartitionTheGlobalBatchAndResumeIsExact) {
  run("c", 2);
  auto corpus = std::make_shared<const ShardedCorpus>(dir_ + "/c");
  GPTDataset train(corpus, Split::Train, parse_split("1,0,0"), 8, 5);
  const int64_t G = 12;
  for (int dp : {1, 2, 3, 4}) {
    std::set<int64_t> seen;
    for (int r = 0; r < dp; ++r)
      for (int64_t i = 0; i < G / dp; ++i) seen.insert(dp_slice_begin(36, G, dp, r) + i);
    EXPECT_EQ(seen.size(), size_t(G));
    EXPECT_EQ(*seen.begin(), 36);
    EXPECT_EQ(*seen.rbegin(), 36 + G - 1);
  }
  // An uninterrupted run of fetches vs a fresh prefetcher resumed at consumed = 3 batches.
  const int64_t S = 9;
  std::vector<int32_t> a(G * S), b(G * S);
  {
    Prefetcher p(train, G);
    for (int step = 0; step <= 3; ++step) p.fetch(step * G, a.data(), (step + 1) * G);
  }
  Prefetcher resumed(train, G);
  resumed.fetch(3 * G, b.data(), 4 * G);
  EXPECT_EQ(a, b);
  resumed.fetch(4 * G, b.data(), 5 * G);  // and the prefetched next batch is the right one
  std::vector<int32_t> direct(G * S);
  for (int64_t i = 0; i < G; ++i) train.get(4 * G + i, direct.data() + i * S);
  EXPECT_EQ(b, direct);
}

TEST_F(DataPipeline, BadInputsNameTheFileAndLeaveNoOutput) {
  // A line that is not JSON: file and line named, nothing under the final names.
  std::ofstream(dir_ + "/corpus.jsonl", std::ios::app) << "{\"text\": \"ok\"}\nnot json at all\n";
  try {
    run("bad", 2);
    FAIL() << "a bad jsonl line was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corpus.jsonl:62:"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(exists(dir_ + "/bad_00000.h5"));
  EXPECT_FALSE(exists(dir_ + "/bad_00000.h5.part"));
  // A line without the key.
  std::ofstream(dir_ + "/corpus.jsonl") << "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n";
  try {
    run("bad", 1);
    FAIL() << "a line without the key was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corpus.jsonl:2: no string member \"text\""),
              std::string::npos)
        << e.what();
  }
}

TEST_F(DataPipeline, DamagedShardsGiveClearErrors) {
  run("c", 2);
  auto error_of = [&](const std::string& prefix) -> std::string {
    try {
      ShardedCorpus c(prefix);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  ASSERT_EQ(error_of(dir_ + "/c"), "");
  // Missing shard in the middle.
  std::rename((dir_ + "/c_00001.h5").c_str(), (dir_ + "/c_00001.h5.bak").c_str());
  EXPECT_NE(error_of(dir_ + "/c").find("c_00001.h5 is missing"), std::string::npos)
      << error_of(dir_ + "/c");
  std::rename((dir_ + "/c_00001.h5.bak").c_str(), (dir_ + "/c_00001.h5").c_str());
  // Truncated shard.
  const std::string s0 = dir_ + "/c_00000.h5";
  std::system(("cp " + s0 + " " + s0 + ".orig && truncate -s 2000 " + s0).c_str());
  const std::string trunc = error_of(dir_ + "/c");
  EXPECT_NE(trunc.find(s0), std::string::npos) << trunc;
  // Wrong format version.
  std::system(("cp " + s0 + ".orig " + s0).c_str());
  {
    hid_t f = H5Fopen(s0.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
    const int64_t v = 99;
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    H5Fclose(f);
  }
  const std::string ver = error_of(dir_ + "/c");
  EXPECT_NE(ver.find("format_version 99"), std::string::npos) << ver;
  EXPECT_NE(ver.find(s0), std::string::npos) << ver;
  // No shards at all.
  EXPECT_NE(error_of(dir_ + "/nothing").find("names no shards"), std::string::npos);
}

// A shard's extents must fit its bytes in the file: a /tokens that declares 2^40 entries and stores
// none was accepted (fuzz_shard's finding of issue 27 had a /doc_offsets as long, allocated whole);
// a gzip-compressed /tokens that holds its entries still reads.
TEST_F(DataPipeline, ShardExtentsBeyondTheFileAreRefused) {
  auto write = [&](const std::string& path, uint64_t n_tokens, bool gzip) {
    hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    h5_write_attr(f, "format_version", int64_t{1});
    h5_write_attr(f, "vocab_size", int64_t{1000});
    h5_write_attr(f, "eod_id", int64_t{999});
    h5_write_attr(f, "tokenizer", std::string("test"));
    const hsize_t nt[1] = {n_tokens}, nd[1] = {2};
    hid_t pl = H5Pcreate(H5P_DATASET_CREATE);
    if (gzip) {
      const hsize_t chunk[1] = {64};
      H5Pset_chunk(pl, 1, chunk);
      H5Pset_deflate(pl, 4);
    }
    hid_t ts = H5Screate_simple(1, nt, nullptr), ds = H5Screate_simple(1, nd, nullptr);
    hid_t t = H5Dcreate2(f, "tokens", H5T_STD_U16LE, ts, H5P_DEFAULT, pl, H5P_DEFAULT);
    hid_t d =
        H5Dcreate2(f, "doc_offsets", H5T_STD_U64LE, ds, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    const uint64_t offsets[2] = {0, n_tokens};
    H5Dwrite(d, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offsets);
    if (gzip) {  // written: 999 (EOD) ends the one document
      std::vector<uint16_t> ids(n_tokens, 7);
      ids.back() = 999;
      H5Dwrite(t, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids.data());
    }
    H5Dclose(d);
    H5Dclose(t);
    H5Sclose(ds);
    H5Sclose(ts);
    H5Pclose(pl);
    H5Fclose(f);
  };
  const std::string big = dir_ + "/big.h5";
  write(big, uint64_t{1} << 40, false);
  try {
    ShardReader r(big);
    FAIL() << "a shard of 2^40 tokens in " << std::ifstream(big, std::ios::ate).tellg()
           << " bytes was accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    const std::string size = std::to_string(std::ifstream(big, std::ios::ate).tellg());
    EXPECT_EQ(m, "data shard '" + big + "': /tokens has 1099511627776 entries, more than the " +
                     size + "-byte file can hold; the shard is damaged, re-run tessera-preprocess");
  }
  const std::string small = dir_ + "/gzip.h5";
  write(small, 300, true);
  ShardReader r(small);
  EXPECT_EQ(r.num_tokens(), 300);
  EXPECT_EQ(r.doc_offsets(), (std::vector<uint64_t>{0, 300}));
  std::vector<int32_t> ids(300);
  r.read(0, 300, ids.data());
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[299], 999);
}

// What the tokenizer wrote must fit the vocabulary the shards declare; a document that does not is
// named, and no shard is left.
TEST_F(DataPipeline, ShardWriterRefusesIdsOutsideTheVocabulary) {
  ShardMeta meta;
  meta.vocab_size = 100;
  meta.eod_id = 99;
  meta.tokenizer = "test";
  const std::string prefix = dir_ + "/w";
  try {
    ShardWriter w(prefix, 1000, meta);
    const uint32_t good[3] = {1, 2, 99}, bad[3] = {5, 100, 99};
    w.add(good, 3);
    w.add(bad, 3);
    FAIL() << "id 100 of a 100-token vocabulary was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("document 1 (counting from 0 over the inputs) has token "
                                         "id 100 at position 1, outside the vocabulary of 100 "
                                         "tokens of tokenizer 'test'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(exists(shard_path(prefix, 0)));
  EXPECT_FALSE(exists(shard_path(prefix, 0) + ".part"));
}

TEST_F(DataPipeline, EmptyTrainSplitIsAStartupError) {
  run("c", 1);
  RunOptions o;
  o.data_path = parse_data_blend({dir_ + "/c"}, "data-path");
  o.model.seq_length = 16;
  o.split = "0,100,0";
  try {
    open_train_data(o);
    FAIL() << "an empty train split was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train split"), std::string::npos) << e.what();
  }
  o.split = "100,0,0";  // valid without evaluation
  auto ds = open_train_data(o);
  EXPECT_GT(ds->num_samples(), 0);
  EXPECT_EQ(o.model.vocab_size, 50257);
  o.model.vocab_size = 512;
  EXPECT_THROW(open_train_data(o), ConfigError);
}

// /loss_mask (data/shard.hpp): written beside the tokens, read back per token and per sample; a
// corpus whose shards have none counts every token; a mask of another length is refused.
TEST_F(DataPipeline, LossMasksRoundTripThroughShardsAndSamples) {
  ShardMeta meta;
  meta.vocab_size = 100;
  meta.eod_id = 99;
  meta.tokenizer = "test";
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<uint64_t> offsets = {0};
  for (int d = 0; d < 20; ++d) {
    for (int i = 0; i < 6 + d % 5; ++i) {
      tokens.push_back(static_cast<uint32_t>((d * 7 + i) % 99));
      mask.push_back(static_cast<uint8_t>(i >= 3));  // a 3-token prompt, then the answer
    }
    tokens.push_back(99);
    mask.push_back(1);
    offsets.push_back(tokens.size());
  }
  write_shard(dir_ + "/m_00000.h5", tokens, offsets, meta, mask);
  write_shard(dir_ + "/u_00000.h5", tokens, offsets, meta);
  ShardReader r(dir_ + "/m_00000.h5");
  ASSERT_TRUE(r.has_loss_mask());
  std::vector<uint8_t> got(mask.size());
  r.read_loss_mask(0, static_cast<int64_t>(got.size()), got.data());
  EXPECT_EQ(got, mask);
  EXPECT_FALSE(ShardReader(dir_ + "/u_00000.h5").has_loss_mask());
  auto corpus = std::make_shared<const ShardedCorpus>(dir_ + "/m");
  GPTDataset ds(corpus, Split::Train, {1, 0, 0}, 8, 1);
  ASSERT_TRUE(ds.has_loss_mask());
  std::vector<int32_t> sample(9);
  std::vector<uint8_t> smask(9);
  for (int64_t i = 0; i < ds.num_samples(); ++i) {
    ds.get(i, sample.data());
    ds.get_loss_mask(i, smask.data());
    const int64_t begin = ds.window_of(i) * 8;  // the window's first corpus token
    for (int p = 0; p <= 8; ++p) {
      ASSERT_EQ(sample[p], static_cast<int32_t>(tokens[begin + p]));
      ASSERT_EQ(smask[p], mask[begin + p]) << "sample " << i << " position " << p;
    }
  }
  GPTDataset plain(std::make_shared<const ShardedCorpus>(dir_ + "/u"), Split::Train, {1, 0, 0}, 8,
                   1);
  EXPECT_FALSE(plain.has_loss_mask());
  plain.get_loss_mask(0, smask.data());
  EXPECT_EQ(smask, std::vector<uint8_t>(9, 1));
  mask.pop_back();
  EXPECT_THROW(write_shard(dir_ + "/bad_00000.h5", tokens, offsets, meta, mask), Error);
}

// --sft's first-fit (data/packing.hpp) on a hand-worked case: each document into the first bin
// with room, in order; one too long for a bin is cut to it and counted.
TEST(Packing, FirstFitInOrderCutsWhatIsTooLong) {
  const Packing p = pack_first_fit({10, 11, 12, 13, 14, 15}, {6, 5, 4, 3, 12, 2}, 10);
  ASSERT_EQ(p.bins(), 3);
  EXPECT_EQ(p.bin_begin, (std::vector<int64_t>{0, 2, 5, 6}));
  EXPECT_EQ(p.piece_doc, (std::vector<int64_t>{10, 12, 11, 13, 15, 14}));
  EXPECT_EQ(p.piece_len, (std::vector<int64_t>{6, 4, 5, 3, 2, 10}));
  EXPECT_EQ(p.truncated, 1);
  EXPECT_EQ(p.tokens, 30);
  EXPECT_EQ(pack_first_fit({}, {}, 4).bins(), 0);
}
