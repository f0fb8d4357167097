// tessera-reshard: converts a checkpoint (model and optimizer state) to another tensor/pipeline
// parallel layout, offline, tensor by tensor. The data-parallel size is free at load time.
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/reshard.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/timer.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  std::string load, save;
  int tp = 1, pp = 1, ep = 1;
  try {
    OptionParser p("tessera-reshard",
                   "--load CKPT --save OUT --target-tensor-model-parallel-size T "
                   "--target-pipeline-model-parallel-size P");
    p.group("Resharding")
        .add_options()("load", po::value(&load)->required(),
                       "checkpoint directory (with latest_checkpointed_iteration.txt) or an "
                       "iter_NNNNNNN directory")(
            "save", po::value(&save)->required(),
            "output checkpoint directory, created with its parents: a new one (one that holds "
            "a checkpoint, or lies inside the source, is refused; the source is never "
            "modified)")("target-tensor-model-parallel-size", po::value(&tp)->default_value(1),
                         "tensor-parallel size of the output")(
            "target-pipeline-model-parallel-size", po::value(&pp)->default_value(1),
            "pipeline-parallel size of the output")(
            "target-expert-model-parallel-size", po::value(&ep)->default_value(1),
            "MoE: the expert-parallel size the output will train at (checked against the "
            "experts; the files hold every expert by its global index, so any size loads them)");
    if (!p.parse(argc, argv)) return 0;
    Timer t;
    CheckpointReader src(load);
    // The output neither contains nor lies inside the checkpoint being read (compared as
    // absolute paths with links resolved, however the two were spelled).
    auto absolute = [](const std::string& path) {
      std::error_code ec;
      const std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
      return ec ? path : p.string();
    };
    const std::string from = absolute(src.path()), to = absolute(save);
    if (from == to || from.rfind(to + "/", 0) == 0 || to.rfind(from + "/", 0) == 0)
      throw ConfigError("--save '" + save + "' is or contains the checkpoint being read ('" +
                        src.path() + "'); write to a new directory");
    CheckpointMeta meta = src.meta();
    check_target_expert_parallel(meta.model, ep, src.path());
    refuse_save_over_checkpoint(save, meta.iteration);
    std::cout << "tessera-reshard: " << src.path() << " (iteration " << meta.iteration << ", TP "
              << meta.tp_size << " x PP " << meta.pp_size << ", vocabulary "
              << meta.model.vocab_size << " padded to "
              << meta.model.padded_vocab_size(meta.tp_size) << ") -> " << save << " (TP " << tp
              << " x PP " << pp << ", padded to " << meta.model.padded_vocab_size(tp) << ")"
              << std::endl;
    meta.tp_size = tp;
    meta.pp_size = pp;
    meta.pipeline_layout.clear();  // written at the even split
    write_checkpoint(
        save, meta,
        [&](const std::string& group, const ParamSpec& s, float* out) {
          src.read_slice(group, s, out);
        },
        [](const std::string& line) { std::cout << line << std::endl; }, &src);
    std::cout << "tessera-reshard: wrote " << save << "/" << iteration_dir_name(meta.iteration)
              << " in " << t.seconds() << " s" << std::endl;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "tessera-reshard: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-reshard: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
