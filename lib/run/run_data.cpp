// run_data.cpp: opening the datasets a run's options name (run/run_data.hpp).
#include "run/run_data.hpp"

#include <algorithm>
#include <array>
#include <filesystem>
#include <sstream>

#include "core/error.hpp"
#include "core/logging.hpp"
#include "data/blended_dataset.hpp"
#include "data/gpt_dataset.hpp"
#include "data/tokenizer.hpp"

namespace tessera {

namespace {

// Where split `s` comes from: --data-path cut by --split, or the split's own path.
struct SplitSource {
  const DataBlend* blend = nullptr;
  std::string option;  // "--data-path", "--valid-data-path", ...
  std::array<double, 3> weights{0, 0, 0};
};

SplitSource source_of(const RunOptions& o, Split s) {
  SplitSource src;
  if (!o.data_path.empty()) {
    src.blend = &o.data_path;
    src.option = "--data-path";
    src.weights = parse_split(o.split);
    return src;
  }
  src.blend = s == Split::Train   ? &o.train_data_path
              : s == Split::Valid ? &o.valid_data_path
                                  : &o.test_data_path;
  src.option = std::string("--") + split_name(s) + "-data-path";
  src.weights[static_cast<int>(s)] = 1;
  return src;
}

// Megatron's tokenizer options name the tokenizer the data was made with; the shards name it too
// (attribute `tokenizer`). A mismatch is an error naming both.
void check_data_tokenizer(const RunOptions& o, const ShardMeta& meta, const std::string& option,
                          const std::string& prefix) {
  const std::string shards = "the shards of " + option + " '" + prefix + "'";
  const std::string kind = meta.tokenizer == "gpt2-bpe"          ? "GPT2BPETokenizer"
                           : meta.tokenizer.rfind("hf:", 0) == 0 ? "HuggingFaceTokenizer"
                                                                 : meta.tokenizer;
  if (o.tokenizer.type != kind)
    throw ConfigError("--tokenizer-type " + o.tokenizer.type + " is not the tokenizer " + shards +
                      " were made with (" + kind + ", '" + meta.tokenizer +
                      "'); give that one, or leave the tokenizer options out (the shards name "
                      "their tokenizer)");
  const TokenizerOptions& t = o.tokenizer;
  if (t.vocab_file.empty() && t.merge_file.empty() && t.model.empty()) return;  // the type alone
  const std::shared_ptr<const Tokenizer> tok = load_tokenizer(t);
  const std::string given =
      t.model.empty() ? "--vocab-file '" + t.vocab_file + "' / --merge-file '" + t.merge_file + "'"
                      : "--tokenizer-model '" + t.model + "'";
  if (tok->name() != meta.tokenizer || tok->vocab_size() != meta.vocab_size)
    throw ConfigError(detail::concat("the tokenizer of ", given, " ('", tok->name(), "', ",
                                     tok->vocab_size(), " tokens) is not the one ", shards,
                                     " were made with ('", meta.tokenizer, "', ", meta.vocab_size,
                                     " tokens); give the files the data was preprocessed with, "
                                     "or leave the tokenizer options out"));
}

// The datasets of split `s`, every corpus checked against `ref` (the tokenizer of the first
// corpus opened; set here when empty). Null when the source gives the split no data.
std::unique_ptr<BlendedDataset> open_blend(const RunOptions& o, Split s, ShardMeta& ref,
                                           std::string& ref_prefix) {
  const SplitSource src = source_of(o, s);
  if (src.blend->empty()) return nullptr;
  std::vector<std::unique_ptr<GPTDataset>> parts;
  for (const std::string& prefix : src.blend->prefixes) {
    auto corpus = std::make_shared<const ShardedCorpus>(prefix);
    const ShardMeta& m = corpus->meta();
    if (o.train.documents.packed && corpus->num_docs() < 2)
      throw ConfigError("--sft packs whole documents, but the shards of '" + prefix +
                        "' hold one document (no boundaries): preprocess the data with one "
                        "document per JSON line (or --split-lines)");
    if (ref_prefix.empty()) {
      ref = m;
      ref_prefix = prefix;
      if (o.tokenizer_given) check_data_tokenizer(o, m, src.option, prefix);
    } else if (m.vocab_size != ref.vocab_size || m.eod_id != ref.eod_id ||
               m.tokenizer != ref.tokenizer) {
      throw ConfigError(
          detail::concat(src.option, ": the shards of '", prefix,
                         "' were made with another tokenizer than those of '", ref_prefix, "' ('",
                         m.tokenizer, "', ", m.vocab_size, " tokens, end of document ", m.eod_id,
                         " vs '", ref.tokenizer, "', ", ref.vocab_size, " tokens, ", ref.eod_id,
                         "); every dataset of a run must share one vocabulary"));
    }
    parts.push_back(std::make_unique<GPTDataset>(
        corpus, s, src.weights, o.model.seq_length, o.train.seed,
        PackOptions{o.train.documents.packed, o.train.documents.no_truncate}));
  }
  return std::make_unique<BlendedDataset>(std::move(parts), *src.blend);
}

// The first dataset of `ds` without a sample for split `s`, or -1.
int first_empty(const BlendedDataset& ds) {
  for (int d = 0; d < ds.num_datasets(); ++d)
    if (ds.dataset(d).num_samples() == 0) return d;
  return -1;
}

std::string empty_split_message(const RunOptions& o, const BlendedDataset& ds, int d, Split s) {
  const SplitSource src = source_of(o, s);
  return detail::concat("the ", split_name(s), " split of '", ds.blend().prefixes[d], "' (",
                        src.option,
                        src.option == "--data-path" ? " with --split " + o.split : std::string(),
                        ") has no sample of --seq-length+1 = ", o.model.seq_length + 1,
                        " tokens: ", ds.dataset(d).describe());
}

}  // namespace

std::unique_ptr<TokenDataset> open_valid_data(const RunOptions& o) {
  if (o.mock_data)  // another stream of the same chain: unseen samples
    return make_mock_dataset(o.model.vocab_size, o.model.seq_length, o.train.seed + 1000003);
  ShardMeta ref = o.data_meta;
  std::string ref_prefix = o.data_meta_prefix;
  auto ds = open_blend(o, Split::Valid, ref, ref_prefix);
  if (!ds)
    throw ConfigError(
        "evaluation needs validation data: give --valid-data-path (with --train-data-path), or "
        "turn evaluation off (--eval-interval 0)");
  const int d = first_empty(*ds);
  if (d >= 0)
    throw ConfigError("evaluation needs validation data, but " +
                      empty_split_message(o, *ds, d, Split::Valid) +
                      "; give valid a share or turn evaluation off (--eval-interval 0)");
  return ds;
}

std::unique_ptr<TokenDataset> open_test_data(const RunOptions& o) {
  if (o.mock_data)  // a third stream of the chain
    return make_mock_dataset(o.model.vocab_size, o.model.seq_length, o.train.seed + 2000003);
  ShardMeta ref = o.data_meta;
  std::string ref_prefix = o.data_meta_prefix;
  auto ds = open_blend(o, Split::Test, ref, ref_prefix);
  if (!ds) return nullptr;
  const int d = first_empty(*ds);
  if (d >= 0) {
    TLOG(info) << "no evaluation on the test split: "
               << empty_split_message(o, *ds, d, Split::Test);
    return nullptr;
  }
  return ds;
}

std::unique_ptr<BlendedDataset> open_split_data(const RunOptions& o, Split s) {
  ShardMeta ref = o.data_meta;
  std::string ref_prefix = o.data_meta_prefix;
  auto ds = open_blend(o, s, ref, ref_prefix);
  if (!ds)
    throw ConfigError(std::string("no data for the ") + split_name(s) + " split: give --" +
                      split_name(s) + "-data-path, or --data-path");
  const int d = first_empty(*ds);
  if (d >= 0)
    throw ConfigError(empty_split_message(o, *ds, d, s) + "; give " + split_name(s) +
                      " a share (--split) or lower --seq-length");
  return ds;
}

std::unique_ptr<TokenDataset> open_train_data(RunOptions& o) {
  if (o.mock_data) return make_mock_dataset(o.model.vocab_size, o.model.seq_length, o.train.seed);
  // The vocabulary is known once the first corpus is open; the datasets need only the length.
  auto ds = open_blend(o, Split::Train, o.data_meta, o.data_meta_prefix);
  TESSERA_CHECK(ds, "no training data");
  o.train.documents.eod = o.data_meta.eod_id;      // every corpus of the blend has the same
  o.train.data_tokenizer = o.data_meta.tokenizer;  // checkpoints record it for generation
  const int64_t vocab = o.data_meta.vocab_size;
  if (o.model.vocab_size == 0) {
    o.model.vocab_size = vocab;
  } else if (o.model.vocab_size != vocab) {
    throw ConfigError(detail::concat("--vocab-size=", o.model.vocab_size, " differs from the ",
                                     vocab, " tokens of the tokenizer of '", o.data_meta_prefix,
                                     "' (leave --vocab-size out to take it from the data)"));
  }
  o.model.validate();
  const int d = first_empty(*ds);
  if (d < 0 && ds->num_datasets() > 1) {
    // The blend's order over the whole run: from the cache file of an earlier start when there
    // is one (world rank 0 writes it), else computed here.
    const int rank = o.launch_rank, world = std::max(1, o.launch_world);
    const int dp = std::max(1, world / std::max(1, o.tp * o.pp * o.cp));
    const TrainConfig t = o.train.resolved(dp);
    const int64_t run = t.samples_before_iteration(dp, t.train_iters + 1);
    std::string dir = o.data_cache_path;
    if (!dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec)
        throw ConfigError("--data-cache-path '" + dir +
                          "': cannot create the directory: " + ec.message());
    } else {
      const std::string& first = ds->blend().prefixes[0];
      const size_t slash = first.rfind('/');
      dir = slash == std::string::npos ? "." : slash == 0 ? "/" : first.substr(0, slash);
    }
    o.notes.push_back(ds->index().use_cache(dir, run, rank == 0));
  }
  if (d >= 0)
    throw ConfigError(empty_split_message(o, *ds, d, Split::Train) +
                      (o.data_path.empty() ? "; lower --seq-length or give more documents"
                                           : "; give train a larger share or lower --seq-length"));
  return ds;
}

