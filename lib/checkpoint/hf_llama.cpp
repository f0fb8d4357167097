// hf_llama.cpp: name, shape and config mapping between Tessera and Hugging Face Llama, and the
// models of its shape that differ only in config.json: Qwen2 (biases on q, k and v) and Mistral;
// and Mixtral (Mistral with a MoE MLP in every layer).
#include "checkpoint/hf_llama.hpp"

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "checkpoint/hf_deepseek.hpp"
#include "core/error.hpp"
#include "core/ini.hpp"
#include "core/json.hpp"

namespace tessera {

namespace {

std::string read_text(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) throw ConfigError("'" + path + "' cannot be opened; " + what);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The Hugging Face tensors whose rows, concatenated in this order, make Tessera parameter `n`
// (flattened to [rows, cols], or to one axis for vectors) in a model of type `arch` with
// `num_layers` layers: the family adapter's names where it has its own, else Llama's.
std::vector<std::string> hf_parts(const std::string& n, const std::string& arch, int num_layers) {
  if (const HfFamily* f = hf_family(arch))
    if (std::vector<std::string> p = f->parts(n, num_layers); !p.empty()) return p;
  if (n == "wte") return {"model.embed_tokens.weight"};
  if (n == "lm_head") return {"lm_head.weight"};
  if (n == "lnf.weight") return {"model.norm.weight"};
  if (n.rfind("layers.", 0) != 0) throw Error("no Hugging Face Llama name for parameter " + n);
  const size_t dot = n.find('.', 7);
  const std::string h = "model.layers." + n.substr(7, dot - 7) + ".", rest = n.substr(dot + 1);
  const std::string a = h + "self_attn.", m = h + "mlp.";
  if (rest == "ln1.weight") return {h + "input_layernorm.weight"};
  if (rest == "ln2.weight") return {h + "post_attention_layernorm.weight"};
  if (rest == "attn.q_norm.weight") return {a + "q_norm.weight"};  // Qwen3
  if (rest == "attn.k_norm.weight") return {a + "k_norm.weight"};
  for (const char* kind : {"weight", "bias"}) {
    const std::string k = kind;
    if (rest == "attn.q." + k) return {a + "q_proj." + k};
    if (rest == "attn.kv." + k) return {a + "k_proj." + k, a + "v_proj." + k};
    if (rest == "attn.qkv." + k) return {a + "q_proj." + k, a + "k_proj." + k, a + "v_proj." + k};
    if (rest == "attn.proj." + k) return {a + "o_proj." + k};
    if (rest == "mlp.fc1." + k) return {m + "gate_proj." + k, m + "up_proj." + k};
    if (rest == "mlp.fc2." + k) return {m + "down_proj." + k};
  }
  if (arch == "qwen3_moe") {  // router mlp.gate; experts Llama MLPs
    if (rest == "mlp.router.weight") return {m + "gate.weight"};
    if (rest.rfind("mlp.experts.", 0) == 0) {
      const size_t d = rest.find('.', 12);
      const std::string x = m + "experts." + rest.substr(12, d - 12) + ".", w = rest.substr(d + 1);
      if (w == "fc1.weight") return {x + "gate_proj.weight", x + "up_proj.weight"};
      if (w == "fc2.weight") return {x + "down_proj.weight"};
    }
  }
  // Mixtral: the router is block_sparse_moe.gate; expert e's w1 (gate) and w3 (up) make fc1,
  // w2 is fc2.
  const std::string moe = h + "block_sparse_moe.";
  if (rest == "mlp.router.weight") return {moe + "gate.weight"};
  if (rest.rfind("mlp.experts.", 0) == 0) {
    const size_t d = rest.find('.', 12);
    const std::string x = moe + "experts." + rest.substr(12, d - 12) + ".", w = rest.substr(d + 1);
    if (w == "fc1.weight") return {x + "w1.weight", x + "w3.weight"};
    if (w == "fc2.weight") return {x + "w2.weight"};
  }
  throw Error("no Hugging Face Llama name for parameter " + n);
}

// The tensors beside the parameters' parts (the family adapter's; none for the Llama family).
std::vector<HfExtra> hf_extras(const GPTConfig& cfg, const std::string& arch) {
  const HfFamily* f = hf_family(arch);
  return f ? f->extras(cfg) : std::vector<HfExtra>{};
}

bool is_vocab(const ParamSpec& s) {
  return s.name == "wte" || s.name == "lm_head";
}

// Hugging Face's shape of each part of `s` (the parts are equal; vocabulary rows unpadded).
Shape hf_part_shape(const ParamSpec& s, size_t parts, int64_t vocab) {
  const int64_t numel = shape_numel(s.global_shape);
  if (is_vocab(s)) return {vocab, s.global_shape[1]};
  const bool bias = s.name.size() > 5 && s.name.compare(s.name.size() - 5, 5, ".bias") == 0;
  const bool vector = bias || s.global_shape.size() == 1;
  if (vector) return {numel / static_cast<int64_t>(parts)};
  const int64_t cols = s.global_shape.back();
  return {numel / cols / static_cast<int64_t>(parts), cols};
}

std::string hf_dtype(const std::string& d) {
  if (d == "bf16") return "BF16";
  if (d == "f32") return "F32";
  if (d == "f16") return "F16";
  throw ConfigError("--export-dtype=" + d + " is not a dtype (allowed: bf16, f32, f16)");
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) throw Error("cannot write '" + tmp + "' (disk full?)");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error("cannot rename '" + tmp + "'");
}

std::string number(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%.10g", v);
  return b;
}

}  // namespace

const HfFamily* hf_family(const std::string& arch) {
  for (const HfFamily* f : {&deepseek_v3_family()})
    if (arch == f->model_type) return f;
  return nullptr;
}

