// tessera-generate: text generation from a checkpoint of any layout, at the TP x PP layout of this
// run (resharded on load), with a KV cache; one or many prompts, or an interactive prompt loop.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "comm/mpi/mpi.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "data/chat_template.hpp"
#include "inference/generator.hpp"
#include "inference_setup.hpp"

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
  std::string prompt_file, chat_template, system, default_system;
  InferenceSetup setup;
  std::vector<std::string> prompts_text, prompt_ids;
  GenerationOptions g;
  bool interactive = false, no_cache = false, ids_out = false, add_bos = false;
  try {
    OptionParser p("tessera-generate",
                   "--load CKPT (--prompt TEXT... | --prompt-file F | --interactive) [options]");
    setup.add_options(p);
    p.group("Prompts").add_options()("prompt", po::value(&prompts_text)->composing(),
                                     "a prompt (repeat for a batch of prompts of any lengths)")(
        "prompt-file", po::value(&prompt_file), "one prompt per line")(
        "prompt-ids", po::value(&prompt_ids)->composing(),
        "a prompt as space-separated token ids (no tokenizer); output is ids too")(
        "interactive", po::bool_switch(&interactive),
        "read prompts from standard input until 'stop' or end of input")(
        "chat-template", po::value(&chat_template),
        "chatml | llama3 | mistral | auto: each prompt is a user turn rendered with the template "
        "and followed by the assistant's header (as tessera-preprocess renders chat data; auto: "
        "the template tokenizer_config.json names); generation stops at the end of the turn")(
        "system", po::value(&system), "with --chat-template: a system message before each prompt");
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
            "recompute every sequence at each step (slow; for checking the cache)")(
            "top-p-decay", po::value(&g.sampling.top_p_decay)->default_value(0.0),
            "after each token, top-p becomes max(top-p x decay, --top-p-bound) (0: no decay)")(
            "top-p-bound", po::value(&g.sampling.top_p_bound)->default_value(0.0),
            "the lowest top-p that --top-p-decay reaches")(
            "beam-size", po::value(&g.beam_size)->default_value(1),
            "beam search with this many beams (1: greedy); prints the best beam of each prompt")(
            "length-penalty", po::value(&g.length_penalty)->default_value(1.0),
            "beam search: a finished beam's score is its log-probability / length^penalty")(
            "add-BOS", po::bool_switch(&add_bos),
            "prepend the tokenizer's beginning-of-sequence token (GPT-2: <|endoftext|>) to each "
            "prompt")(
            "return-log-probs", po::bool_switch(&g.log_probs),
            "print each generated token's log-probability (a line after each completion)");
    if (!p.parse(argc, argv)) return 0;
    if (p.vm()["greedy"].as<bool>()) g.sampling.temperature = 0;
    g.use_kv_cache = !no_cache;
    g.sampling.validate();
    if (g.max_new_tokens < 1) throw ConfigError("--max-new-tokens must be >= 1");
    if (g.beam_size < 1)
      throw ConfigError(detail::concat("--beam-size=", g.beam_size, " must be >= 1"));
    if (!std::isfinite(g.length_penalty))
      throw ConfigError("--length-penalty must be a finite number");
    ids_out = !prompt_ids.empty();
    if (prompts_text.empty() && prompt_file.empty() && prompt_ids.empty() && !interactive)
      throw ConfigError("give --prompt, --prompt-file, --prompt-ids or --interactive");

    InferenceSetup::Loaded L = setup.open("tessera-generate", !ids_out);
    const std::shared_ptr<const Tokenizer>& tok = L.tokenizer;
    if (tok) g.eod_id = tok->eod_id();
    if (add_bos && !tok)
      throw ConfigError("--add-BOS needs a tokenizer (it is not for --prompt-ids)");
    if (!system.empty() && chat_template.empty())
      throw ConfigError("--system needs --chat-template (it is a message of the conversation)");
    const bool chat = !chat_template.empty();
    ChatFormat chat_format = ChatFormat::ChatML;
    if (chat) {
      if (!tok || add_bos)
        throw ConfigError(
            "--chat-template renders text prompts with the tokenizer (not with --prompt-ids or "
            "--add-BOS: the template writes its own tokens)");
      chat_format = resolve_chat_format(chat_template, setup.tokenizer.model, &default_system);
      g.eod_id = tok->special_token_id(chat_end_of_turn(chat_format));
      if (g.eod_id < 0)
        throw ConfigError(std::string("--chat-template ") + chat_format_name(chat_format) +
                          " ends a turn with '" + chat_end_of_turn(chat_format) +
                          "', which the tokenizer does not have as one token");
    }
    const ParallelContext& ctx = L.ctx;
    GPTModel& model = *L.model;

    auto encode = [&](const std::string& s) {
      if (chat) {  // [system,] user: s, then the assistant's header
        std::vector<ChatMessage> m;
        if (!system.empty()) m.push_back({"system", system});
        m.push_back({"user", s});
        std::vector<ChatPiece> pieces = render_chat(chat_format, m, default_system);
        for (ChatPiece& p : chat_generation_prompt(chat_format)) pieces.push_back(std::move(p));
        Tokenizer::Cache cache;
        return encode_chat(chat_format, pieces, *tok, cache);
      }
      std::vector<int32_t> ids;
      if (add_bos) ids.push_back(tok->bos_id());
      const std::vector<int32_t> text = tok ? tok->encode(s) : parse_ids(s);
      ids.insert(ids.end(), text.begin(), text.end());
      return ids;
    };
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
    const bool beam = g.beam_size > 1 || p.given("beam-size");
    auto run = [&](const std::vector<std::string>& texts) {
      std::vector<std::vector<int32_t>> prompts;
      for (const std::string& s : texts) prompts.push_back(encode(s));
      // The KV cache holds what these prompts can reach, not the model's every position (Llama
      // 3's 131072 would take gigabytes per prompt).
      int64_t longest = 0;
      for (const auto& p : prompts) longest = std::max<int64_t>(longest, p.size());
      const int64_t context = std::min<int64_t>(L.context, longest + g.max_new_tokens);
      if (root && longest + g.max_new_tokens > L.context && longest < L.context)
        std::cerr << "tessera-generate: warning: --max-new-tokens " << g.max_new_tokens
                  << ": the longest prompt (" << longest << " tokens) leaves room for "
                  << L.context - longest << " new tokens in the context of " << L.context
                  << " positions (--seq-length, or the model's): generating at most those"
                  << std::endl;
      const bool stream = root && tty && prompts.size() == 1 && tok && !beam;
      if (stream) std::cout << texts[0] << std::flush;
      GenerationResult r;
      if (beam) {  // each prompt on its own, its best beam
        InferenceEngine engine(model, ctx, g.beam_size, context);
        for (const auto& prompt : prompts) {
          GenerationResult b = beam_search(engine, ctx, prompt, g);
          r.completions.push_back(b.completions.at(0));
          if (g.log_probs) r.completion_log_probs.push_back(b.completion_log_probs.at(0));
          r.beam_scores.push_back(b.beam_scores.at(0));
          r.prompt_tokens += b.prompt_tokens;
          r.generated_tokens += static_cast<int64_t>(b.completions[0].size());
          r.prefill_seconds += b.prefill_seconds;
          r.decode_seconds += b.decode_seconds;
        }
      } else {
        InferenceEngine engine(model, ctx, static_cast<int>(prompts.size()), context);
        r = generate(engine, ctx, prompts, g, [&](int, int32_t t) {
          if (stream && t != g.eod_id) std::cout << tok->token_bytes(t) << std::flush;
        });
      }
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
      // Log-probabilities of the generated tokens (and the beam's score), one line per prompt.
      for (size_t i = 0; g.log_probs && i < prompts.size(); ++i) {
        if (prompts.size() > 1) std::cout << "[" << i + 1 << "] ";
        std::ostringstream line;
        line << std::fixed << std::setprecision(6) << "log-probs:";
        for (float lp : r.completion_log_probs.at(i)) line << " " << lp;
        if (beam) line << " | beam score " << r.beam_scores.at(i);
        std::cout << line.str() << std::endl;
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
