// accepted.cpp: Megatron-LM options that mean nothing in Tessera, accepted so that a launch
// script runs unchanged, each with one start-up line saying why it has no effect.
#include <algorithm>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"

namespace tessera {
namespace {

struct AcceptedOption {
  const char* name;
  const char* values;  // nullptr: a switch; "": any integer; else the allowed words, '|'-separated
  const char* why;
};
constexpr AcceptedOption kAccepted[] = {
    {"use-flash-attn", nullptr,
     "attention is always fused; --attention-backend picks the kernels (auto: cuDNN's fused "
     "attention where it runs the shape, Tessera's flash kernels otherwise)"},
    {"no-async-tensor-model-parallel-allreduce", nullptr,
     "tensor-parallel communication has one implementation"},
    {"exit-signal-handler", nullptr, "SIGTERM and SIGUSR1 always save a checkpoint and exit"},
    {"DDP-impl", "local|torch",
     "one data-parallel implementation (bucketed gradient all-reduce overlapped with the "
     "backward)"},
    {"distributed-backend", "nccl|gloo", "NCCL between GPUs and MPI for host tensors, always"},
    {"use-mcore-models", nullptr, "one model implementation"},
    {"use-legacy-models", nullptr, "one model implementation"},
    {"transformer-impl", "local|transformer_engine", "one transformer implementation"},
    {"no-masked-softmax-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"no-bias-gelu-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"no-bias-dropout-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"no-gradient-accumulation-fusion", nullptr, "Tessera's kernels are always the fused ones"},
    {"attention-softmax-in-fp32", nullptr, "the attention softmax is always computed in fp32"},
    {"accumulate-allreduce-grads-in-fp32", nullptr,
     "gradients are always accumulated and reduced in fp32"},
    {"use-cpu-initialization", nullptr,
     "each rank draws its own slice of the initialization from a counter-based RNG"},
    {"log-throughput", nullptr, "the iteration line always carries tokens/s and TFLOP/s"},
    {"num-workers", "", "the loader reads ahead on one prefetch thread per rank"},
    {"override-opt_param-scheduler", nullptr,
     "a resumed run always takes this run's learning-rate and weight-decay schedule (a change "
     "from the checkpoint's is one warning line)"},
    // Megatron-FSDP's recommended options (docs/training.md, "Megatron-FSDP").
    {"ckpt-format", "fsdp_dtensor",
     "Tessera's sharded HDF5 checkpoint holds a Megatron-FSDP run (loadable at any layout and "
     "sharding)"},
    {"grad-reduce-in-bf16", nullptr,
     "gradients are reduced in fp32 (exact across layouts; bf16 reduction is not offered)"},
    {"use-nccl-ub", nullptr,
     "NCCL user-buffer registration is not used: the collectives run on Tessera's own buffers"},
    {"fsdp-double-buffer", nullptr,
     "Megatron-FSDP's units are gathered into buffers allocated once per unit; no double buffer"},
    {"fsdp-manual-registration", nullptr,
     "NCCL user-buffer registration is not used: nothing to register"},
    {"init-model-with-meta-device", nullptr,
     "each rank initializes only its own shard from the counter-based RNG: no full model is "
     "ever materialized"},
    {"override-opt-param-scheduler", nullptr,
     "a resumed run always takes this run's learning-rate and weight-decay schedule (a change "
     "from the checkpoint's is one warning line)"},
};

class AcceptedOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions&) override {
    auto& g =
        p.group("Accepted for Megatron-LM's scripts, without effect (one line each at start-up)");
    for (const AcceptedOption& a : kAccepted) {
      if (!a.values)
        g.add_options()(a.name, po::bool_switch(), a.why);
      else
        g.add_options()(a.name, po::value<std::string>(),
                        *a.values ? (std::string(a.values) + ": " + a.why).c_str() : a.why);
    }
  }

  // Each given option's value checked, and its line (a note about the input).
  void resolve(const OptionParser& p, RunOptions&, StartupNotes& notes) override {
    for (const AcceptedOption& a : kAccepted) {
      if (!p.given(a.name)) continue;
      std::string given = std::string("--") + a.name;
      if (a.values) {
        const std::string v = p.get<std::string>(a.name);
        given += " " + v;
        check_value(a, v, given);
      } else if (!p.get<bool>(a.name)) {
        continue;  // `use-flash-attn = false` in a config file
      }
      notes.input.push_back(given + ": accepted without effect: " + a.why);
    }
  }

 private:
  static void check_value(const AcceptedOption& a, const std::string& v, const std::string& given) {
    if (!*a.values) {
      size_t used = 0;
      try {
        if (std::stoll(v, &used) < 0) used = 0;
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != v.size()) throw ConfigError(given + ": not a whole number >= 0");
    } else if (("|" + std::string(a.values) + "|").find("|" + v + "|") == std::string::npos) {
      std::string allowed = a.values;
      std::replace(allowed.begin(), allowed.end(), '|', ',');
      throw ConfigError(given + " is not a choice (allowed: " + allowed + ")");
    }
  }
};

}  // namespace

std::unique_ptr<OptionGroup> make_accepted_options() {
  return std::make_unique<AcceptedOptions>();
}

}  // namespace tessera