std::string hf_model_type(const std::string& dir) {
  const std::string path = dir + "/config.json";
  const std::string text = read_text(path, "--from-hf needs a Hugging Face model directory");
  std::string type;
  try {
    JsonReader r(text);
    r.object([&](const std::string& k) {
      if (k == "model_type")
        type = r.string_value();
      else
        r.skip_value();
    });
  } catch (const JsonError& e) {
    throw ConfigError("'" + path + "' does not parse: " + e.message);
  }
  if (type.empty()) throw ConfigError("'" + path + "' has no model_type");
  return type;
}

std::string hf_export_architecture(const GPTConfig& cfg, const std::string& asked) {
  if (asked.empty()) {
    if (cfg.mla()) return "deepseek_v3";
    if (cfg.qk_layernorm) return cfg.moe() ? "qwen3_moe" : "qwen3";
    return cfg.moe() ? "mixtral" : cfg.add_qkv_bias && !cfg.add_bias_linear ? "qwen2" : "llama";
  }
  if (asked != "llama" && asked != "qwen2" && asked != "qwen3" && asked != "qwen3_moe" &&
      asked != "mistral" && asked != "mixtral" && !hf_family(asked))
    throw ConfigError("--hf-architecture=" + asked +
                      " is not known (allowed: llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, "
                      "deepseek_v3)");
  return asked;
}

