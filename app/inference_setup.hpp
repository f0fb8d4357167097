// inference_setup.hpp: what tessera-generate and tessera-serve share: the model and tokenizer
// options, and loading a checkpoint of any layout onto this run's TP x PP layout.
#pragma once

#include <iostream>
#include <memory>
#include <string>

#include "backend/backend.hpp"
#include "checkpoint/checkpoint.hpp"
#include "checkpoint/reshard.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/logging.hpp"
#include "data/tokenizer.hpp"
#include "model/gpt.hpp"
#include "options/options.hpp"
#include "runtime/process_grid.hpp"
#include "runtime/select.hpp"
#include "train/rank_setup.hpp"
#include "train/router_checkpoint.hpp"

namespace tessera {

struct InferenceSetup {
  std::string load, device;
  TokenizerOptions tokenizer;
  int tp = 1, pp = 1, threads = 0, seq_length = 0;
  bool bf16 = false, fp16 = false;

  // The "Model" options group.
  void add_options(OptionParser& p) {
    tokenizer.vocab_file = "data/gpt2/encoder.json";
    tokenizer.merge_file = "data/gpt2/vocab.bpe";
    p.group("Model").add_options()("load", po::value(&load)->required(),
                                   "checkpoint directory (any layout; resharded on load)")(
        "tensor-model-parallel-size", po::value(&tp)->default_value(1),
        "tensor-parallel ranks for generation")("pipeline-model-parallel-size",
                                                po::value(&pp)->default_value(1),
                                                "pipeline stages for generation")(
        "tokenizer-type", po::value(&tokenizer.type)->default_value(tokenizer.type),
        "GPT2BPETokenizer | HuggingFaceTokenizer")(
        "vocab-file", po::value(&tokenizer.vocab_file)->default_value(tokenizer.vocab_file),
        "GPT2BPETokenizer: encoder.json")(
        "merge-file", po::value(&tokenizer.merge_file)->default_value(tokenizer.merge_file),
        "GPT2BPETokenizer: vocab.bpe")(
        "tokenizer-model", po::value(&tokenizer.model),
        "HuggingFaceTokenizer: tokenizer.json, or the directory that holds it")(
        "eod-token", po::value(&tokenizer.eod_token),
        "HuggingFaceTokenizer: the token that stops generation (default: eos_token of "
        "tokenizer_config.json)")("threads", po::value(&threads)->default_value(0),
                                  "threads per rank (0: this rank's share of its cores)")(
        "device", po::value(&device)->default_value("auto"),
        "cpu | cuda | auto (cuda when a GPU is visible)")(
        "seq-length", po::value(&seq_length)->default_value(0),
        "the context: prompt plus new tokens, at most this many (0: the model's positions)")(
        "bf16", po::bool_switch(&bf16),
        "compute in bf16: weights, activations and the KV cache (the checkpoint's f32 weights "
        "rounded; the GPU's fast path)")("fp16", po::bool_switch(&fp16),
                                         "compute in fp16, as --bf16 does in bf16");
  }

