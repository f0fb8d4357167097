// kernels.cpp: which kernels run where a backend has a choice: Megatron's --attention-backend
// (backend/attention_backend.hpp) and --deterministic-mode; their checks and --dry-run line. The
// start-up line of tessera-train says which attention kernels the training shape gets and why
// (attention_call below, Backend::attention_plan).
#include <algorithm>
#include <ostream>

#include "backend/attention_backend.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

AttentionCall attention_call(const RunOptions& o) {
  const GPTConfig& m = o.model;
  AttentionCall c;
  c.dtype = o.train.compute_dtype;
  c.batch = o.train.micro_batch_size;
  c.seq = m.seq_length / std::max(1, o.cp);
  c.heads = m.num_attention_heads / std::max(1, o.tp);
  c.kv_heads = std::max(1, m.kv_heads() / std::max(1, o.tp));
  c.head_dim = m.head_dim();
  c.dropout = m.attention_dropout > 0;
  c.alibi = m.alibi();
  c.documents = o.train.documents.reset_attention_mask || o.train.documents.packed;
  return c;
}

namespace {

class KernelOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    p.group("Kernels").add_options()(
        "attention-backend", po::value(&backend_)->default_value("auto"),
        "attention kernels on --device cuda: auto (cuDNN's fused attention where it runs the "
        "shape: bf16/f16, no attention dropout or ALiBi; Tessera's flash kernels otherwise) | "
        "fused (cuDNN; an error where cuDNN refuses) | flash (Tessera's tensor-core kernels) | "
        "unfused | local (Tessera's generic kernels); the CPU has its reference only")(
        "deterministic-mode", po::bool_switch(&o.deterministic_mode),
        "the same bits on every run where a kernel has a choice: cuDNN's attention backward "
        "without atomics (Tessera's own kernels are deterministic anyway)");
  }

  void resolve(const OptionParser&, RunOptions& o, StartupNotes&) override {
    o.attention_backend = parse_attention_backend(backend_);
    if (o.device == "cpu" && (o.attention_backend == AttentionBackend::Fused ||
                              o.attention_backend == AttentionBackend::Flash))
      throw ConfigError("--attention-backend " + backend_ +
                        " needs --device cuda (the CPU backend's one attention is its reference: "
                        "give auto, unfused or local)");
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    if (s != DryRunSection::Setup) return;
    out << "attention: --attention-backend " << attention_backend_name(d.o.attention_backend)
        << (d.o.deterministic_mode ? ", --deterministic-mode" : "")
        << " (which kernels run is said at start-up, by the device)\n";
  }

 private:
  std::string backend_ = "auto";
};

}  // namespace

std::unique_ptr<OptionGroup> make_kernel_options() {
  return std::make_unique<KernelOptions>();
}

}  // namespace tessera