std::string hf_class_name(const std::string& arch) {
  if (arch == "qwen2") return "Qwen2ForCausalLM";
  if (arch == "qwen3") return "Qwen3ForCausalLM";
  if (arch == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (arch == "mistral") return "MistralForCausalLM";
  if (arch == "mixtral") return "MixtralForCausalLM";
  if (const HfFamily* f = hf_family(arch)) return f->class_name;
  if (arch == "gpt2") return "GPT2LMHeadModel";
  return "LlamaForCausalLM";
}

namespace {

// A tensor planned into an exported file: its Hugging Face name and shape, the Tessera parameter
// (an index into the specs) and which of that parameter's parts it is.
struct PlannedTensor {
  std::string name;
  Shape shape;
  size_t spec = 0, part = 0;
  int bias_layer = -1;  // >= 0: that layer's expert bias instead (group "router")
};

// The name of exported file f of n.
std::string export_file_name(size_t f, size_t n) {
  if (n == 1) return std::string("model.safetensors");
  char b[64];
  std::snprintf(b, sizeof b, "model-%05zu-of-%05zu.safetensors", f + 1, n);
  return std::string(b);
}

// Refuses (ConfigError) a model that the Hugging Face class `cls` of `arch` does not compute.
void check_exportable(const GPTConfig& cfg, const std::string& arch, const std::string& cls,
                      const std::string& ck) {
  if (const HfFamily* f = hf_family(arch)) {
    f->check_exportable(cfg, ck);
    return;
  }
  if (cfg.mla() || cfg.mtp())
    throw ConfigError(ck + " has " +
                      (cfg.mla() ? "multi-latent attention" : "multi-token prediction layers") +
                      "; " + cls + " has none: export it with --hf-architecture deepseek_v3");
  const bool moe_arch = arch == "mixtral" || arch == "qwen3_moe";
  const bool qwen3 = arch == "qwen3" || arch == "qwen3_moe";
  if (cfg.moe() != moe_arch)
    throw ConfigError(ck + (cfg.moe() ? " is a mixture of experts; export it with "
                                        "--hf-architecture mixtral, or qwen3_moe with "
                                        "--qk-layernorm"
                                      : " is a dense model; " + cls +
                                            " is a mixture of experts: export it with "
                                            "--hf-architecture " +
                                            (cfg.qk_layernorm ? "qwen3" : "llama")));
  if (cfg.qk_layernorm != qwen3)
    throw ConfigError(ck + (cfg.qk_layernorm
                                ? " normalizes its query and key heads (--qk-layernorm); " + cls +
                                      " does not: export it with --hf-architecture " +
                                      (cfg.moe() ? "qwen3_moe" : "qwen3")
                                : " has no query/key norms; " + cls +
                                      " has them (q_norm, k_norm): train with "
                                      "--qk-layernorm, or export with --hf-architecture " +
                                      (cfg.moe() ? "mixtral" : "llama")));
  if (cfg.moe()) {  // what the sparse block of MixtralForCausalLM / Qwen3MoeForCausalLM computes
    std::string why;
    if (arch == "mixtral" && cfg.num_moe_layers() != cfg.num_layers)
      why = "MoE in only some layers (--moe-layer-freq " + cfg.moe_layer_freq + ")";
    else if (cfg.moe_router_score_function != "softmax" ||
             (arch == "mixtral" && cfg.moe_router_pre_softmax))
      why = arch == "mixtral" ? "a router other than the softmax over the top-k logits"
                              : "sigmoid router scores (--moe-router-score-function sigmoid)";
    else if (cfg.moe_router_topk_scaling_factor > 0)
      why = "routing weights scaled by --moe-router-topk-scaling-factor";
    else if (cfg.moe_shared_expert_intermediate_size > 0)
      why = "a shared expert";
    else if (cfg.moe_expert_capacity_factor > 0)
      why = "token dropping (--moe-expert-capacity-factor)";
    if (!why.empty()) throw ConfigError(ck + " has " + why + "; " + cls + " has none of that");
  }
  if (qwen3 && cfg.qkv_bias())
    throw ConfigError(ck + " has linear biases; " + cls +
                      " has none (attention_bias false): train with --disable-bias-linear and "
                      "without --add-qkv-bias to export");
  if (!cfg.rope() || !cfg.rmsnorm() || !cfg.swiglu)
    throw ConfigError(ck + " is not a Llama-architecture model (" + cls +
                      " needs RoPE, RMSNorm and SwiGLU; it has " + cfg.describe() + ")");
  if (cfg.rotary_percent != 1.0)
    throw ConfigError(ck + " rotates " + std::to_string(cfg.rotary_dim()) + " of " +
                      std::to_string(cfg.head_dim()) + " features per head (--rotary-percent); " +
                      cls + " rotates them all");
  if (cfg.alibi()) throw ConfigError(ck + " uses ALiBi; " + cls + " uses RoPE");
  if (cfg.rotary_interleaved)
    throw ConfigError(ck + " rotates interleaved feature pairs (--rotary-interleaved); " + cls +
                      " rotates halves (i, i + d/2): train without --rotary-interleaved to export");
  if (cfg.apply_layernorm_1p)
    throw ConfigError(ck + " applies its norm weights as 1 + w (--apply-layernorm-1p); " + cls +
                      " has no such option: train without it to export");
  const bool qkv_only = cfg.add_qkv_bias && !cfg.add_bias_linear;
  if (arch == "qwen2" && !qkv_only)
    throw ConfigError(ck + " has " +
                      (cfg.add_bias_linear ? "biases in every linear layer" : "no QKV biases") +
                      "; Qwen2ForCausalLM has biases on q, k and v only (--disable-bias-linear "
                      "--add-qkv-bias): export it with --hf-architecture llama");
  if (arch == "llama" && qkv_only)
    throw ConfigError(ck +
                      " has biases on q, k and v only (--add-qkv-bias); LlamaForCausalLM's "
                      "attention_bias also covers o_proj: export it with --hf-architecture qwen2");
  if ((arch == "mistral" || arch == "mixtral") && cfg.qkv_bias())
    throw ConfigError(ck +
                      " has linear biases; MistralForCausalLM has none: export it with "
                      "--hf-architecture " +
                      (qkv_only ? "qwen2" : "llama"));
}

// Plans the files: tensors in order, a new shard when the next one would pass the limit; `total`
// gets the bytes of them all.
std::vector<std::vector<PlannedTensor>> plan_export_files(
    const std::vector<ParamSpec>& specs, const GPTConfig& cfg, const std::string& cfg_arch,
    const HfExportOptions& o, const std::string& dtype, uint64_t& total) {
  std::vector<std::vector<PlannedTensor>> files(1);
  uint64_t in_file = 0;
  total = 0;
  const size_t width = safetensors_width(dtype);
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto parts = hf_parts(specs[i].name, cfg_arch, cfg.num_layers);
    for (size_t k = 0; k < parts.size(); ++k) {
      const Shape shape = hf_part_shape(specs[i], parts.size(), cfg.vocab_size);
      const uint64_t bytes = width * static_cast<uint64_t>(shape_numel(shape));
      if (in_file > 0 && in_file + bytes > o.max_shard_bytes) {
        files.emplace_back();
        in_file = 0;
      }
      files.back().push_back({parts[k], shape, i, k});
      in_file += bytes;
      total += bytes;
    }
  }
  for (const HfExtra& x : hf_extras(cfg, cfg_arch)) {  // the family's router state and copies
    PlannedTensor t{x.name, x.shape, 0, 0, x.bias_layer};
    if (x.bias_layer < 0)
      for (size_t i = 0; i < specs.size(); ++i)
        if (specs[i].name == x.copy_of) t.spec = i;
    const uint64_t bytes = width * static_cast<uint64_t>(shape_numel(x.shape));
    if (in_file > 0 && in_file + bytes > o.max_shard_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(t);
    in_file += bytes;
    total += bytes;
  }
  return files;
}

// Writes the planned safetensors files, reading each parameter from the checkpoint once.
void write_export_files(const CheckpointReader& ckpt, const std::string& dir,
                        const std::vector<ParamSpec>& specs,
                        const std::vector<std::vector<PlannedTensor>>& files,
                        const std::string& dtype,
                        const std::function<void(const std::string&)>& progress) {
  const size_t n = files.size();
  std::vector<float> global;
  size_t loaded = SIZE_MAX;
  for (size_t f = 0; f < n; ++f) {
    SafetensorsWriter w(dir + "/" + export_file_name(f, n),
                        {{"format", "pt"}, {"source", "tessera " + ckpt.path()}});
    for (const PlannedTensor& p : files[f]) w.declare(p.name, p.shape, dtype);
    for (const PlannedTensor& p : files[f]) {
      if (p.bias_layer >= 0) {  // the router's expert bias, saved beside the parameters
        const std::string name = expert_bias_name(p.bias_layer);
        std::vector<float> b(static_cast<size_t>(shape_numel(p.shape)));
        if (ckpt.whole_numel(kRouterGroup, name) != static_cast<int64_t>(b.size()))
          throw ConfigError("checkpoint '" + ckpt.path() + "' lacks " + kRouterGroup + "/" + name +
                            " (saved before the expert bias was kept?); " + p.name +
                            " cannot be written");
        ckpt.read_whole(kRouterGroup, name, b.data());
        w.write(p.name, b.data());
        if (progress) progress("exported " + name + " -> " + p.name);
        continue;
      }
      const ParamSpec& s = specs[p.spec];
      if (loaded != p.spec) {
        global.resize(static_cast<size_t>(shape_numel(s.global_shape)));
        ckpt.read_slice("model", s, global.data());
        loaded = p.spec;
      }
      // Part k is the k-th equal run of the flattened global tensor (vocabulary: its first rows).
      const int64_t part_elems = shape_numel(p.shape);
      const size_t step = is_vocab(s) ? 0 : static_cast<size_t>(part_elems);
      w.write(p.name, global.data() + step * p.part);
      if (progress)
        progress("exported " + s.name + " -> " + p.name + " (" + export_file_name(f, n) + ")");
    }
    w.finish();
  }
}

// Removes the files of an earlier export into `dir` that this one (n files) does not replace: a
// stale model.safetensors would be loaded before the index, stale shards would mislead.
void remove_stale_export_files(const std::string& dir, size_t n) {
  if (DIR* d = ::opendir(dir.c_str())) {
    std::set<std::string> written;
    for (size_t f = 0; f < n; ++f) written.insert(export_file_name(f, n));
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      const bool ours =
          name == "model.safetensors" ||
          (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
           name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0);
      if (ours && !written.count(name)) std::remove((dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
}

// Writes model.safetensors.index.json for an export of several files; removes it for one file.
void write_export_index(const std::string& dir,
                        const std::vector<std::vector<PlannedTensor>>& files, uint64_t total) {
  const size_t n = files.size();
  if (n > 1) {
    std::ostringstream idx;
    idx << "{\n  \"metadata\": {\n    \"total_size\": " << total << "\n  },\n  \"weight_map\": {";
    bool first = true;
    for (size_t f = 0; f < n; ++f)
      for (const PlannedTensor& p : files[f]) {
        idx << (first ? "\n" : ",\n") << "    \"" << p.name << "\": \"" << export_file_name(f, n)
            << "\"";
        first = false;
      }
    idx << "\n  }\n}\n";
    write_file_atomically(dir + "/model.safetensors.index.json", idx.str());
  } else {
    std::remove((dir + "/model.safetensors.index.json").c_str());  // a stale one would mislead
  }
}

// Writes the config.json of the exported model (class `cls` of `arch`, tensors in `dtype`).
void write_hf_config(const GPTConfig& cfg, const std::string& arch, const std::string& cls,
                     const std::string& dtype, const std::string& dir) {
  std::ostringstream c;
  const char* torch_dtype = dtype == "BF16" ? "bfloat16" : dtype == "F16" ? "float16" : "float32";
  if (const HfFamily* f = hf_family(arch)) {
    write_file_atomically(dir + "/config.json",
                          f->config_json(cfg, torch_dtype, cfg.moe_aux_loss_coeff));
    return;
  }
  c << "{\n  \"architectures\": [\"" << cls << "\"],\n  \"model_type\": \"" << arch << "\",\n"
    << "  \"hidden_act\": \"silu\",\n  \"hidden_size\": " << cfg.hidden_size
    << ",\n  \"intermediate_size\": " << (arch == "mixtral" ? cfg.moe_ffn() : cfg.ffn())
    << ",\n  \"num_hidden_layers\": " << cfg.num_layers
    << ",\n  \"num_attention_heads\": " << cfg.num_attention_heads
    << ",\n  \"num_key_value_heads\": " << cfg.kv_heads();
  // Qwen2's config has no head_dim before transformers 4.5x (hidden_size / heads there): written
  // only when it differs. Llama and Mistral read it.
  // Qwen3's head_dim defaults to 128 whatever the width: always written.
  if (arch != "qwen2" || cfg.kv_channels > 0) c << ",\n  \"head_dim\": " << cfg.head_dim();
  c << ",\n  \"max_position_embeddings\": " << cfg.max_positions()
    << ",\n  \"vocab_size\": " << cfg.vocab_size
    << ",\n  \"rms_norm_eps\": " << number(cfg.layernorm_epsilon)
    << ",\n  \"rope_theta\": " << number(cfg.rotary_base) << ",\n  \"rope_scaling\": ";
  if (cfg.use_rope_scaling)
    c << "{\n    \"rope_type\": \"llama3\",\n    \"factor\": " << number(cfg.rope_scaling_factor)
      << ",\n    \"low_freq_factor\": " << number(cfg.rope_scaling_low_freq_factor)
      << ",\n    \"high_freq_factor\": " << number(cfg.rope_scaling_high_freq_factor)
      << ",\n    \"original_max_position_embeddings\": "
      << number(cfg.rope_scaling_original_max_positions) << "\n  }";
  else
    c << "null";
  if (arch == "llama")
    c << ",\n  \"attention_bias\": " << (cfg.add_bias_linear ? "true" : "false")
      << ",\n  \"mlp_bias\": " << (cfg.add_bias_linear ? "true" : "false");
  else if (arch == "qwen2" || arch == "qwen3" || arch == "qwen3_moe")
    c << (arch == "qwen2" ? "" : ",\n  \"attention_bias\": false")
      << ",\n  \"use_sliding_window\": false,\n  \"sliding_window\": null"
      << ",\n  \"max_window_layers\": " << cfg.num_layers;
  else
    c << ",\n  \"sliding_window\": null";
  if (arch == "mixtral")
    c << ",\n  \"num_local_experts\": " << cfg.num_experts
      << ",\n  \"num_experts_per_tok\": " << cfg.moe_router_topk
      << ",\n  \"router_aux_loss_coef\": " << number(cfg.moe_aux_loss_coeff)
      << ",\n  \"router_jitter_noise\": 0.0,\n  \"output_router_logits\": false";
  if (arch == "qwen3_moe") {  // the dense layers as mlp_only_layers (decoder_sparse_step 1)
    c << ",\n  \"num_experts\": " << cfg.num_experts
      << ",\n  \"num_experts_per_tok\": " << cfg.moe_router_topk
      << ",\n  \"moe_intermediate_size\": " << cfg.moe_ffn()
      << ",\n  \"norm_topk_prob\": " << (cfg.moe_router_pre_softmax ? "false" : "true")
      << ",\n  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [";
    for (int l = 0, n = 0; l < cfg.num_layers; ++l)
      if (!cfg.is_moe_layer(l)) c << (n++ ? ", " : "") << l;
    c << "],\n  \"router_aux_loss_coef\": " << number(cfg.moe_aux_loss_coeff)
      << ",\n  \"output_router_logits\": false";
  }
  c << ",\n  \"tie_word_embeddings\": " << (cfg.tied_head() ? "true" : "false")
    << ",\n  \"initializer_range\": " << number(cfg.init_method_std)
    << ",\n  \"attention_dropout\": 0.0,\n  \"torch_dtype\": \"" << torch_dtype << "\"\n}\n";
  write_file_atomically(dir + "/config.json", c.str());
}

}  // namespace

void export_hf_llama(const CheckpointReader& ckpt, const std::string& dir, const HfExportOptions& o,
                     const std::function<void(const std::string&)>& progress) {
  GPTConfig cfg = ckpt.meta().model;
  // The training options that HF's config holds but the model's structure does not: from the
  // options the run saved with the checkpoint (its `config` attribute, one `key = value` a line).
  const std::map<std::string, std::string> saved = ini_values(ckpt.meta().config_text);
  if (const auto it = saved.find("moe-aux-loss-coeff"); it != saved.end())
    cfg.moe_aux_loss_coeff = std::strtod(it->second.c_str(), nullptr);
  if (const auto it = saved.find("moe-router-load-balancing-type"); it != saved.end())
    cfg.moe_router_load_balancing_type = it->second;
  const std::string arch = hf_export_architecture(cfg, o.architecture);
  const std::string cls = hf_class_name(arch);
  const std::string ck = "checkpoint '" + ckpt.path() + "'";
  check_exportable(cfg, arch, cls, ck);
  const std::string dtype = hf_dtype(o.dtype);
  prepare_save_dir(dir);  // with its parents; ConfigError when it cannot be written
  const auto specs = global_param_specs(cfg);
  uint64_t total = 0;
  const std::vector<std::vector<PlannedTensor>> files =
      plan_export_files(specs, cfg, arch, o, dtype, total);
  write_export_files(ckpt, dir, specs, files, dtype, progress);
  remove_stale_export_files(dir, files.size());
  write_export_index(dir, files, total);
  write_hf_config(cfg, arch, cls, dtype, dir);
}

namespace {

// The settings of a config.json that are not GPTConfig fields, with the defaults of the config
// classes (LlamaConfig; Qwen2Config, MistralConfig and MixtralConfig where they differ).
struct HfConfigSettings {
  std::string model_type, act = "silu", scaling;
  double partial = 1.0;
  int64_t kv_heads = 0, head_dim = 0;
  bool attention_bias = false, mlp_bias = false;
  // Sliding-window attention (Mistral's sliding_window, Qwen2's use_sliding_window): Tessera's
  // attention is full causal, so a window that applies is refused. "" absent, "null", or a number.
  std::string sliding_window;
  bool use_sliding_window = false;
  // Mixtral (MixtralConfig's defaults): the experts, and its router settings.
  int64_t experts = 0, topk = 2;
  double jitter = 0, aux_coef = 0.001;
  std::string unknown_router;  // a router key this importer does not know
  // Qwen3-MoE (Qwen3MoeConfig's defaults): the experts' width, whether the top-k weights are
  // renormalized, and which layers are sparse: l is when (l + 1) % sparse_step == 0 and l is not
  // in mlp_only_layers.
  int64_t moe_width = 768, sparse_step = 1;
  bool norm_topk_prob = false;
  std::vector<int64_t> mlp_only_layers;
};

// Reads a rope_scaling or rope_parameters (`k`) object: its fields into cfg, its type into
// `scaling`.
void parse_rope_scaling(JsonReader& r, const std::string& k, GPTConfig& cfg, std::string& scaling) {
  // rope_parameters: newer transformers' spelling, with rope_theta inside.
  if (r.null_value()) return;
  r.object([&](const std::string& f) {
    if (f == "rope_theta")
      cfg.rotary_base = r.number_value();
    else if (f == "rope_type" || f == "type")
      scaling = r.string_value();
    else if (f == "factor")
      cfg.rope_scaling_factor = r.number_value();
    else if (f == "low_freq_factor")
      cfg.rope_scaling_low_freq_factor = r.number_value();
    else if (f == "high_freq_factor")
      cfg.rope_scaling_high_freq_factor = r.number_value();
    else if (f == "original_max_position_embeddings")
      cfg.rope_scaling_original_max_positions = r.number_value();
    else
      r.skip_value();
  });
  if (scaling.empty()) scaling = k == "rope_parameters" ? "default" : "unnamed";
}

// Reads config.json (`text`, from `path`): its GPTConfig fields into cfg, the rest into h.
void parse_hf_config(const std::string& path, const std::string& text, GPTConfig& cfg,
                     HfConfigSettings& h) {
  try {
    JsonReader r(text);
    // A size: a whole number >= 1 (null allowed where HF's default applies), named otherwise.
    auto size = [&](const std::string& k, bool null_ok) -> int64_t {
      if (null_ok && r.null_value()) return 0;
      const double v = r.number_value();
      if (!(v >= 1 && v <= double(1 << 30) && v == std::floor(v)))
        throw ConfigError("'" + path + "' has \"" + k + "\": " + number(v) +
                          " (allowed: a whole number >= 1" + (null_ok ? ", or null" : "") + ")");
      return static_cast<int64_t>(v);
    };
    r.object([&](const std::string& k) {
      if (k == "hidden_size")
        cfg.hidden_size = static_cast<int>(size(k, false));
      else if (k == "intermediate_size")
        cfg.ffn_hidden_size = static_cast<int>(size(k, false));
      else if (k == "num_hidden_layers")
        cfg.num_layers = static_cast<int>(size(k, false));
      else if (k == "num_attention_heads")
        cfg.num_attention_heads = static_cast<int>(size(k, false));
      else if (k == "num_key_value_heads")
        h.kv_heads = size(k, true);
      else if (k == "head_dim")
        h.head_dim = size(k, true);
      else if (k == "max_position_embeddings")
        cfg.max_position_embeddings = static_cast<int>(size(k, false));
      else if (k == "vocab_size")
        cfg.vocab_size = size(k, false);
      else if (k == "rms_norm_eps")
        cfg.layernorm_epsilon = r.number_value();
      else if (k == "rope_theta")
        cfg.rotary_base = r.number_value();
      else if (k == "partial_rotary_factor")
        h.partial = r.null_value() ? 1.0 : r.number_value();
      else if (k == "tie_word_embeddings")
        cfg.untie_embeddings_and_output_weights = !r.bool_value();
      else if (k == "attention_bias")
        h.attention_bias = r.bool_value();
      else if (k == "mlp_bias")
        h.mlp_bias = r.bool_value();
      else if (k == "hidden_act")
        h.act = r.string_value();
      else if (k == "sliding_window")
        h.sliding_window = r.null_value() ? "null" : number(r.number_value());
      else if (k == "use_sliding_window")
        h.use_sliding_window = r.bool_value();
      else if (k == "model_type")
        h.model_type = r.string_value();
      else if (k == "initializer_range")
        cfg.init_method_std = r.number_value();
      else if (k == "num_local_experts" || (k == "num_experts" && h.model_type == "qwen3_moe"))
        h.experts = r.int_value();
      else if (k == "moe_intermediate_size")
        h.moe_width = size(k, false);
      else if (k == "norm_topk_prob")
        h.norm_topk_prob = r.bool_value();
      else if (k == "decoder_sparse_step")
        h.sparse_step = size(k, false);
      else if (k == "mlp_only_layers")
        r.null_value() ? void() : r.array([&] { h.mlp_only_layers.push_back(r.int_value()); });
      else if (k == "num_experts_per_tok")
        h.topk = r.int_value();
      else if (k == "router_aux_loss_coef")
        h.aux_coef = r.number_value();
      else if (k == "router_jitter_noise")
        h.jitter = r.null_value() ? 0.0 : r.number_value();
      else if (k.rfind("router_", 0) == 0 && k != "router_z_loss_coef") {
        h.unknown_router = k;
        r.skip_value();
      } else if (k == "rope_scaling" || k == "rope_parameters") {
        parse_rope_scaling(r, k, cfg, h.scaling);
      } else {
        r.skip_value();
      }
    });
  } catch (const JsonError& e) {
    throw ConfigError("'" + path + "' does not parse: " + e.message);
  }
}

// Qwen3-MoE: refuses what Tessera's router does not compute; takes the experts, router and sparse
// layers into cfg (mlp_only_layers and decoder_sparse_step as a --moe-layer-freq pattern).
void check_qwen3_moe_config(const std::string& path, const HfConfigSettings& h, GPTConfig& cfg) {
  if (!h.unknown_router.empty())
    throw ConfigError("'" + path + "' has router setting \"" + h.unknown_router +
                      "\", which this importer does not know (allowed: router_aux_loss_coef)");
  if (h.experts < 1 || h.topk < 1 || h.topk > h.experts)
    throw ConfigError("'" + path + "' has num_experts " + std::to_string(h.experts) +
                      " and num_experts_per_tok " + std::to_string(h.topk) +
                      " (allowed: 1 <= num_experts_per_tok <= num_experts)");
  std::string pattern = "[";
  bool any = false;
  for (int l = 0; l < cfg.num_layers; ++l) {
    const bool dense =
        std::find(h.mlp_only_layers.begin(), h.mlp_only_layers.end(), l) != h.mlp_only_layers.end();
    const bool sparse = !dense && (l + 1) % h.sparse_step == 0;
    pattern += std::string(l ? "," : "") + (sparse ? "1" : "0");
    any |= sparse;
  }
  for (int64_t l : h.mlp_only_layers)
    if (l < 0 || l >= cfg.num_layers)
      throw ConfigError("'" + path + "' has mlp_only_layers entry " + std::to_string(l) +
                        " (allowed: layers 0 to " + std::to_string(cfg.num_layers - 1) + ")");
  if (!any)
    throw ConfigError("'" + path + "' makes no layer sparse (decoder_sparse_step " +
                      std::to_string(h.sparse_step) +
                      ", mlp_only_layers): import it as a dense qwen3 model instead");
  cfg.num_experts = static_cast<int>(h.experts);
  cfg.moe_router_topk = static_cast<int>(h.topk);
  cfg.moe_aux_loss_coeff = h.aux_coef;
  cfg.moe_ffn_hidden_size = static_cast<int>(h.moe_width);
  // norm_topk_prob: the top k of the softmax renormalized = the softmax over the top-k logits
  // (Tessera's default); without it the top k of the softmax over all (--moe-router-pre-softmax).
  cfg.moe_router_pre_softmax = !h.norm_topk_prob;
  cfg.moe_layer_freq = pattern.find('0') == std::string::npos ? "1" : pattern + "]";
}

// Refuses (ConfigError naming `path`) what Tessera does not compute; takes Mixtral's experts and
// router settings into cfg.
void check_hf_config(const std::string& path, const HfConfigSettings& h, GPTConfig& cfg) {
  const std::string& model_type = h.model_type;
  const bool qwen3 = model_type == "qwen3" || model_type == "qwen3_moe";
  if (model_type != "llama" && model_type != "qwen2" && model_type != "mistral" &&
      model_type != "mixtral" && !qwen3)
    throw ConfigError(
        "'" + path + "' has model_type \"" + model_type +
        "\"; this importer reads llama, qwen2, qwen3, qwen3_moe, mistral and mixtral");
  if (qwen3 && h.attention_bias)
    throw ConfigError("'" + path +
                      "' has attention_bias true (biases on q, k, v and o_proj but not the MLP); "
                      "Tessera's biases cover the MLP too or q, k and v alone (allowed: false)");
  if (model_type == "qwen3_moe") check_qwen3_moe_config(path, h, cfg);
  if (model_type == "mixtral") {
    if (h.jitter != 0)
      throw ConfigError("'" + path + "' has router_jitter_noise " + number(h.jitter) +
                        "; Tessera's router has no jitter (allowed: 0)");
    if (!h.unknown_router.empty())
      throw ConfigError("'" + path + "' has router setting \"" + h.unknown_router +
                        "\", which this importer does not know (allowed: router_aux_loss_coef, "
                        "router_jitter_noise 0, router_z_loss_coef)");
    if (h.experts < 1 || h.topk < 1 || h.topk > h.experts)
      throw ConfigError("'" + path + "' has num_local_experts " + std::to_string(h.experts) +
                        " and num_experts_per_tok " + std::to_string(h.topk) +
                        " (allowed: 1 <= num_experts_per_tok <= num_local_experts)");
    cfg.num_experts = static_cast<int>(h.experts);
    cfg.moe_router_topk = static_cast<int>(h.topk);
    cfg.moe_aux_loss_coeff = h.aux_coef;
  }
  if ((model_type == "qwen2" || qwen3) && h.use_sliding_window)
    throw ConfigError("'" + path +
                      "' has use_sliding_window true; Tessera's attention is full causal "
                      "(allowed: use_sliding_window false)");
  if (model_type == "mixtral" && !h.sliding_window.empty() && h.sliding_window != "null")
    throw ConfigError("'" + path + "' has sliding_window " + h.sliding_window +
                      "; Tessera's attention is full causal (allowed: sliding_window null)");
  if (model_type == "mistral" && h.sliding_window != "null")
    throw ConfigError(
        "'" + path + "' has sliding_window " +
        (h.sliding_window.empty() ? "absent (MistralConfig's default 4096)" : h.sliding_window) +
        "; Tessera's attention is full causal (allowed: sliding_window null)");
  if (h.partial != 1.0)
    throw ConfigError("'" + path + "' has partial_rotary_factor " + std::to_string(h.partial) +
                      "; LlamaForCausalLM rotates every feature of a head (allowed: 1)");
  if (h.act != "silu")
    throw ConfigError("'" + path + "' has hidden_act \"" + h.act +
                      "\"; Tessera's SwiGLU is silu-gated (allowed: silu)");
  if (h.scaling == "llama3")
    cfg.use_rope_scaling = true;
  else if (!h.scaling.empty() && h.scaling != "default")
    throw ConfigError("'" + path + "' has rope_scaling of type \"" + h.scaling +
                      "\" (allowed: llama3, or rope_scaling null)");
  if (model_type == "llama" && h.attention_bias != h.mlp_bias)
    throw ConfigError("'" + path + "' has attention_bias " + (h.attention_bias ? "true" : "false") +
                      " but mlp_bias " + (h.mlp_bias ? "true" : "false") +
                      "; Tessera's --disable-bias-linear covers both (they must agree)");
}

// Sets the Llama architecture, biases, query groups and head width of cfg, and validates it.
void apply_hf_config(const std::string& path, const HfConfigSettings& h, int divisible_by,
                     GPTConfig& cfg) {
  cfg.position_embedding_type = "rope";
  cfg.normalization = "RMSNorm";
  cfg.swiglu = true;
  // Qwen2: biases on q, k and v only, always (its config has no switch); Mistral: none.
  cfg.add_bias_linear = h.model_type == "llama" && h.attention_bias;
  cfg.add_qkv_bias = h.model_type == "qwen2";
  cfg.qk_layernorm = h.model_type == "qwen3" || h.model_type == "qwen3_moe";  // q_norm, k_norm
  if (h.kv_heads > 0 && h.kv_heads != cfg.num_attention_heads) {
    cfg.group_query_attention = true;
    cfg.num_query_groups = static_cast<int>(h.kv_heads);
  }
  if (h.model_type == "mixtral") cfg.moe_ffn_hidden_size = cfg.ffn_hidden_size;  // intermediate
  cfg.seq_length = cfg.max_position_embeddings;
  cfg.make_vocab_size_divisible_by = divisible_by;
  // A head_dim other than hidden_size / heads is --kv-channels.
  if (h.head_dim > 0 && cfg.num_attention_heads > 0 &&
      h.head_dim * cfg.num_attention_heads != cfg.hidden_size)
    cfg.kv_channels = static_cast<int>(h.head_dim);
  try {
    cfg.validate();
  } catch (const ConfigError& e) {
    throw ConfigError("'" + path + "' describes an invalid model: " + e.what());
  }
}

// Checks that the safetensors of `dir` hold every tensor cfg implies, in its shape, and nothing
// else.
void check_hf_tensors(const std::string& dir, const GPTConfig& cfg, const std::string& arch,
                      const SafetensorsDir& st) {
  std::set<std::string> expected;
  for (const ParamSpec& s : global_param_specs(cfg)) {
    const auto parts = hf_parts(s.name, arch, cfg.num_layers);
    expected.insert(parts.begin(), parts.end());
    const Shape want = hf_part_shape(s, parts.size(), cfg.vocab_size);
    for (const std::string& n : parts) {
      if (!st.has(n))
        throw ConfigError("the Hugging Face model in '" + dir + "' has no tensor " + n +
                          " (config.json implies it)");
      if (st.entry(n).shape != want)
        throw ConfigError("'" + st.file_of(n) + "': " + n + " has shape " +
                          shape_str(st.entry(n).shape) + ", config.json implies " +
                          shape_str(want));
    }
  }
  // The family's tensors beside the parameters: present, in shape; a copy must repeat its
  // parameter's tensor (Tessera shares the parameter: nothing is lost).
  for (const HfExtra& x : hf_extras(cfg, arch)) {
    expected.insert(x.name);
    if (!st.has(x.name))
      throw ConfigError("the Hugging Face model in '" + dir + "' has no tensor " + x.name +
                        " (config.json implies it)");
    if (st.entry(x.name).shape != x.shape)
      throw ConfigError("'" + st.file_of(x.name) + "': " + x.name + " has shape " +
                        shape_str(st.entry(x.name).shape) + ", config.json implies " +
                        shape_str(x.shape));
    if (x.bias_layer >= 0) continue;
    const std::string main = hf_parts(x.copy_of, arch, cfg.num_layers)[0];
    if (st.read(x.name) != st.read(main))
      throw ConfigError("'" + st.file_of(x.name) + "': " + x.name + " differs from " + main + "; " +
                        x.copy_reason);
  }
  // Anything else is a model config.json does not describe (more layers, biases it says are
  // absent): refused rather than dropped. Old files' rotary inv_freq buffers are derived values.
  const std::string buffer = "rotary_emb.inv_freq";
  for (const std::string& n : st.names())
    if (!expected.count(n) && !(n.size() >= buffer.size() &&
                                n.compare(n.size() - buffer.size(), buffer.size(), buffer) == 0))
      throw ConfigError(
          "'" + st.file_of(n) + "' has tensor " + n + ", which config.json does not describe (" +
          std::to_string(cfg.num_layers) + " layers, " +
          (cfg.add_bias_linear ? "with"
           : cfg.add_qkv_bias  ? "q, k and v"
                               : "no") +
          " biases, " + (cfg.tied_head() ? "tied" : "untied") + " output layer" +
          (cfg.moe() ? ", " + std::to_string(cfg.num_experts) + " experts" : "") + ")");
}

}  // namespace

GPTConfig hf_model_config(const std::string& dir, int divisible_by) {
  const std::string path = dir + "/config.json";
  const std::string text = read_text(path, "--from-hf needs a Hugging Face model directory");
  GPTConfig cfg;
  HfConfigSettings h;
  // The defaults of the config classes (LlamaConfig; Qwen2Config and MistralConfig below).
  h.model_type = hf_model_type(dir);
  if (const HfFamily* f = hf_family(h.model_type)) {  // its own config.json
    double aux = 0;
    f->parse_config(path, text, cfg, aux);
    cfg.make_vocab_size_divisible_by = divisible_by;
    return cfg;
  }
  if (h.model_type == "gpt2")
    throw ConfigError("'" + path +
                      "' is a GPT-2 model: give its options (configs/gpt2-*.ini) instead of its "
                      "config.json");
  const bool qwen3 = h.model_type == "qwen3" || h.model_type == "qwen3_moe";
  cfg.max_position_embeddings = h.model_type == "qwen2" || qwen3                         ? 32768
                                : h.model_type == "mistral" || h.model_type == "mixtral" ? 4096 * 32
                                                                                         : 2048;
  // Mixtral (MixtralConfig's defaults): the experts, and its router settings.
  h.experts = h.model_type == "mixtral" ? 8 : 0;
  if (h.model_type == "qwen3_moe") {  // Qwen3MoeConfig's defaults
    h.experts = 128;
    h.topk = 8;
  }
  if (qwen3) h.head_dim = 128;  // Qwen3Config's head_dim default, whatever hidden / heads
  // intermediate_size's defaults (not 4 x hidden): LlamaConfig 11008, Qwen2Config and Qwen3Config
  // 22016, MistralConfig and MixtralConfig 14336, Qwen3MoeConfig 6144.
  cfg.ffn_hidden_size = h.model_type == "llama"                                  ? 11008
                        : h.model_type == "qwen2" || h.model_type == "qwen3"     ? 22016
                        : h.model_type == "mistral" || h.model_type == "mixtral" ? 14336
                        : h.model_type == "qwen3_moe"                            ? 6144
                                                                                 : 0;
  cfg.layernorm_epsilon = 1e-6;
  cfg.untie_embeddings_and_output_weights = true;
  parse_hf_config(path, text, cfg, h);
  check_hf_config(path, h, cfg);
  apply_hf_config(path, h, divisible_by, cfg);
  return cfg;
}

HfLlama::HfLlama(const std::string& dir, int divisible_by) : dir_(dir) {
  cfg_ = hf_model_config(dir, divisible_by);
  arch_ = hf_model_type(dir);
  st_ = std::make_unique<SafetensorsDir>(dir);
  check_hf_tensors(dir, cfg_, arch_, *st_);
}

std::vector<ExtraTensor> HfLlama::layer_state(int layer) const {
  std::vector<ExtraTensor> out;
  for (const HfExtra& x : hf_extras(cfg_, arch_))
    if (x.bias_layer == layer) {  // e_score_correction_bias -> the router's expert bias
      ExtraTensor e;
      e.group = kRouterGroup;
      e.spec.name = expert_bias_name(layer);
      e.spec.global_shape = e.spec.local_shape = x.shape;
      e.data = st_->read(x.name);
      out.push_back(std::move(e));
    }
  return out;
}

void HfLlama::read_slice(const ParamSpec& spec, float* out) const {
  const auto parts = hf_parts(spec.name, arch_, cfg_.num_layers);
  // The global tensor in Tessera's layout: the parts' rows one after the other (padding rows of
  // the vocabulary stay zero).
  std::vector<float> global(static_cast<size_t>(shape_numel(spec.global_shape)), 0.f);
  size_t at = 0;
  for (const std::string& n : parts) {
    const std::vector<float> t = st_->read(n);
    std::copy(t.begin(), t.end(), global.begin() + static_cast<std::ptrdiff_t>(at));
    at += t.size();
  }
  for (int64_t i = 0; i < spec.numel(); ++i) out[i] = global[global_element_index(spec, i)];
}

}  // namespace tessera
