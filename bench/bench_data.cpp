// bench_data: tokenizer throughput (tokens/s per core, English text), tessera-preprocess pipeline
// throughput per worker, loader throughput (samples/s), and how long a training step waits for
// data. Targets: tokenizer >= 2 M tokens/s per core; data wait < 1 % of step time.
// Usage: bench_data CORPUS.jsonl VOCAB_DIR [workers=2]   (scripts/prepare-corpus.sh makes the
// corpus)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "backend/backend.hpp"
#include "core/hdf5_handle.hpp"
#include "core/json.hpp"
#include "core/timer.hpp"
#include "data/gpt_dataset.hpp"
#include "data/preprocess.hpp"
#include "options/options.hpp"
#include "train/rank_setup.hpp"
#include "train/trainer.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: bench_data CORPUS.jsonl VOCAB_DIR [workers]\n");
    return 2;
  }
  const std::string corpus = argv[1], vocab = argv[2];
  const int workers = argc > 3 ? std::atoi(argv[3]) : 2;
  try {
    auto tok = GPT2Tokenizer::load(vocab + "/encoder.json", vocab + "/vocab.bpe");
    std::vector<std::string> docs;
    {
      std::ifstream in(corpus);
      if (!in) throw Error("cannot read " + corpus + " (run scripts/prepare-corpus.sh)");
      for (std::string line; std::getline(in, line);)
        docs.push_back(json_string_member(line, "text"));
    }
    int64_t bytes = 0;
    for (auto& d : docs) bytes += static_cast<int64_t>(d.size());
    // Tokenizer on one core: cold cache (first pass) and warm (second pass).
    GPT2Tokenizer::Cache cache;
    std::vector<int32_t> ids;
    double rate[2];
    int64_t tokens = 0;
    for (int pass = 0; pass < 2; ++pass) {
      ids.clear();
      Timer t;
      for (auto& d : docs) tok->encode(d, ids, cache);
      rate[pass] = ids.size() / t.seconds();
      tokens = static_cast<int64_t>(ids.size());
    }
    // The whole pipeline with N workers.
    char dir[] = "/tmp/tessera_bench_XXXXXX";
    const std::string tmp = mkdtemp(dir);
    PreprocessOptions o;
    o.inputs = {corpus};
    o.output_prefix = tmp + "/c";
    o.workers = workers;
    o.shard_tokens = 1 << 20;
    const PreprocessResult r = preprocess(o, *tok, nullptr, false);
    // Loader: samples of 1024+1 tokens per second through GPTDataset (HDF5 hyperslab reads).
    auto sc = std::make_shared<const ShardedCorpus>(tmp + "/c");
    GPTDataset ds(sc, Split::Train, parse_split("1,0,0"), 1024, 1);
    std::vector<int32_t> sample(1025);
    const int64_t n = std::min<int64_t>(2000, 4 * ds.num_samples());
    Timer lt;
    for (int64_t i = 0; i < n; ++i) ds.get(i, sample.data());
    const double samples_s = n / lt.seconds();
    // A training step's wait for data: a small model on this corpus, 8 steps after a warm-up.
    GPTConfig m;
    m.num_layers = 2;
    m.hidden_size = 128;
    m.num_attention_heads = 4;
    m.seq_length = 256;
    m.vocab_size = tok->vocab_size();
    TrainConfig t;
    t.micro_batch_size = 4;
    t.global_batch_size = 8;
    t.train_iters = 9;
    t.log_interval = 1 << 30;
    set_num_threads(affinity_cores());
    GPTDataset train(sc, Split::Train, parse_split("1,0,0"), m.seq_length, 1);
    auto be = make_cpu_backend();
    Trainer tr(m, t, *be, train);
    tr.train_step();
    double step = 0, wait = 0;
    for (int i = 0; i < 8; ++i) {
      const StepStats s = tr.train_step();
      step += s.seconds;
      wait += s.data_wait_seconds;
    }
    // Start-up on 10^9 tokens: a shard whose /tokens (10^9, chunked) holds no written chunks (reads
    // give the fill value), with 2M documents of 500 tokens: the loader reads doc_offsets and
    // builds the first epoch's permutation, which is all the start-up work there is.
    const int64_t big_tokens = 1000000000, big_docs = 2000000;
    {
      const std::string path = tmp + "/big_00000.h5";
      hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
      hsize_t n = big_tokens, chunk = 1 << 20;
      hid_t sp = H5Screate_simple(1, &n, nullptr), pl = H5Pcreate(H5P_DATASET_CREATE);
      H5Pset_chunk(pl, 1, &chunk);
      H5Dclose(H5Dcreate2(f, "tokens", H5T_STD_U16LE, sp, H5P_DEFAULT, pl, H5P_DEFAULT));
      std::vector<uint64_t> offs(big_docs + 1);
      for (int64_t i = 0; i <= big_docs; ++i)
        offs[i] = static_cast<uint64_t>(i) * (big_tokens / big_docs);
      hsize_t nd = offs.size();
      hid_t sp2 = H5Screate_simple(1, &nd, nullptr);
      hid_t ds =
          H5Dcreate2(f, "doc_offsets", H5T_STD_U64LE, sp2, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      H5Dwrite(ds, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offs.data());
      H5Dclose(ds);
      h5_write_attr(f, "vocab_size", int64_t(50257));
      h5_write_attr(f, "eod_id", int64_t(50256));
      h5_write_attr(f, "tokenizer", std::string("gpt2-bpe"));
      h5_write_attr(f, "format_version", kShardFormatVersion);
      H5Sclose(sp);
      H5Sclose(sp2);
      H5Pclose(pl);
      H5Fclose(f);
    }
    Timer ti;
    auto big = std::make_shared<const ShardedCorpus>(tmp + "/big");
    GPTDataset big_train(big, Split::Train, parse_split("969,30,1"), 1024, 1);
    big_train.get(0, sample.data());  // builds epoch 0's permutation
    const double startup = ti.seconds();
    std::system(("rm -rf " + tmp).c_str());
    std::printf("bench_data: %zu documents, %lld bytes, %lld tokens of English text (%s)\n",
                docs.size(), (long long)bytes, (long long)tokens, corpus.c_str());
    std::printf("%-52s %14s\n", "figure", "value");
    std::printf("%-52s %14.2f\n", "tokenizer, 1 core, cold cache (M tokens/s)", rate[0] / 1e6);
    std::printf("%-52s %14.2f\n", "tokenizer, 1 core, warm cache (M tokens/s)", rate[1] / 1e6);
    std::printf("%-52s %14.2f\n", "  target (M tokens/s per core)", 2.0);
    std::printf("%-52s %14.2f\n", "preprocess pipeline total (M tokens/s)",
                r.tokens / r.seconds / 1e6);
    std::printf(
        "%-52s %14.2f\n",
        ("preprocess per worker, " + std::to_string(workers) + " workers (M tokens/s)").c_str(),
        r.tokens / r.seconds / workers / 1e6);
    std::printf("%-52s %14.0f\n", "loader samples/s (seq 1024, shuffled, HDF5)", samples_s);
    std::printf("%-52s %14.3f\n", "loader start-up on 1e9 tokens, 2M documents (s)", startup);
    std::printf("%-52s %14.2f\n", "training step (ms, 2x128 model, 8 x 256 tokens)",
                step / 8 * 1e3);
    std::printf("%-52s %13.3f%%\n", "data wait / step time (target < 1%)", 100.0 * wait / step);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_data: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
