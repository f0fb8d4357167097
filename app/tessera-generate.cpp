// tessera-generate: text generation from a checkpoint of any layout, at the TP x PP layout of this
// run (resharded on load), with a KV cache; one or many prompts, or an interactive prompt loop.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "backend/backend.hpp"
#include "backend/select.hpp"
#include "checkpoint/checkpoint.hpp"
#include "checkpoint/reshard.hpp"
#include "comm/mpi.hpp"
#include "comm/process_grid.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/logging.hpp"
#include "data/tokenizer.hpp"
#include "inference/generator.hpp"
#include "train/options.hpp"

using namespace tessera;

namespace {
std::vector<int32_t> parse_ids(const std::string& s) {
  std::istringstream in(s);
  std::vector<int32_t> ids;
  std::string w;
  while (in >> w) {
    try {
      size_t used = 0;
      const long v = std::stol(w, &used);
      if (used != w.size() || v < 0) throw std::invalid_argument(w);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      throw ConfigError("--prompt-ids '" + s + "': '" + w + "' is not a token id");
    }
  }
  return ids;
}
}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const bool root = mpi.world_rank() == 0;
  std::string load, prompt_file;
  TokenizerOptions to;
  to.vocab_file = "data/gpt2/encoder.json";
  to.merge_file = "data/gpt2/vocab.bpe";
  std::vector<std::string> prompts_text, prompt_ids;
  GenerationOptions g;
  std::string device;
  int tp = 1, pp = 1, threads = 0;
  bool interactive = false, no_cache = false, ids_out = false;
  try {
    OptionParser p("tessera-generate",
                   "--load CKPT (--prompt TEXT... | --prompt-file F | --interactive) [options]");
    p.group("Model").add_options()("load", po::value(&load)->required(),
                                   "checkpoint directory (any layout; resharded on load)")(
        "tensor-model-parallel-size", po::value(&tp)->default_value(1),
        "tensor-parallel ranks for generation")("pipeline-model-parallel-size",
                                                po::value(&pp)->default_value(1),
                                                "pipeline stages for generation")(
        "tokenizer-type", po::value(&to.type)->default_value(to.type),
        "GPT2BPETokenizer | HuggingFaceTokenizer")(
        "vocab-file", po::value(&to.vocab_file)->default_value(to.vocab_file),
        "GPT2BPETokenizer: encoder.json")("merge-file",
                                          po::value(&to.merge_file)->default_value(to.merge_file),
                                          "GPT2BPETokenizer: vocab.bpe")(
        "tokenizer-model", po::value(&to.model),
        "HuggingFaceTokenizer: tokenizer.json, or the directory that holds it")(
        "eod-token", po::value(&to.eod_token),
        "HuggingFaceTokenizer: the token that stops generation (default: eos_token of "
        "tokenizer_config.json)")("threads", po::value(&threads)->default_value(0),
                                  "threads per rank (0: this rank's share of its cores)")(
        "device", po::value(&device)->default_value("auto"),
        "cpu | cuda | auto (cuda when a GPU is visible)");
    p.group("Prompts").add_options()("prompt", po::value(&prompts_text)->composing(),
                                     "a prompt (repeat for a batch of prompts of any lengths)")(
        "prompt-file", po::value(&prompt_file), "one prompt per line")(
        "prompt-ids", po::value(&prompt_ids)->composing(),
        "a prompt as space-separated token ids (no tokenizer); output is ids too")(
        "interactive", po::bool_switch(&interactive),
        "read prompts from standard input until 'stop' or end of input");
    p.group("Sampling")
        .add_options()("max-new-tokens", po::value(&g.max_new_tokens)->default_value(64),
                       "tokens to generate per prompt (fewer on the end-of-document token)")(
            "temperature", po::value(&g.sampling.temperature)->default_value(1.0),
            "softmax temperature (0: greedy)")(
            "top-k", po::value(&g.sampling.top_k)->default_value(0),
            "sample among the k most likely tokens (0: all; 1: greedy)")(
            "top-p", po::value(&g.sampling.top_p)->default_value(1.0),
            "nucleus sampling mass, in (0, 1]")(
            "greedy", po::bool_switch(),
            "always take the most likely token (same as --temperature 0)")(
            "seed", po::value(&g.sampling.seed)->default_value(1234),
            "sampling seed (same seed, same text, any layout)")(
            "no-kv-cache", po::bool_switch(&no_cache),
            "recompute every sequence at each step (slow; for checking the cache)");
    if (!p.parse(argc, argv)) return 0;
    if (p.vm()["greedy"].as<bool>()) g.sampling.temperature = 0;
    g.use_kv_cache = !no_cache;
    g.sampling.validate();
    if (g.max_new_tokens < 1) throw ConfigError("--max-new-tokens must be >= 1");
    ids_out = !prompt_ids.empty();
    if (prompts_text.empty() && prompt_file.empty() && prompt_ids.empty() && !interactive)
      throw ConfigError("give --prompt, --prompt-file, --prompt-ids or --interactive");

    ProcessGrid grid(tp, pp);
    device = resolve_device(device, grid.host());
    ParallelContext ctx = grid.context();
    LogOptions lo;
    lo.rank = grid.world_rank();
    lo.host = grid.host();
    init_logging(lo);
    set_num_threads(threads > 0 ? threads : default_threads(grid.node_comm()));
    CheckpointReader ckpt(load);
    const GPTConfig cfg = ckpt.meta().model;
    std::shared_ptr<const Tokenizer> tok;
    if (!ids_out) {
      tok = load_tokenizer(to);
      if (tok->vocab_size() != cfg.vocab_size)
        throw ConfigError(detail::concat(
            "the checkpoint's vocabulary has ", cfg.vocab_size, " tokens, the tokenizer (",
            to.type == "HuggingFaceTokenizer" ? to.model : to.vocab_file, ") ", tok->vocab_size(),
            "; use the tokenizer the model was trained with, or --prompt-ids"));
      g.eod_id = tok->eod_id();
    }
    validate_model_layout(cfg, tp, pp);  // heads, key/value heads, ffn width, layers
    auto be = make_rank_backend(grid, device);
    ctx = grid.context();  // NCCL groups on CUDA
    GPTModel model(cfg, model_shard_for(cfg, tp, ctx.tp_rank, pp, ctx.pp_rank), *be, *ctx.tp);
    std::vector<float> host;  // read on the host, copied to the backend
    for (const ParamSpec& s : model.params().specs()) {
      host.resize(static_cast<size_t>(s.numel()));
      ckpt.read_slice("model", s, host.data());
      Tensor p = model.params().param(s);
      be->copy_from_host(p, host.data());
    }
    if (root)
      std::cerr << "tessera-generate: " << ckpt.path() << " (" << cfg.num_layers
                << " layers, hidden " << cfg.hidden_size << ", saved at TP " << ckpt.meta().tp_size
                << " x PP " << ckpt.meta().pp_size << ") on TP " << tp << " x PP " << pp
                << std::endl;

    auto encode = [&](const std::string& s) { return tok ? tok->encode(s) : parse_ids(s); };
    // A completion continues its prompt's text, so its tokens are joined as they stream (a
    // tokenizer's decode() would strip a leading space meant for the start of a text), without the
    // end-of-document token that stopped it.
    auto text_of = [&](const std::vector<int32_t>& ids) {
      std::string o;
      for (int32_t t : ids) {
        if (!tok)
          o += (o.empty() ? "" : " ") + std::to_string(t);
        else if (t != g.eod_id)
          o += tok->token_bytes(t);
      }
      return o;
    };
    const bool tty = isatty(STDOUT_FILENO);
    auto run = [&](const std::vector<std::string>& texts) {
      std::vector<std::vector<int32_t>> prompts;
      for (const std::string& s : texts) prompts.push_back(encode(s));
      // The KV cache holds what these prompts can reach, not the model's every position (Llama
      // 3's 131072 would take gigabytes per prompt).
      int64_t longest = 0;
      for (const auto& p : prompts) longest = std::max<int64_t>(longest, p.size());
      const int64_t context = std::min<int64_t>(cfg.max_positions(), longest + g.max_new_tokens);
      InferenceEngine engine(model, ctx, static_cast<int>(prompts.size()), context);
      const bool stream = root && tty && prompts.size() == 1 && tok;
      if (stream) std::cout << texts[0] << std::flush;
      const GenerationResult r = generate(engine, ctx, prompts, g, [&](int, int32_t t) {
        if (stream && t != g.eod_id) std::cout << tok->token_bytes(t) << std::flush;
      });
      if (!root) return;
      if (stream) {
        std::cout << "\n";
      } else {
        for (size_t i = 0; i < prompts.size(); ++i) {
          if (prompts.size() > 1) std::cout << "[" << i + 1 << "] ";
          std::cout << (tok ? texts[i] : text_of(prompts[i]) + " |") << (tok ? "" : " ")
                    << text_of(r.completions[i]) << "\n";
        }
      }
      const double dec =
          r.decode_seconds > 0
              ? (r.generated_tokens - static_cast<double>(prompts.size())) / r.decode_seconds
              : 0;
      std::fprintf(stderr,
                   "tessera-generate: %lld prompt tokens prefilled in %.3f s (%.0f tokens/s), %lld "
                   "tokens generated, decode %.1f tokens/s\n",
                   (long long)r.prompt_tokens, r.prefill_seconds,
                   r.prompt_tokens / std::max(r.prefill_seconds, 1e-9),
                   (long long)r.generated_tokens, dec);
    };
    std::vector<std::string> texts = prompts_text;
    for (const std::string& ids : prompt_ids) texts.push_back(ids);
    if (!prompt_file.empty()) {
      std::ifstream in(prompt_file);
      if (!in) throw ConfigError("--prompt-file '" + prompt_file + "' cannot be read");
      for (std::string line; std::getline(in, line);)
        if (!line.empty()) texts.push_back(line);
    }
    if (!texts.empty()) run(texts);
    if (interactive) {
      // Rank 0 reads; every rank receives the prompt (as bytes in a float tensor broadcast).
      while (true) {
        std::string line;
        double len = -1;
        if (root) {
          std::cout << "prompt> " << std::flush;
          if (std::getline(std::cin, line) && line != "stop")
            len = static_cast<double>(line.size());
        }
        ctx.world->all_reduce_f64(&len, 1, ReduceOp::Max);
        if (len < 0) break;
        Tensor bytes({std::max<int64_t>(1, static_cast<int64_t>(len))});
        if (root)
          for (size_t i = 0; i < line.size(); ++i)
            bytes.f32()[i] = static_cast<unsigned char>(line[i]);
        ctx.world->broadcast(bytes, 0);
        line.resize(static_cast<size_t>(len));
        for (size_t i = 0; i < line.size(); ++i)
          line[i] = static_cast<char>(static_cast<int>(bytes.f32()[i]));
        if (line.empty()) continue;
        run({line});
      }
    }
  } catch (const ConfigError& e) {
    if (root) std::fprintf(stderr, "tessera-generate: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
  return 0;
}
