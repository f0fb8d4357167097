// tessera-preprocess: tokenizes jsonl or text files with GPT-2's BPE or a Hugging Face
// tokenizer.json into HDF5 token shards (DESIGN.md invariant 5), with many worker threads. Thin:
// parses options and calls lib/data.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

#include "core/config.hpp"
#include "core/cpus.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "data/megatron_import.hpp"
#include "data/preprocess.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  PreprocessOptions o;
  TokenizerOptions to;
  std::string shard_size, input_format, chat_template, json_key, json_keys;
  try {
    OptionParser p(
        "tessera-preprocess",
        "--input FILES... --output-prefix PREFIX (--vocab-file encoder.json --merge-file vocab.bpe "
        "| --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json)");
    p.group("Input").add_options()(
        "input", po::value(&o.inputs)->multitoken()->composing()->required(),
        "input files or quoted globs: .jsonl/.json (one JSON object per line) or plain text; with "
        "--input-format megatron, the prefix of a Megatron-LM PREFIX.bin/PREFIX.idx dataset")(
        "input-format", po::value(&input_format)->default_value("auto"),
        "auto (jsonl or text by file name) | megatron (an indexed dataset, index version 1: its "
        "tokens unchanged, its documents as they are)")(
        "json-key", po::value(&json_key),
        "member of each jsonl object that holds the document (default: text; with "
        "--chat-template: messages)")("json-keys", po::value(&json_keys),
                                      "Megatron's name of --json-key (one member)")(
        "chat-template", po::value(&chat_template),
        "chatml | llama3 | mistral | auto: each jsonl line holds a conversation (a list of "
        "{\"role\", \"content\"} messages), rendered with the template and written with a "
        "loss mask: only the assistant turns' content and end-of-turn token are targets "
        "(auto: the template tokenizer_config.json names beside --tokenizer-model)")(
        "split-lines", po::bool_switch(&o.split_lines),
        "plain text: every non-empty line is a document (default: one document per file)");
    p.group("Tokenizer")
        .add_options()("tokenizer-type", po::value(&to.type)->default_value(to.type),
                       "GPT2BPETokenizer | HuggingFaceTokenizer")(
            "vocab-file", po::value(&to.vocab_file), "GPT2BPETokenizer: encoder.json (vocab.json)")(
            "merge-file", po::value(&to.merge_file), "GPT2BPETokenizer: vocab.bpe (merges.txt)")(
            "tokenizer-model", po::value(&to.model),
            "HuggingFaceTokenizer: tokenizer.json, or the directory that holds it")(
            "eod-token", po::value(&to.eod_token),
            "HuggingFaceTokenizer: the end-of-document token (default: eos_token of "
            "tokenizer_config.json beside tokenizer.json)")(
            "append-eod", po::value(&o.append_eod)->default_value(true)->implicit_value(true),
            "end every document with the end-of-document token (a bare --append-eod, as in "
            "Megatron, is on; --append-eod=false turns it off)");
    p.group("Output").add_options()("output-prefix", po::value(&o.output_prefix)->required(),
                                    "shards are written as PREFIX_00000.h5, PREFIX_00001.h5, ...")(
        "shard-size", po::value(&shard_size)->default_value("100M"),
        "tokens per shard, about (K, M, G suffixes)")(
        "workers", po::value(&o.workers)->default_value(0),
        "tokenizer threads (0: the cores this process may use)");
    if (!p.parse(argc, argv)) return 0;
    o.shard_tokens = parse_token_count(shard_size);
    if (!json_keys.empty() && !json_key.empty() && json_keys != json_key)
      throw ConfigError("--json-key '" + json_key + "' and --json-keys '" + json_keys +
                        "' name different members; give one");
    if (!json_keys.empty()) json_key = json_keys;
    if (!chat_template.empty()) {
      o.chat = true;
      o.chat_format = resolve_chat_format(chat_template, to.model, &o.chat_default_system);
    }
    o.json_key = !json_key.empty() ? json_key : o.chat ? "messages" : "text";
    if (o.workers < 0)
      throw ConfigError("--workers=" + std::to_string(o.workers) +
                        " is out of range (allowed: >= 0)");
    if (o.workers == 0) o.workers = affinity_cores();
    if (input_format != "auto" && input_format != "megatron")
      throw ConfigError("--input-format '" + input_format +
                        "' is not a format (allowed: auto, megatron)");
    const bool megatron = input_format == "megatron";
    if (megatron && o.chat)
      throw ConfigError(
          "--chat-template renders jsonl conversations; --input-format megatron imports "
          "tokens as they are: give one of them");
    if (megatron && o.inputs.size() != 1)
      throw ConfigError(detail::concat("--input-format megatron takes one --input PREFIX (got ",
                                       o.inputs.size(), ")"));
    const auto tok = load_tokenizer(to);
    {  // a prefix, not a directory: DIR/ would write DIR/_00000.h5
      std::error_code ec;
      if (!o.output_prefix.empty() &&
          (o.output_prefix.back() == '/' || std::filesystem::is_directory(o.output_prefix, ec)))
        throw ConfigError("--output-prefix '" + o.output_prefix +
                          "' is a directory; give a file-name prefix inside it (e.g. '" +
                          o.output_prefix + (o.output_prefix.back() == '/' ? "" : "/") +
                          "corpus' writes corpus_00000.h5, ...)");
    }
    create_parent_dirs(o.output_prefix, "--output-prefix");
    const bool tty = isatty(STDOUT_FILENO);
    auto show = [&](const std::string& line, bool final) {
      if (tty)
        std::cout << "\r\033[K" << line << (final ? "\n" : "") << std::flush;
      else
        std::cout << line << std::endl;
    };
    if (megatron) {
      const PreprocessResult r =
          import_megatron_dataset(o.inputs[0], o.output_prefix, o.shard_tokens, *tok, show, tty);
      std::cout << "tessera-preprocess: " << r.documents << " documents, " << r.tokens
                << " tokens from the Megatron-LM dataset " << o.inputs[0] << " in "
                << r.shards.size() << " shard(s) " << o.output_prefix << "_*.h5 in " << r.seconds
                << " s" << std::endl;
      return 0;
    }
    const PreprocessResult r = preprocess(o, *tok, show, tty);
    std::cout << "tessera-preprocess: " << r.documents
              << (o.chat ? std::string(" conversations (template ") +
                               chat_format_name(o.chat_format) + ", with loss masks)"
                         : std::string(" documents"))
              << ", " << r.tokens << " tokens (" << r.bytes << " bytes of text) in "
              << r.shards.size() << " shard(s) " << o.output_prefix << "_*.h5 in " << r.seconds
              << " s with " << o.workers << " workers" << std::endl;
    if (!o.chat_default_system.empty())
      std::cout << "tessera-preprocess: note: conversations without a system message get the "
                   "template's default one, as apply_chat_template adds it: '"
                << o.chat_default_system << "'" << std::endl;
    if (!r.note.empty()) std::cout << "tessera-preprocess: note: " << r.note << std::endl;
    if (r.skipped > 0)
      std::cout << "tessera-preprocess: " << r.skipped
                << " conversation(s) left out: no assistant turn, nothing to learn (the first: "
                << r.first_skipped << ")" << std::endl;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "tessera-preprocess: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-preprocess: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
