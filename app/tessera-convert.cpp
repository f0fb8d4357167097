// tessera-convert: Hugging Face export (--to-hf: safetensors + config.json from a checkpoint of any
// layout) and import (--from-hf: a checkpoint at any target layout), for GPT2LMHeadModel,
// LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM and the mixtures of
// experts MixtralForCausalLM and Qwen3MoeForCausalLM (chosen by the checkpoint's architecture and
// --hf-architecture / config.json's model_type).
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "checkpoint/hf_gpt2.hpp"
#include "checkpoint/hf_llama.hpp"
#include "checkpoint/reshard.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/timer.hpp"

using namespace tessera;

namespace {
// "5GB", "500MB", "64KB" (powers of 1000, as save_pretrained) or a byte count.
uint64_t parse_byte_size(const std::string& text, const std::string& option) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = used ? text.substr(used) : "";
  const double scale = unit.empty() || unit == "B" ? 1
                       : unit == "KB"              ? 1e3
                       : unit == "MB"              ? 1e6
                       : unit == "GB"              ? 1e9
                                                   : -1;
  if (used == 0 || scale < 0 || !(v > 0))
    throw ConfigError(option + "=" + text + " is not a size (allowed: e.g. 5GB, 500MB, 1000000)");
  return static_cast<uint64_t>(v * scale);
}
}  // namespace

