// tessera-convert: Hugging Face GPT-2 export (--to-hf: model.safetensors + config.json from a
// checkpoint of any layout) and import (--from-hf: a checkpoint at any target layout).
#include <cstdio>
#include <iostream>

#include "checkpoint/hf_gpt2.hpp"
#include "checkpoint/reshard.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/timer.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  bool to_hf = false;
  std::string from_hf, load, save;
  int tp = 1, pp = 1, divisible = 128;
  try {
    OptionParser p(
        "tessera-convert",
        "--to-hf --load CKPT --save HF_DIR | --from-hf HF_DIR --save CKPT [--target-...]");
    p.group("Conversion")
        .add_options()("to-hf", po::bool_switch(&to_hf),
                       "export --load CKPT to Hugging Face GPT-2 format in --save DIR")(
            "from-hf", po::value(&from_hf),
            "import the Hugging Face GPT-2 directory (config.json, model.safetensors)")(
            "load", po::value(&load), "checkpoint to export (with --to-hf)")(
            "save", po::value(&save)->required(),
            "output: a directory for the HF files, or a checkpoint directory")(
            "target-tensor-model-parallel-size", po::value(&tp)->default_value(1),
            "with --from-hf: tensor-parallel size of the checkpoint")(
            "target-pipeline-model-parallel-size", po::value(&pp)->default_value(1),
            "with --from-hf: pipeline size of the checkpoint")(
            "make-vocab-size-divisible-by", po::value(&divisible)->default_value(128),
            "with --from-hf: vocabulary padding multiple (times TP)");
    if (!p.parse(argc, argv)) return 0;
    if (to_hf == !from_hf.empty())
      throw ConfigError("give exactly one of --to-hf (with --load) and --from-hf DIR");
    Timer t;
    if (to_hf) {
      if (load.empty()) throw ConfigError("--to-hf needs --load CKPT");
      CheckpointReader ckpt(load);
      std::cout << "tessera-convert: " << ckpt.path() << " (TP " << ckpt.meta().tp_size << " x PP "
                << ckpt.meta().pp_size << ") -> " << save << "/model.safetensors, config.json"
                << std::endl;
      int n = 0;
      export_hf_gpt2(ckpt, save, [&](const std::string&) { ++n; });
      std::cout << "tessera-convert: exported " << n << " tensors in " << t.seconds() << " s"
                << std::endl;
    } else {
      HfGpt2 hf(from_hf, divisible);
      CheckpointMeta meta;
      meta.model = hf.config();
      meta.tp_size = tp;
      meta.pp_size = pp;
      meta.has_optimizer = false;
      meta.config_text = "# imported from Hugging Face GPT-2 directory " + from_hf + "\n";
      std::cout << "tessera-convert: " << from_hf << " (" << meta.model.num_layers
                << " layers, hidden " << meta.model.hidden_size << ", vocabulary "
                << meta.model.vocab_size << ") -> " << save << " (TP " << tp << " x PP " << pp
                << ", no optimizer state)" << std::endl;
      write_checkpoint(
          save, meta,
          [&](const std::string&, const ParamSpec& s, float* out) { hf.read_slice(s, out); },
          [](const std::string& line) { std::cout << line << std::endl; });
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
