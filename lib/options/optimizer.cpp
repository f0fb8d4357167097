// optimizer.cpp: --optimizer and Muon's options (issue 59, docs/training.md "Muon"):
// Megatron-Core's names and argparse defaults (Megatron-LM d98e8a6,
// megatron/training/arguments.py), checked here.
#include <ostream>
#include <string>

#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

namespace {

class OptimizerOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    TrainConfig& t = o.train;
    TrainConfig::Muon& m = t.muon;
    p.group("Optimizer")
        .add_options()(
            "optimizer", po::value(&optimizer_)->default_value("adam"),
            "adam (AdamW for every parameter) | muon (Muon for the matrices, AdamW with "
            "--adam-beta1/2 and --adam-eps for the word embedding, the output layer, norms and "
            "biases) | dist_muon (deprecated in Megatron: muon with the distributed optimizer)")(
            "muon-scalar-optimizer", po::value(&scalar_)->default_value("adam"),
            "the optimizer of what Muon does not take: adam (AdamW, Megatron's default)")(
            "muon-momentum", po::value(&m.momentum)->default_value(m.momentum),
            "Muon's momentum: m = beta m + (1 - beta) g")(
            "muon-nesterov", po::bool_switch(&m.nesterov),
            "Nesterov momentum: orthogonalize (1 - beta) g + beta m instead of m")(
            "muon-no-split-qkv", po::bool_switch(&no_split_qkv_),
            "orthogonalize the query, key and value projections as one matrix (default: each "
            "apart)")(
            "muon-scale-mode", po::value(&m.scale_mode)->default_value(m.scale_mode),
            "the update's scale for a (rows, cols) matrix: spectral sqrt(max(rows, cols)) | "
            "unit_rms_norm sqrt(rows / cols) | shape_scaling sqrt(max(1, rows / cols))")(
            "muon-extra-scale-factor", po::value(&m.extra_scale)->default_value(m.extra_scale),
            "times the scale (0.2 with spectral: Moonlight's match of AdamW's update size)")(
            "muon-num-ns-steps", po::value(&m.ns_steps)->default_value(m.ns_steps),
            "Newton-Schulz iterations")(
            "muon-coefficient-type", po::value(&m.coefficients)->default_value(m.coefficients),
            "Newton-Schulz coefficients: quintic (five tuned steps, cycled) | simple (3.4445, "
            "-4.7750, 2.0315)")(
            "muon-fp32-matmul-prec", po::value(&m.matmul_prec)->default_value(m.matmul_prec),
            "Newton-Schulz GEMMs on CUDA: medium or low (bf16 inputs, f32 accumulation) | high "
            "(f32); the CPU computes in f32")(
            "muon-tp-mode", po::value(&m.tp_mode)->default_value(m.tp_mode),
            "a tensor-parallel matrix: duplicated (gathered whole on every TP rank) | distributed "
            "(the Gram matrices summed over TP) | blockwise (each shard alone: depends on TP)");
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes& notes) override {
    TrainConfig& t = o.train;
    const TrainConfig::Muon& m = t.muon;
    if (optimizer_ == "dist_muon") {  // Megatron: deprecated, muon + the distributed optimizer
      optimizer_ = "muon";
      t.use_distributed_optimizer = true;
      notes.input.push_back(
          "--optimizer dist_muon is deprecated (as in Megatron-LM): it runs --optimizer muon "
          "--use-distributed-optimizer; give those");
    }
    if (scalar_ != "adam")
      throw ConfigError("--muon-scalar-optimizer " + scalar_ +
                        " is not a choice (allowed: adam; Megatron's lion is not offered yet)");
    if (optimizer_ != "adam" && optimizer_ != "muon")
      throw ConfigError("--optimizer " + optimizer_ +
                        " is not a choice (allowed: adam, muon, dist_muon)");
    t.optimizer = optimizer_;
    t.muon.split_qkv = !no_split_qkv_;
    if (t.optimizer != "muon")
      for (const char* name :
           {"muon-momentum", "muon-nesterov", "muon-no-split-qkv", "muon-scalar-optimizer",
            "muon-scale-mode", "muon-extra-scale-factor", "muon-num-ns-steps",
            "muon-coefficient-type", "muon-fp32-matmul-prec", "muon-tp-mode"})
        if (p.given(name))
          throw ConfigError(std::string("--") + name +
                            " is a Muon option: it needs --optimizer muon (this run uses adam)");
    auto one_of = [](const char* name, const std::string& v, const char* allowed) {
      const std::string list = std::string(", ") + allowed + ",";
      if (list.find(", " + v + ",") == std::string::npos)
        throw ConfigError(std::string("--") + name + " " + v +
                          " is not a choice (allowed: " + allowed + ")");
    };
    one_of("muon-scale-mode", m.scale_mode, "spectral, unit_rms_norm, shape_scaling");
    one_of("muon-coefficient-type", m.coefficients, "quintic, simple");
    one_of("muon-fp32-matmul-prec", m.matmul_prec, "low, medium, high");
    one_of("muon-tp-mode", m.tp_mode, "blockwise, duplicated, distributed");
    if (m.ns_steps < 1)
      throw ConfigError("--muon-num-ns-steps=" + std::to_string(m.ns_steps) +
                        " is out of range (allowed: >= 1)");
    if (!(m.momentum >= 0 && m.momentum < 1))
      throw ConfigError("--muon-momentum=" + std::to_string(m.momentum) +
                        " is out of range (allowed: 0 <= beta < 1)");
    if (!(m.extra_scale > 0))
      throw ConfigError("--muon-extra-scale-factor=" + std::to_string(m.extra_scale) +
                        " is out of range (allowed: > 0)");
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    const TrainConfig& t = d.o.train;
    if (s != DryRunSection::Setup || t.optimizer != "muon") return;
    out << "optimizer: Muon (momentum " << t.muon.momentum << (t.muon.nesterov ? ", Nesterov" : "")
        << ", " << t.muon.ns_steps << " " << t.muon.coefficients << " Newton-Schulz steps, "
        << t.muon.scale_mode << " scale x " << t.muon.extra_scale << ", TP " << t.muon.tp_mode
        << (t.muon.split_qkv ? ", q/k/v apart" : ", q/k/v together")
        << (t.use_distributed_optimizer ? ", layer-wise over the distributed optimizer" : "")
        << ") for the matrices; AdamW for the word embedding, the output layer, norms and biases\n";
  }

 private:
  std::string scalar_;  // --muon-scalar-optimizer
  std::string optimizer_ = "adam";
  bool no_split_qkv_ = false;
};

}  // namespace

std::unique_ptr<OptionGroup> make_optimizer_options() {
  return std::make_unique<OptimizerOptions>();
}

}  // namespace tessera
