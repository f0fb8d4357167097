// hf_gpt2.cpp: name and orientation mapping between Tessera and Hugging Face GPT-2.
#include "checkpoint/hf_gpt2.hpp"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/json.hpp"

namespace tessera {

namespace {

// The Hugging Face name of a Tessera parameter, and whether its matrix is transposed (Conv1D).
struct HfName {
  std::string name;
  bool transpose = false;
};

HfName hf_name(const std::string& n) {
  if (n == "wte") return {"wte.weight"};
  if (n == "wpe") return {"wpe.weight"};
  if (n == "lnf.weight") return {"ln_f.weight"};
  if (n == "lnf.bias") return {"ln_f.bias"};
  // layers.<i>.<rest>
  const size_t dot = n.find('.', 7);
  const std::string layer = n.substr(7, dot - 7), rest = n.substr(dot + 1);
  const std::string h = "h." + layer + ".";
  if (rest == "ln1.weight") return {h + "ln_1.weight"};
  if (rest == "ln1.bias") return {h + "ln_1.bias"};
  if (rest == "ln2.weight") return {h + "ln_2.weight"};
  if (rest == "ln2.bias") return {h + "ln_2.bias"};
  if (rest == "attn.qkv.weight") return {h + "attn.c_attn.weight", true};
  if (rest == "attn.qkv.bias") return {h + "attn.c_attn.bias"};
  if (rest == "attn.proj.weight") return {h + "attn.c_proj.weight", true};
  if (rest == "attn.proj.bias") return {h + "attn.c_proj.bias"};
  if (rest == "mlp.fc1.weight") return {h + "mlp.c_fc.weight", true};
  if (rest == "mlp.fc1.bias") return {h + "mlp.c_fc.bias"};
  if (rest == "mlp.fc2.weight") return {h + "mlp.c_proj.weight", true};
  if (rest == "mlp.fc2.bias") return {h + "mlp.c_proj.bias"};
  throw Error("no Hugging Face name for parameter " + n);
}

// The Hugging Face shape of a Tessera parameter of global shape g (wte cut to the true vocabulary).
Shape hf_shape(const ParamSpec& s, int64_t vocab) {
  const int64_t rows = s.global_shape[0];
  int64_t inner = 1;
  for (size_t d = 1; d < s.global_shape.size(); ++d) inner *= s.global_shape[d];
  const HfName h = hf_name(s.name);
  if (s.name == "wte") return {vocab, s.global_shape[1]};
  if (h.transpose) {  // [out..., in] -> [in, out]
    const int64_t in = s.global_shape.back();
    return {in, rows * inner / in};
  }
  if (s.global_shape.size() > 1 && s.name != "wpe")
    return {rows * inner};  // qkv bias [3,H,hd] -> [3C]
  return s.global_shape;
}

}  // namespace

void export_hf_gpt2(const CheckpointReader& ckpt, const std::string& dir,
                    const std::function<void(const std::string&)>& progress) {
  const GPTConfig& cfg = ckpt.meta().model;
  if (!cfg.learned_positions() || cfg.rmsnorm() || cfg.swiglu || cfg.group_query_attention ||
      !cfg.tied_head() || !cfg.add_bias_linear)
    throw ConfigError("checkpoint '" + ckpt.path() +
                      "' is not a GPT-2 model (it uses the Llama family's options: RoPE, "
                      "RMSNorm, SwiGLU, grouped-query attention, an untied head or no biases); "
                      "the Hugging Face export writes GPT2LMHeadModel only");
  if (cfg.head_dim() * cfg.num_attention_heads != cfg.hidden_size || cfg.apply_layernorm_1p ||
      cfg.squared_relu)
    throw ConfigError("checkpoint '" + ckpt.path() + "' has " + cfg.describe() +
                      "; GPT2LMHeadModel has none of --kv-channels, --apply-layernorm-1p and "
                      "--squared-relu: train without them to export");
  prepare_save_dir(dir);  // with its parents; ConfigError when it cannot be written
  const auto specs = global_param_specs(cfg);
  SafetensorsWriter w(dir + "/model.safetensors",
                      {{"format", "pt"}, {"source", "tessera " + ckpt.path()}});
  for (const ParamSpec& s : specs)
    w.declare("transformer." + hf_name(s.name).name, hf_shape(s, cfg.vocab_size));
  std::vector<float> global, hf;
  for (const ParamSpec& s : specs) {
    global.resize(s.numel());
    ckpt.read_slice("model", s, global.data());
    const HfName h = hf_name(s.name);
    const Shape shape = hf_shape(s, cfg.vocab_size);
    if (h.transpose) {  // ours [out, in] -> HF [in, out]
      const int64_t in = shape[0], out = shape[1];
      hf.resize(global.size());
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) hf[i * out + o] = global[o * in + i];
      w.write("transformer." + h.name, hf.data());
    } else {
      w.write("transformer." + h.name, global.data());  // wte: the first vocab rows
    }
    if (progress) progress("exported " + s.name + " -> transformer." + h.name);
  }
  w.finish();
  std::ostringstream c;
  char eps[32];
  std::snprintf(eps, sizeof eps, "%.10g", cfg.layernorm_epsilon);
  c << "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
    << "  \"activation_function\": \"gelu_new\",\n  \"n_embd\": " << cfg.hidden_size
    << ",\n  \"n_layer\": " << cfg.num_layers << ",\n  \"n_head\": " << cfg.num_attention_heads
    << ",\n  \"n_positions\": " << cfg.max_positions() << ",\n  \"n_ctx\": " << cfg.max_positions()
    << ",\n  \"n_inner\": "
    << (cfg.ffn() == 4 * cfg.hidden_size ? std::string("null") : std::to_string(cfg.ffn()))
    << ",\n  \"vocab_size\": " << cfg.vocab_size << ",\n  \"layer_norm_epsilon\": " << eps
    << ",\n  \"initializer_range\": " << cfg.init_method_std
    << ",\n  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n"
    << "  \"bos_token_id\": " << cfg.vocab_size - 1
    << ",\n  \"eos_token_id\": " << cfg.vocab_size - 1
    << ",\n  \"tie_word_embeddings\": true,\n  \"torch_dtype\": \"float32\"\n}\n";
  const std::string tmp = dir + "/config.json.tmp";
  {
    std::ofstream f(tmp);
    f << c.str();
    if (!f) throw Error("cannot write '" + tmp + "' (disk full?)");
  }
  if (std::rename(tmp.c_str(), (dir + "/config.json").c_str()) != 0)
    throw Error("cannot rename '" + tmp + "'");
}

