// tessera-inspect: what a run trains on. Takes tessera-train's options (its --config, --data-path
// blend, --split, --seq-length, --seed, --global-batch-size, --train-iters, ...) and prints, for
// the samples of one iteration (--iteration N) or a range of global samples (--samples A:B), each
// sample's global index, iteration, dataset, index inside that dataset, documents and text; with
// --json one object per line with the sample's S+1 token ids. It reads the shards only, through
// the same dataset code the trainer reads them with.
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <iostream>
#include <limits>
#include <string>

#include "core/config.hpp"
#include "core/error.hpp"
#include "data/tokenizer.hpp"
#include "options/options.hpp"
#include "run/inspect.hpp"

using namespace tessera;

namespace {

bool is_file(const std::string& p) {
  return access(p.c_str(), R_OK) == 0;
}

// The text of tokens [begin, end): a packed sample's padding (--sft: id -1, no token) as
// "<pad xN>", the rest decoded.
std::string text_of(const Tokenizer& tok, const std::vector<int32_t>& t, size_t begin, size_t end) {
  std::string out;
  for (size_t p = begin; p < end;) {
    const bool pad = t[p] < 0;
    size_t q = p;
    while (q < end && (t[q] < 0) == pad) ++q;
    out += pad ? "<pad x" + std::to_string(q - p) + ">"
               : tok.decode(std::vector<int32_t>(t.begin() + p, t.begin() + q));
    p = q;
  }
  return out;
}

// The tokenizer that decodes the shards' text: the tokenizer options when given (checked against
// the shards already), else GPT-2's files shipped in data/gpt2 for shards made with GPT-2's BPE.
std::shared_ptr<const Tokenizer> text_tokenizer(const RunOptions& o) {
  if (o.tokenizer_given && (!o.tokenizer.vocab_file.empty() || !o.tokenizer.model.empty()))
    return load_tokenizer(o.tokenizer);
  if (o.data_meta.tokenizer == "gpt2-bpe") {
    std::string dir = "data/gpt2";
    char exe[4096] = {0};
    if (!is_file(dir + "/encoder.json") &&
        readlink("/proc/self/exe", exe, sizeof exe - 1) > 0) {  // build/bin/tessera-inspect
      std::string e = exe;
      dir = e.substr(0, e.rfind('/')) + "/../../data/gpt2";
    }
    if (is_file(dir + "/encoder.json") && is_file(dir + "/vocab.bpe"))
      return GPT2Tokenizer::load(dir + "/encoder.json", dir + "/vocab.bpe");
    throw ConfigError(
        "GPT-2's encoder.json and vocab.bpe are not in data/gpt2; give --vocab-file and "
        "--merge-file to print the text, or --json for the token ids");
  }
  throw ConfigError("the shards of '" + o.data_meta_prefix + "' were made with tokenizer '" +
                    o.data_meta.tokenizer +
                    "'; give --tokenizer-type HuggingFaceTokenizer --tokenizer-model (its "
                    "tokenizer.json) to print the text, or --json for the token ids");
}

// "A:B" -> [A, B).
std::pair<int64_t, int64_t> parse_range(const std::string& s) {
  const size_t colon = s.find(':');
  auto number = [&](const std::string& w, int64_t& out) {
    size_t used = 0;
    try {
      out = std::stoll(w, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    return used > 0 && used == w.size() && out >= 0;
  };
  int64_t a = 0, b = 0;
  if (colon == std::string::npos || !number(s.substr(0, colon), a) ||
      !number(s.substr(colon + 1), b) || b <= a)
    throw ConfigError("--samples '" + s +
                      "' is not a range of global samples A:B (0 <= A < B; B not included)");
  return {a, b};
}

}  // namespace

int main(int argc, char** argv) {
  RunOptions o;
  constexpr int64_t kNoIteration = std::numeric_limits<int64_t>::min();
  int64_t iteration = kNoIteration;
  std::string samples;
  bool json = false;
  try {
    RunOptionsProgram program;
    program.name = "tessera-inspect";
    program.data_only = true;
    program.usage =
        "[--config FILE] --data-path ... --global-batch-size G --train-iters N "
        "(--iteration N | --samples A:B) [--json]";
    program.add_options = [&](OptionParser& p) {
      p.group("Inspection")
          .add_options()(
              "iteration", po::value(&iteration),
              "print the samples of this iteration (1-based), in the order of its global batch")(
              "samples", po::value(&samples),
              "print global samples A to B-1 (A:B), each with the iteration that reads it")(
              "json", po::bool_switch(&json),
              "one JSON object per line: sample, iteration, dataset, prefix, dataset_sample, "
              "documents, tokens (the S+1 ids), loss_mask and position_ids (S each: whether "
              "position t's target, token t+1, counts; its position id), document_starts");
    };
    if (!parse_run_options(argc, argv, o, program)) return 0;
    if (!o.has_data())
      throw ConfigError(
          "tessera-inspect reads a run's shards: give --data-path (or --train-data-path)");
    if (iteration != kNoIteration && iteration < 1)
      throw ConfigError("--iteration " + std::to_string(iteration) +
                        " is not an iteration (iterations count from 1)");
    if ((iteration > 0) == !samples.empty())
      throw ConfigError("give one of --iteration N and --samples A:B");
    if (o.train.global_batch_size <= 0)
      throw ConfigError(
          "give --global-batch-size (the samples of one iteration; tessera-inspect has no "
          "data-parallel size to multiply --micro-batch-size by)");
    o.train.micro_batch_size = 1;  // the order of a global batch's samples does not depend on it
    o.train.drop_lr_schedule();    // nor on the learning rate's schedule
    TrainConfig t = o.train.resolved(1);
    if (t.train_iters <= 0)
      throw ConfigError("give the length of the run: --train-iters N (or --train-samples N)");
    const int64_t run_samples = t.samples_before_iteration(1, t.train_iters + 1);
    int64_t first = 0, last = 0;
    if (iteration > 0) {
      if (iteration > t.train_iters)
        throw ConfigError(detail::concat("--iteration ", iteration,
                                         " is beyond the run: --train-iters ", t.train_iters));
      first = t.samples_before_iteration(1, iteration);
      last = t.samples_before_iteration(1, iteration + 1);
    } else {
      std::tie(first, last) = parse_range(samples);
      if (last > run_samples)
        throw ConfigError(detail::concat("--samples ", samples, " goes beyond the run's ",
                                         run_samples, " samples (--train-iters ", t.train_iters,
                                         ")"));
    }
    std::unique_ptr<TokenDataset> data = open_train_data(o);
    t.documents.eod = o.train.documents.eod;  // the data's
    const auto* blend = dynamic_cast<const BlendedDataset*>(data.get());
    TESSERA_CHECK(blend, "shard data is a blend");
    const std::shared_ptr<const Tokenizer> tok = json ? nullptr : text_tokenizer(o);
    if (tok && tok->vocab_size() != o.data_meta.vocab_size)
      throw ConfigError(detail::concat("the tokenizer has ", tok->vocab_size(),
                                       " tokens, the shards of '", o.data_meta_prefix, "' ",
                                       o.data_meta.vocab_size));
    for (int64_t i = first; i < last; ++i) {
      const SampleRecord r = inspect_sample(*blend, t, 1, i);
      if (json) {
        std::cout << sample_json(r) << "\n";
        continue;
      }
      std::cout << "=== sample " << r.sample << " | iteration " << r.iteration << " | dataset "
                << r.dataset << " '" << r.prefix << "' | dataset sample " << r.dataset_sample
                << " | documents " << documents_text(r);
      std::cout << " | " << r.tokens.size() << " tokens";
      if (!r.masked) {
        std::cout << "\n" << text_of(*tok, r.tokens, 0, r.tokens.size()) << "\n";
        continue;
      }
      // [brackets] around the runs of tokens that are targets whose loss counts.
      int64_t counted = 0;
      for (uint8_t c : r.loss_mask) counted += c;
      std::cout << " | " << counted << " targets count, in [brackets]\n";
      for (size_t p = 0; p < r.tokens.size();) {
        const bool in = p > 0 && r.loss_mask[p - 1];
        size_t q = p + 1;
        while (q < r.tokens.size() && (r.loss_mask[q - 1] != 0) == in) ++q;
        const std::string text = text_of(*tok, r.tokens, p, q);
        std::cout << (in ? "[" + text + "]" : text);
        p = q;
      }
      std::cout << "\n";
    }
    std::cout.flush();
    if (!std::cout) throw Error("cannot write to standard output");
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "tessera-inspect: error: %s\n",
                 o.with_origins ? o.with_origins(e.what()).c_str() : e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-inspect: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
