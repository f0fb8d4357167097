// data.cpp: the data options (--data-path and its blends, the per-split paths, --split, mock data,
// Megatron's tokenizer options) and their checks. Opening the data is run/run_data.*.
#include <cctype>

#include "core/config.hpp"
#include "core/error.hpp"
#include "data/blended_dataset.hpp"
#include "data/gpt_dataset.hpp"
#include "data/tokenizer.hpp"
#include "options/option_group.hpp"

namespace tessera {
namespace {

class DataOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    p.group("Data").add_options()(
        "data-path", po::value(&data_path_words_)->multitoken(),
        "prefix of the HDF5 token shards made by tessera-preprocess (PREFIX_00000.h5, ...); "
        "or Megatron's blend `W1 PREFIX1 W2 PREFIX2 ...` (weights normalized); --split cuts each "
        "dataset into train, valid and test")(
        "train-data-path", po::value(&train_path_words_)->multitoken(),
        "the training data alone: a prefix or a blend, all of each dataset (instead of "
        "--data-path and --split)")(
        "valid-data-path", po::value(&valid_path_words_)->multitoken(),
        "the validation data: a prefix or a blend (with --train-data-path)")(
        "test-data-path", po::value(&test_path_words_)->multitoken(),
        "the test data: a prefix or a blend (with --train-data-path)")(
        "data-cache-path", po::value(&o.data_cache_path),
        "directory for the blend's index file (default: the directory of the first prefix's "
        "shards); a start finds it there instead of computing the order again")(
        "tokenizer-type", po::value(&o.tokenizer.type),
        "GPT2BPETokenizer | HuggingFaceTokenizer: checked against the tokenizer the shards were "
        "made with (not needed: the shards name it)")(
        "vocab-file", po::value(&o.tokenizer.vocab_file),
        "GPT2BPETokenizer's encoder.json, checked against the shards' tokenizer")(
        "merge-file", po::value(&o.tokenizer.merge_file),
        "GPT2BPETokenizer's vocab.bpe, checked against the shards' tokenizer")(
        "tokenizer-model", po::value(&o.tokenizer.model),
        "HuggingFaceTokenizer's tokenizer.json (or its directory), checked against the shards' "
        "tokenizer")("split", po::value(&o.split)->default_value(o.split),
                     "train,valid,test weights over the documents, in order (e.g. 949,50,1)")(
        "mock-data", po::bool_switch(&o.mock_data),
        "train on synthetic Markov-chain data (the default when no --data-path is given)");
    p.alternatives({"mock-data", "data-path"});
    p.alternatives({"mock-data", "train-data-path"});
  }

  // A negative blend weight would reach the parser as an unknown option ("-1"): name it here.
  void check_argv(int argc, const char* const* argv) const override {
    for (int i = 1, in_blend = 0; i < argc; ++i) {
      const std::string a = argv[i];
      if (a.rfind("--", 0) == 0) {
        in_blend = a == "--data-path" || a == "--train-data-path" || a == "--valid-data-path" ||
                   a == "--test-data-path";
        if (in_blend) in_blend = i;
      } else if (in_blend && a.size() > 1 && a[0] == '-' && (std::isdigit(a[1]) || a[1] == '.')) {
        throw ConfigError(
            std::string(argv[in_blend]) + ": the weight " + a +
            (i + 1 < argc ? std::string(" of '") + argv[i + 1] + "'" : std::string()) +
            " must be positive (leave a dataset out to give it no samples)");
      }
    }
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes& notes) override {
    o.data_path = parse_data_blend(data_path_words_, "data-path");
    o.train_data_path = parse_data_blend(train_path_words_, "train-data-path");
    o.valid_data_path = parse_data_blend(valid_path_words_, "valid-data-path");
    o.test_data_path = parse_data_blend(test_path_words_, "test-data-path");
    if (o.data_path.size() == 1 && o.data_path.text != o.data_path.prefixes[0])
      notes.run.push_back("--data-path " + o.data_path.text +
                          ": a blend of one dataset, which is all of '" + o.data_path.prefixes[0] +
                          "'");
    check_split_sources(p, o);
    o.tokenizer_given = p.given("tokenizer-type") || p.given("vocab-file") ||
                        p.given("merge-file") || p.given("tokenizer-model");
    if (o.tokenizer_given && !p.given("tokenizer-type"))
      o.tokenizer.type = p.given("tokenizer-model") ? "HuggingFaceTokenizer" : "GPT2BPETokenizer";
    if (o.mock_data && o.has_data())
      throw ConfigError(std::string("--mock-data and --") +
                        (o.data_path.empty() ? "train-data-path" : "data-path") +
                        " both given; choose one");
    if (!o.has_data()) {
      GPTConfig& m = o.model;
      o.mock_data = true;
      if (m.vocab_size == 0 && o.tokenizer_given) {  // Megatron's mock data: the tokenizer's size
        m.vocab_size = load_tokenizer(o.tokenizer)->vocab_size();
        notes.run.push_back(detail::concat("mock data over the ", m.vocab_size,
                                           " tokens of the tokenizer options"));
      }
      if (m.vocab_size == 0) m.vocab_size = 512;
    }
    parse_split(o.split);
  }

 private:
  // --data-path cut by --split, or each split's own path: not both.
  static void check_split_sources(const OptionParser& p, const RunOptions& o) {
    const bool per_split =
        !o.train_data_path.empty() || !o.valid_data_path.empty() || !o.test_data_path.empty();
    if (per_split && !o.data_path.empty())
      throw ConfigError("--data-path and --" +
                        std::string(!o.train_data_path.empty()   ? "train"
                                    : !o.valid_data_path.empty() ? "valid"
                                                                 : "test") +
                        "-data-path both given; give --data-path (cut by --split) or the paths of "
                        "each split, as in Megatron-LM");
    if (per_split && o.train_data_path.empty())
      throw ConfigError(
          "--valid-data-path / --test-data-path need --train-data-path (the training data)");
    if (per_split && p.given("split"))
      throw ConfigError("--split " + o.split +
                        " cuts --data-path into train, valid and test; with --train-data-path "
                        "each path is a whole split (leave --split out)");
  }

  std::vector<std::string> data_path_words_, train_path_words_, valid_path_words_, test_path_words_;
};

}  // namespace

std::unique_ptr<OptionGroup> make_data_options() {
  return std::make_unique<DataOptions>();
}

}  // namespace tessera