HfGpt2::HfGpt2(const std::string& dir, int divisible_by) {
  const std::string cfg_path = dir + "/config.json";
  std::ifstream in(cfg_path);
  if (!in)
    throw ConfigError("'" + cfg_path +
                      "' cannot be opened; --from-hf needs a Hugging Face GPT-2 directory");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::string model_type;
  int64_t n_inner = 0;
  try {
    JsonReader r(text);
    r.object([&](const std::string& k) {
      if (k == "n_embd")
        cfg_.hidden_size = static_cast<int>(r.int_value());
      else if (k == "n_layer")
        cfg_.num_layers = static_cast<int>(r.int_value());
      else if (k == "n_head")
        cfg_.num_attention_heads = static_cast<int>(r.int_value());
      else if (k == "n_positions")
        cfg_.max_position_embeddings = static_cast<int>(r.int_value());
      else if (k == "vocab_size")
        cfg_.vocab_size = r.int_value();
      else if (k == "layer_norm_epsilon")
        cfg_.layernorm_epsilon = r.number_value();
      else if (k == "n_inner")
        n_inner = r.null_value() ? 0 : r.int_value();
      else if (k == "model_type")
        model_type = r.string_value();
      else
        r.skip_value();
    });
  } catch (const JsonError& e) {
    throw ConfigError("'" + cfg_path + "' does not parse: " + e.message);
  }
  if (model_type != "gpt2")
    throw ConfigError("'" + cfg_path + "' has model_type \"" + model_type +
                      "\"; only gpt2 is supported");
  cfg_.ffn_hidden_size = static_cast<int>(n_inner);
  cfg_.seq_length = cfg_.max_position_embeddings;
  cfg_.make_vocab_size_divisible_by = divisible_by;
  try {
    cfg_.validate();
  } catch (const ConfigError& e) {
    throw ConfigError("'" + cfg_path + "' describes an invalid model: " + e.what());
  }
  st_ = std::make_unique<SafetensorsReader>(dir + "/model.safetensors");
  prefix_ = st_->has("transformer.wte.weight") ? "transformer." : "";
  for (const ParamSpec& s : global_param_specs(cfg_)) {
    const std::string n = prefix_ + hf_name(s.name).name;
    if (!st_->has(n)) throw ConfigError("'" + st_->path() + "' has no tensor " + n);
    const Shape want = hf_shape(s, cfg_.vocab_size);
    if (st_->entries().at(n).shape != want)
      throw ConfigError("'" + st_->path() + "': " + n + " has shape " +
                        shape_str(st_->entries().at(n).shape) + ", config.json implies " +
                        shape_str(want));
  }
}

void HfGpt2::read_slice(const ParamSpec& spec, float* out) const {
  const HfName h = hf_name(spec.name);
  const std::vector<float> hf = st_->read(prefix_ + h.name);
  const Shape shape = hf_shape(spec, cfg_.vocab_size);
  // The global tensor in Tessera's layout (padding rows of wte stay zero).
  std::vector<float> global(static_cast<size_t>(shape_numel(spec.global_shape)), 0.f);
  if (h.transpose) {
    const int64_t in = shape[0], outn = shape[1];
    for (int64_t i = 0; i < in; ++i)
      for (int64_t o = 0; o < outn; ++o) global[o * in + i] = hf[i * outn + o];
  } else {
    std::copy(hf.begin(), hf.end(), global.begin());
  }
  for (int64_t i = 0; i < spec.numel(); ++i) out[i] = global[global_element_index(spec, i)];
}

}  // namespace tessera
