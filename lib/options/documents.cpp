// documents.cpp: documents inside a sample (run/sample_layout.hpp; docs/data.md, "Documents
// inside a sample") and which tokens' losses count: Megatron's --reset-position-ids,
// --reset-attention-mask, --eod-mask-loss and --calculate-per-token-loss, their checks and the
// --dry-run line.
#include <ostream>
#include <string>

#include "core/config.hpp"
#include "core/error.hpp"
#include "options/option_group.hpp"
#include "options/options.hpp"

namespace tessera {

namespace {

class DocumentOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    LtorOptions& d = o.train.documents;
    p.group("Documents inside a sample and the loss")
        .add_options()("reset-position-ids", po::bool_switch(&d.reset_position_ids),
                       "positions restart at 0 after every end-of-document token of a sample "
                       "(RoPE, ALiBi and learned position embeddings take them)")(
            "reset-attention-mask", po::bool_switch(&d.reset_attention_mask),
            "a token never attends to a token at or before an earlier end-of-document token of "
            "its sample")("eod-mask-loss", po::bool_switch(&d.eod_mask_loss),
                          "the positions whose input token is the end-of-document token carry "
                          "no loss")(
            "sft", po::bool_switch(&d.packed),
            "supervised fine-tuning: pack whole documents of the data (the shards' boundaries) "
            "first-fit into samples, pad the rest; positions and attention reset per document")(
            "sft-no-truncate", po::bool_switch(&d.no_truncate),
            "with --sft: refuse a document longer than --seq-length+1 tokens (default: cut it)")(
            "calculate-per-token-loss", po::bool_switch(&o.train.per_token_loss),
            "the loss is the global batch's summed token losses over its counted tokens (default: "
            "Megatron's mean per micro-batch, averaged over the micro-batches; the same unless "
            "loss masks or --eod-mask-loss leave tokens out)");
  }

  void resolve(const OptionParser&, RunOptions& o, StartupNotes&) override {
    LtorOptions& d = o.train.documents;
    if (d.no_truncate && !d.packed)
      throw ConfigError(
          "--sft-no-truncate needs --sft (it refuses documents longer than a sample)");
    if (d.packed) d.reset_position_ids = d.reset_attention_mask = true;  // per packed document
    if (o.train.documents.active() && o.mock_data)
      throw ConfigError(
          std::string(names(o.train.documents)) +
          " needs --data-path: mock data has no end-of-document tokens (give shards made by "
          "tessera-preprocess)");
  }

  // The backend and the context-parallel size are final here.
  void resolve_late(const OptionParser&, RunOptions& o, StartupNotes&) override {
    const std::string problem = documents_problem(o.train.documents, o.device, o.model.alibi());
    if (!problem.empty()) throw ConfigError(problem);
  }

  void dry_run(DryRunSection s, const DryRunContext& dc, std::ostream& out) const override {
    if (s != DryRunSection::Setup) return;
    if (dc.o.train.documents.active())
      out << "documents inside a sample: " << names(dc.o.train.documents)
          << (dc.o.train.documents.packed
                  ? " (whole documents packed into samples, reset at the shards' boundaries)\n"
                  : " (at each end-of-document token of the data)\n");
    out << "loss: "
        << (dc.o.train.per_token_loss
                ? "per token over the global batch (--calculate-per-token-loss)"
                : "mean per micro-batch over its counted tokens, averaged over the micro-batches")
        << "\n";
  }

 private:
  static std::string names(const LtorOptions& d) {
    std::string s;
    auto add = [&](bool on, const char* n) {
      if (!on) return;
      if (!s.empty()) s += ", ";
      s += n;
    };
    add(d.packed, "--sft");
    add(d.reset_position_ids && !d.packed, "--reset-position-ids");
    add(d.reset_attention_mask && !d.packed, "--reset-attention-mask");
    add(d.eod_mask_loss, "--eod-mask-loss");
    return s;
  }
};

}  // namespace

std::unique_ptr<OptionGroup> make_document_options() {
  return std::make_unique<DocumentOptions>();
}

}  // namespace tessera
