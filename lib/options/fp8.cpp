// fp8.cpp: Megatron's FP8 options (model/fp8_config.hpp; docs/training.md, "FP8"): --fp8-format,
// --fp8-recipe, delayed scaling's --fp8-margin / --fp8-amax-history-len /
// --fp8-amax-compute-algo, and --first-last-layers-bf16 with its layer counts; their checks and
// the --dry-run line.
#include <algorithm>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

namespace {

// The CUDA backend's FP8 scratch (backend/cuda/fp8.cu): the largest GEMM's quantized operands in
// the backward (the output gradient twice, the transposed weight and input), bytes.
double fp8_scratch_bytes(const RunOptions& o) {
  const GPTConfig& m = o.model;
  const double tp = std::max(1, o.tp);
  const double N = double(o.train.micro_batch_size) * m.seq_length / std::max(1, o.cp);
  const double C = m.hidden_size;
  const double qkv = double(m.num_attention_heads + 2 * m.kv_heads()) * m.head_dim() / tp;
  const double att = double(m.num_attention_heads) * m.head_dim() / tp;
  const double f1 = double(m.ffn()) * (m.swiglu ? 2 : 1) / tp, f = double(m.ffn()) / tp;
  std::vector<std::pair<double, double>> gemms = {
      {C, qkv}, {att, C}, {C, f1}, {f, C}};  // (IC, OC); an expert's block has at most N rows
  if (m.moe()) {
    const double glu = m.swiglu ? 2 : 1, ef = double(m.moe_ffn()) / tp;
    const double sf = double(m.moe_shared_expert_intermediate_size) / tp;
    gemms.insert(gemms.end(), {{C, glu * ef}, {ef, C}, {C, glu * sf}, {sf, C}});
  }
  double most = 0;
  for (const auto& [IC, OC] : gemms) most = std::max(most, 2 * N * OC + IC * OC + IC * N + 1024);
  return most;
}

class Fp8Options : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    Fp8Config& f = o.train.fp8;
    p.group("FP8").add_options()(
        "fp8-format", po::value(&format_),
        "run the transformer layers' GEMMs in FP8: e4m3 (every operand E4M3) | hybrid (E4M3 "
        "inputs and weights, E5M2 output gradients); on --device cpu an exact emulation")(
        "fp8-recipe", po::value(&recipe_)->default_value("delayed"),
        "FP8 scaling: delayed (scales from the amax history of earlier steps) | tensorwise (each "
        "tensor's own amax, now)")("fp8-margin", po::value(&f.margin)->default_value(0),
                                   "delayed scaling: scales divided by 2^margin")(
        "fp8-amax-history-len", po::value(&f.amax_history_len)->default_value(1),
        "delayed scaling: steps of amax history kept per tensor")(
        "fp8-amax-compute-algo", po::value(&algo_)->default_value("most_recent"),
        "delayed scaling: the amax a scale comes from: most_recent | max (of the history)")(
        "first-last-layers-bf16", po::bool_switch(&f.first_last_bf16),
        "keep the first and last transformer layers' GEMMs in the model's precision")(
        "num-layers-at-start-in-bf16", po::value(&f.layers_at_start_bf16)->default_value(1),
        "with --first-last-layers-bf16: layers kept at the start")(
        "num-layers-at-end-in-bf16", po::value(&f.layers_at_end_bf16)->default_value(1),
        "with --first-last-layers-bf16: layers kept at the end");
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes&) override {
    Fp8Config& f = o.train.fp8;
    const bool fp8_option_given =
        p.given("fp8-recipe") || p.given("fp8-margin") || p.given("fp8-amax-history-len") ||
        p.given("fp8-amax-compute-algo") || p.given("first-last-layers-bf16");
    if (format_.empty()) {
      if (fp8_option_given)
        throw ConfigError(
            "an --fp8-* option (or --first-last-layers-bf16) without --fp8-format: give "
            "--fp8-format e4m3|hybrid to train in FP8, or leave the FP8 options out");
      return;
    }
    if (format_ != "e4m3" && format_ != "hybrid")
      throw ConfigError("--fp8-format " + format_ + " is not a choice (allowed: e4m3, hybrid)");
    if (o.model.mtp())
      throw ConfigError(
          "--fp8-format with --mtp-num-layers: multi-token prediction's layers run "
          "in bf16 for now; leave out --fp8-format");
    if (o.model.mla())
      throw ConfigError(
          "--fp8-format with --multi-latent-attention: MLA's projections run in "
          "bf16 for now; leave out --fp8-format");
    f.enabled = true;
    f.hybrid = format_ == "hybrid";
    if (recipe_ == "mxfp8" || recipe_ == "blockwise")
      throw ConfigError("--fp8-recipe " + recipe_ +
                        ": not yet (Blackwell's block scaling); give delayed or tensorwise");
    if (recipe_ != "delayed" && recipe_ != "tensorwise")
      throw ConfigError("--fp8-recipe " + recipe_ +
                        " is not a choice (allowed: delayed, tensorwise)");
    f.recipe = recipe_ == "delayed" ? Fp8Recipe::Delayed : Fp8Recipe::Tensorwise;
    if (algo_ != "most_recent" && algo_ != "max")
      throw ConfigError("--fp8-amax-compute-algo " + algo_ +
                        " is not a choice (allowed: most_recent, max)");
    f.amax_most_recent = algo_ == "most_recent";
    if (f.recipe == Fp8Recipe::Tensorwise) {
      for (const char* d : {"fp8-margin", "fp8-amax-history-len", "fp8-amax-compute-algo"})
        if (p.given(d))
          throw ConfigError(std::string("--") + d +
                            " is delayed scaling's; --fp8-recipe tensorwise scales each tensor by "
                            "its own amax: leave it out");
    }
    if (f.margin < 0)
      throw ConfigError("--fp8-margin " + std::to_string(f.margin) + ": must be >= 0");
    if (f.amax_history_len < 1)
      throw ConfigError("--fp8-amax-history-len " + std::to_string(f.amax_history_len) +
                        ": must be >= 1");
    if (f.layers_at_start_bf16 < 0 || f.layers_at_end_bf16 < 0)
      throw ConfigError(
          "--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16: must be >= 0");
    if (!f.first_last_bf16 &&
        (p.given("num-layers-at-start-in-bf16") || p.given("num-layers-at-end-in-bf16")))
      throw ConfigError(
          "--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 need "
          "--first-last-layers-bf16");
    if (o.device == "cuda" && o.train.compute_dtype != DType::BF16)
      throw ConfigError(
          "--fp8-format on --device cuda needs --bf16 (the rest of the model in bf16, as "
          "Megatron's FP8)");
  }

  // The model's dimensions are final here (--use-checkpoint-args).
  void resolve_late(const OptionParser&, RunOptions& o, StartupNotes& notes) override {
    const Fp8Config& f = o.train.fp8;
    if (!f.enabled) return;
    const GPTConfig& m = o.model;
    if (f.first_last_bf16 && f.layers_at_start_bf16 + f.layers_at_end_bf16 >= m.num_layers)
      throw ConfigError("--num-layers-at-start-in-bf16 " + std::to_string(f.layers_at_start_bf16) +
                        " + --num-layers-at-end-in-bf16 " + std::to_string(f.layers_at_end_bf16) +
                        " leave none of the " + std::to_string(m.num_layers) +
                        " layers in FP8; lower them or leave out --fp8-format");
    // FP8 GEMMs take dimensions that are multiples of 16 (cuBLASLt's, and Transformer Engine's
    // rule): each rank's GEMM widths, and the tokens of a micro-batch on a rank.
    const int tp = std::max(1, o.tp);
    const int64_t qkv = int64_t(m.num_attention_heads + 2 * m.kv_heads()) * m.head_dim();
    const struct {
      const char* what;
      int64_t value;
    } dims[] = {{"--hidden-size", m.hidden_size},
                {"the QKV width / TP", qkv / tp},
                {"the attention width / TP", int64_t(m.num_attention_heads) * m.head_dim() / tp},
                {"--ffn-hidden-size / TP", int64_t(m.ffn()) / tp},
                {"--micro-batch-size x --seq-length / CP",
                 int64_t(o.train.micro_batch_size) * m.seq_length / std::max(1, o.cp)}};
    std::vector<std::pair<std::string, int64_t>> widths;
    for (const auto& d : dims) widths.emplace_back(d.what, d.value);
    if (m.moe()) {  // the experts' rows per GEMM are any number (padded where cuBLASLt needs it)
      widths.emplace_back("--moe-ffn-hidden-size / TP", int64_t(m.moe_ffn()) / tp);
      if (m.moe_shared_expert_intermediate_size > 0)
        widths.emplace_back("--moe-shared-expert-intermediate-size / TP",
                            int64_t(m.moe_shared_expert_intermediate_size) / tp);
    }
    for (const auto& d : widths)
      if (d.second % 16 != 0)
        throw ConfigError("--fp8-format: " + d.first + " is " + std::to_string(d.second) +
                          ", but FP8 GEMMs need multiples of 16; change the model or leave out "
                          "--fp8-format");
    notes.run.push_back("fp8: " + f.describe(m.num_layers));
    if (m.moe() && m.moe_grouped_gemm)
      notes.run.push_back(
          "fp8: the experts' GEMMs of FP8 layers run one block (sender, expert) at a time, each "
          "with its own scales; --moe-grouped-gemm serves the layers in the model's precision");
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    if (!d.o.train.fp8.enabled) return;
    if (s == DryRunSection::Setup)
      out << "fp8: " << d.o.train.fp8.describe(d.o.model.num_layers) << "\n";
    if (s == DryRunSection::StageDetail && d.estimate)
      out << "  fp8: scaling state " << d.estimate->fp8_state_bytes / 1024.0 << " KiB ("
          << fp8_state_columns(d.o.model.num_experts)
          << " tensors per layer); no FP8 copies are kept between the passes: each GEMM "
             "quantizes its operands into scratch (on --device cuda "
          << fp8_scratch_bytes(d.o) / 1048576.0 << " MiB, the largest GEMM's)\n";
  }

 private:
  std::string format_, recipe_ = "delayed", algo_ = "most_recent";
};

}  // namespace

std::unique_ptr<OptionGroup> make_fp8_options() {
  return std::make_unique<Fp8Options>();
}

}  // namespace tessera
