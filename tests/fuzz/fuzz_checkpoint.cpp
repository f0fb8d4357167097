// fuzz_checkpoint.cpp: a checkpoint whose shard file is any bytes (seed: a tiny checkpoint written
// by tessera-train, mutated): the metadata checks and every tensor's slice read against its
// checksum, for model and optimizer; then tessera-checkpoint verify's walk of the whole file. Bad
// input may only throw Error (verify reports damage and throws nothing for a checkpoint directory).
#include <cstdint>
#include <fstream>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/verify.hpp"
#include "core/error.hpp"
#include "fuzz_util.hpp"
#include "model/params.hpp"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = fuzz::scratch_dir() + "/ckpt";
  static const bool made = [&] {
    std::system(("mkdir -p " + dir + "/iter_0000001").c_str());
    std::ofstream(dir + "/latest_checkpointed_iteration.txt") << "1\n";
    return true;
  }();
  (void)made;
  fuzz::write_file(dir + "/iter_0000001/mp_rank_00_000.h5", data, size);
  try {
    CheckpointReader r(dir);
    const GPTConfig& cfg = r.meta().model;
    if (cfg.num_parameters() <= (int64_t(1) << 22)) {  // else a mutated shape: nothing to read
      const auto specs = build_param_specs(cfg, model_shard_for(cfg, 1, 0, 1, 0));
      std::vector<float> buf;
      for (const ParamSpec& s : specs) {
        buf.resize(static_cast<size_t>(s.numel()));
        r.read_slice("model", s, buf.data());
        if (r.meta().has_optimizer) r.read_slice("optimizer/exp_avg", s, buf.data());
      }
    }
  } catch (const Error&) {
  }
  const CheckpointVerifyReport report = verify_checkpoint(dir);
  (void)report;
  return 0;
}