  // After parsing: the layout, the backend, the checkpoint's model on this rank, and (unless
  // `with_tokenizer` is false) the tokenizer, checked against the model's vocabulary.
  struct Loaded {
    std::unique_ptr<ProcessGrid> grid;
    ParallelContext ctx;
    std::unique_ptr<Backend> backend;
    std::unique_ptr<CheckpointReader> checkpoint;
    std::unique_ptr<GPTModel> model;
    std::shared_ptr<const Tokenizer> tokenizer;
    int64_t context = 0;  // --seq-length, or the model's positions
  };
  Loaded open(const char* program, bool with_tokenizer) {
    Loaded L;
    L.grid = std::make_unique<ProcessGrid>(tp, pp);
    device = resolve_device(device, L.grid->host());
    L.ctx = L.grid->context();
    LogOptions lo;
    lo.rank = L.grid->world_rank();
    lo.host = L.grid->host();
    init_logging(lo);
    set_num_threads(threads > 0 ? threads : default_threads(L.grid->node_comm()));
    L.checkpoint = std::make_unique<CheckpointReader>(load);
    GPTConfig cfg = L.checkpoint->meta().model;
    set_seq_length(cfg, seq_length, L.checkpoint->path());
    L.context = seq_length > 0 ? seq_length : cfg.max_positions();
    if (with_tokenizer) {
      // The tokenizer the model was trained with: the checkpoint names it (its training data's),
      // and the default one (GPT-2's files) is only right for a GPT-2 vocabulary.
      const std::string& recorded = L.checkpoint->meta().tokenizer;
      const std::string named = recorded.empty() ? "" : " (tokenizer '" + recorded + "')";
      const bool defaults = tokenizer.type == "GPT2BPETokenizer" && tokenizer.model.empty() &&
                            tokenizer.vocab_file == "data/gpt2/encoder.json" &&
                            tokenizer.merge_file == "data/gpt2/vocab.bpe";
      if (defaults && (cfg.vocab_size != 50257 || (!recorded.empty() && recorded != "gpt2-bpe")))
        throw ConfigError(detail::concat(
            "the checkpoint's model has a vocabulary of ", cfg.vocab_size, " tokens", named,
            ", not GPT-2's (the default tokenizer): give the tokenizer it was trained with "
            "(--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR, or --vocab-file and "
            "--merge-file), or prompts as ids (--prompt-ids)"));
      L.tokenizer = load_tokenizer(tokenizer);
      if (L.tokenizer->vocab_size() != cfg.vocab_size)
        throw ConfigError(detail::concat(
            "the checkpoint's vocabulary has ", cfg.vocab_size, " tokens, the tokenizer (",
            tokenizer.type == "HuggingFaceTokenizer" ? tokenizer.model : tokenizer.vocab_file, ") ",
            L.tokenizer->vocab_size(),
            "; use the tokenizer the model was trained with, or --prompt-ids"));
      if (!recorded.empty() && L.tokenizer->name() != recorded)
        throw ConfigError(
            "the checkpoint was trained on data made with tokenizer '" + recorded +
            "', the one given (" +
            (tokenizer.type == "HuggingFaceTokenizer" ? tokenizer.model : tokenizer.vocab_file) +
            ") is '" + L.tokenizer->name() +
            "': give the tokenizer the data was preprocessed with (another one maps the ids to "
            "other text)");
    }
    validate_model_layout(cfg, tp, pp);  // heads, key/value heads, ffn width, layers
    L.backend = make_rank_backend(*L.grid, device);
    L.ctx = L.grid->context();  // NCCL groups on CUDA
    if (bf16 && fp16) throw ConfigError("--bf16 and --fp16 exclude each other; give one");
    const DType compute = bf16 ? DType::BF16 : fp16 ? DType::F16 : DType::F32;
    L.model =
        std::make_unique<GPTModel>(cfg, model_shard_for(cfg, tp, L.ctx.tp_rank, pp, L.ctx.pp_rank),
                                   *L.backend, *L.ctx.tp, compute);
    std::vector<float> host;  // read on the host, copied to the backend
    for (const ParamSpec& s : L.model->params().specs()) {
      host.resize(static_cast<size_t>(s.numel()));
      L.checkpoint->read_slice("model", s, host.data());
      Tensor p = L.model->params().param(s);
      L.backend->copy_from_host(p, host.data());
    }
    L.model->sync_compute_weights();  // the bf16/fp16 copy (nothing in f32)
    // The routers' expert biases (DeepSeek-V3): they choose the experts, so generation needs them.
    if (const std::string why = restore_router_state(*L.checkpoint, *L.model); !why.empty())
      if (L.grid->world_rank() == 0) std::cerr << program << ": " << why << std::endl;
    if (L.grid->world_rank() == 0)
      std::cerr << program << ": " << L.checkpoint->path() << " (" << cfg.num_layers
                << " layers, hidden " << cfg.hidden_size << ", saved at TP "
                << L.checkpoint->meta().tp_size << " x PP " << L.checkpoint->meta().pp_size
                << ") on TP " << tp << " x PP " << pp << std::endl;
    return L;
  }
};

}  // namespace tessera