int main(int argc, char** argv) {
  bool to_hf = false, overwrite = false;
  std::string from_hf, load, save;
  int tp = 1, pp = 1, ep = 1, divisible = 128, seq_length = 0;
  std::string export_dtype, max_shard = "5GB", hf_architecture;
  try {
    OptionParser p(
        "tessera-convert",
        "--to-hf --load CKPT --save HF_DIR | --from-hf HF_DIR --save NEW_CKPT [--target-...]\n\n"
        "Converts between Tessera checkpoints and Hugging Face directories (config.json +\n"
        "safetensors) of GPT-2 (GPT2LMHeadModel) and the Llama family (LlamaForCausalLM: Llama 2,\n"
        "3, 3.1, 3.2 and models of that shape; Qwen2ForCausalLM: Qwen2, Qwen2.5;\n"
        "MistralForCausalLM without sliding window; MixtralForCausalLM), both ways; imports are "
        "written at any TP x PP.");
    p.group("Conversion")
        .add_options()("to-hf", po::bool_switch(&to_hf),
                       "export --load CKPT to a Hugging Face directory --save DIR: "
                       "GPT2LMHeadModel for a GPT-2 checkpoint, LlamaForCausalLM for a "
                       "Llama-family one (RoPE, RMSNorm, SwiGLU; Qwen2ForCausalLM when only q, k "
                       "and v have biases)")(
            "hf-architecture", po::value(&hf_architecture),
            "with --to-hf of a Llama-family checkpoint: llama | qwen2 | qwen3 | qwen3_moe | "
            "mistral | mixtral (default: qwen3 with --qk-layernorm, qwen3_moe with it and "
            "experts, mixtral for other mixtures of experts, qwen2 with --add-qkv-bias "
            "--disable-bias-linear, else llama)")(
            "from-hf", po::value(&from_hf),
            "import the Hugging Face directory (config.json with model_type gpt2, llama, qwen2, "
            "qwen3, qwen3_moe, mistral or mixtral; "
            "model.safetensors or shards with model.safetensors.index.json)")(
            "load", po::value(&load), "checkpoint to export (with --to-hf)")(
            "save", po::value(&save)->required(),
            "output, created with its parents: the Hugging Face directory (--to-hf), or a new "
            "checkpoint directory (--from-hf; one that holds a checkpoint is refused)")(
            "target-tensor-model-parallel-size", po::value(&tp)->default_value(1),
            "with --from-hf: tensor-parallel size of the checkpoint")(
            "target-pipeline-model-parallel-size", po::value(&pp)->default_value(1),
            "with --from-hf: pipeline size of the checkpoint")(
            "target-expert-model-parallel-size", po::value(&ep)->default_value(1),
            "with --from-hf of a MoE model: the expert-parallel size it will train at (checked "
            "against the experts; the files hold every expert, so any size loads them)")(
            "make-vocab-size-divisible-by", po::value(&divisible)->default_value(128),
            "with --from-hf: vocabulary padding multiple (times TP)")(
            "seq-length", po::value(&seq_length)->default_value(0),
            "with --from-hf: the checkpoint's training sequence length (0: the model's "
            "max_position_embeddings)")(
            "export-dtype", po::value(&export_dtype),
            "with --to-hf: bf16 | f32 | f16 (default: bf16 for Llama, f32 for GPT-2, which is "
            "written in f32 only)")(
            "overwrite", po::bool_switch(&overwrite),
            "with --to-hf: replace the Hugging Face model already in --save (refused without "
            "it)")(
            "max-shard-size", po::value(&max_shard)->default_value("5GB"),
            "with --to-hf (Llama): largest safetensors file, e.g. 5GB, 500MB or bytes; larger "
            "models are split into shards with model.safetensors.index.json");
    if (!p.parse(argc, argv)) return 0;
    if (to_hf == !from_hf.empty())
      throw ConfigError("give exactly one of --to-hf (with --load) and --from-hf DIR");
    Timer t;
    if (to_hf) {
      if (load.empty()) throw ConfigError("--to-hf needs --load CKPT");
      CheckpointReader ckpt(load);
      // An export into a directory that holds one replaces it only when asked (a training
      // --save is protected the same way).
      if (!overwrite) {
        std::error_code ec;
        for (const char* f : {"config.json", "model.safetensors", "model.safetensors.index.json"})
          if (std::filesystem::exists(std::filesystem::path(save) / f, ec))
            throw ConfigError("--save '" + save + "' already holds a Hugging Face model (" + f +
                              "): give a new or empty directory, or --overwrite to replace it");
      }
      const bool llama = ckpt.meta().model.rope();
      if (!llama && !hf_architecture.empty())
        throw ConfigError("--hf-architecture=" + hf_architecture + ": checkpoint '" + ckpt.path() +
                          "' is not a Llama-family model (no RoPE); it exports as GPT2LMHeadModel");
      const std::string arch =
          llama ? hf_export_architecture(ckpt.meta().model, hf_architecture) : "gpt2";
      std::cout << "tessera-convert: " << ckpt.path() << " (TP " << ckpt.meta().tp_size << " x PP "
                << ckpt.meta().pp_size << ") -> " << save << " (" << hf_class_name(arch) << ")"
                << std::endl;
      int n = 0;
      if (llama) {
        HfExportOptions eo;
        if (!export_dtype.empty()) eo.dtype = export_dtype;
        eo.max_shard_bytes = parse_byte_size(max_shard, "--max-shard-size");
        eo.architecture = arch;
        export_hf_llama(ckpt, save, eo, [&](const std::string&) { ++n; });
      } else {
        if (!export_dtype.empty() && export_dtype != "f32")
          throw ConfigError("--export-dtype=" + export_dtype +
                            ": the GPT-2 export writes f32 only (allowed: f32)");
        export_hf_gpt2(ckpt, save, [&](const std::string&) { ++n; });
      }
      std::cout << "tessera-convert: exported " << n << " tensors in " << t.seconds() << " s"
                << std::endl;
    } else {
      refuse_save_over_checkpoint(save, 0);  // before reading anything: an import is iteration 0
      const std::string type = hf_model_type(from_hf);
      if (type != "gpt2" && type != "llama" && type != "qwen2" && type != "qwen3" &&
          type != "qwen3_moe" && type != "mistral" && type != "mixtral" && type != "deepseek_v3")
        throw ConfigError("'" + from_hf + "/config.json' has model_type \"" + type +
                          "\" (allowed: gpt2, llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, "
                          "deepseek_v3)");
      std::unique_ptr<HfGpt2> gpt2;
      std::unique_ptr<HfLlama> llama;
      CheckpointMeta meta;
      if (type == "gpt2") {
        gpt2 = std::make_unique<HfGpt2>(from_hf, divisible);
        meta.model = gpt2->config();
      } else {
        llama = std::make_unique<HfLlama>(from_hf, divisible);
        meta.model = llama->config();
      }
      if (seq_length < 0 || seq_length > meta.model.max_positions())
        throw ConfigError("--seq-length=" + std::to_string(seq_length) +
                          " is out of range (allowed: 1 to the model's " +
                          std::to_string(meta.model.max_positions()) + " positions, or 0)");
      if (seq_length > 0) meta.model.seq_length = seq_length;
      check_target_expert_parallel(meta.model, ep, from_hf);
      meta.tp_size = tp;
      meta.pp_size = pp;
      meta.pipeline_layout.clear();
      meta.has_optimizer = false;
      meta.config_text = "# imported from Hugging Face " + type + " directory " + from_hf + "\n";
      if (meta.model.moe()) {  // HF's router_aux_loss_coef, kept for training and the export
        char coef[64];
        std::snprintf(coef, sizeof coef, "%.17g", meta.model.moe_aux_loss_coeff);
        meta.config_text += std::string("moe-aux-loss-coeff = ") + coef + "\n";
        meta.config_text +=
            "moe-router-load-balancing-type = " + meta.model.moe_router_load_balancing_type + "\n";
      }
      std::cout << "tessera-convert: " << from_hf << " (" << meta.model.num_layers
                << " layers, hidden " << meta.model.hidden_size << ", vocabulary "
                << meta.model.vocab_size << "; " << meta.model.describe() << ") -> " << save
                << " (TP " << tp << " x PP " << pp << ", no optimizer state)" << std::endl;
      std::error_code ec;
      const bool existed = std::filesystem::exists(save, ec);
      try {
        write_checkpoint(
            save, meta,
            [&](const std::string&, const ParamSpec& s, float* out) {
              if (gpt2)
                gpt2->read_slice(s, out);
              else
                llama->read_slice(s, out);
            },
            [](const std::string& line) { std::cout << line << std::endl; }, nullptr,
            [&](int layer) {  // DeepSeek-V3's expert biases beside the weights
              return llama ? llama->layer_state(layer) : std::vector<ExtraTensor>{};
            });
      } catch (...) {  // a refused import leaves nothing: the directory it made goes too
        if (!existed && std::filesystem::is_empty(save, ec)) std::filesystem::remove(save, ec);
        throw;
      }
      std::cout << "tessera-convert: wrote " << save << " in " << t.seconds() << " s" << std::endl;
    }
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "tessera-convert: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-convert: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