std::vector<std::string> data_report(const TokenDataset& data, const TrainConfig& t, int dp_size) {
  const auto* ds = dynamic_cast<const BlendedDataset*>(&data);
  if (!ds) return {"data: " + data.describe()};
  std::vector<std::string> lines;
  const int64_t run = t.samples_before_iteration(dp_size, t.resolved(dp_size).train_iters + 1);
  const std::vector<int64_t> drawn = ds->index().counts_before(run);
  if (ds->num_datasets() > 1)
    lines.push_back(detail::concat("data: ", ds->describe(), "; ", run,
                                   " samples over the run in Megatron's blending order"));
  for (int d = 0; d < ds->num_datasets(); ++d) {
    const GPTDataset& g = ds->dataset(d);
    std::ostringstream os;
    os << "data: dataset " << d << " '" << ds->blend().prefixes[d] << "'";
    if (ds->num_datasets() > 1) os << ", weight " << ds->blend().weights[d];
    os << ": " << split_name(g.split()) << " split, documents " << g.doc_begin() << "-"
       << g.doc_end() << " of " << g.corpus().num_docs() << ", " << g.num_tokens() << " tokens, "
       << g.num_samples() << " samples of " << g.seq_length() + 1 << " tokens per epoch; "
       << drawn[d] << " drawn over the run (";
    os.setf(std::ios::fixed);
    os.precision(2);
    os << double(drawn[d]) / double(std::max<int64_t>(1, g.num_samples())) << " epochs";
    if (ds->num_datasets() > 1)
      os << "; Megatron would size it " << megatron_dataset_size(ds->blend().weights[d], run);
    os << ")" << g.packing_summary();
    lines.push_back(os.str());
  }
  return lines;
}

}  // namespace tessera
