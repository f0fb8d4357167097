// model.cpp: the model's options (shape, architecture, dropout), their checks and the model's
// --dry-run lines (parameter count, architecture).
#include <algorithm>
#include <cstdio>
#include <ostream>

#include "core/config.hpp"
#include "core/error.hpp"
#include "model/config_schema.hpp"
#include "options/option_group.hpp"

namespace tessera {
namespace {

// The table's declarations as Boost.Program_options values: each option's default is its field's
// value (GPTConfig's defaults).
class ParserDeclarer : public OptionDeclarer {
 public:
  explicit ParserDeclarer(po::options_description& g) : g_(g) {}
  void integer(const std::string& n, int* t, const std::string& h) override {
    g_.add_options()(n.c_str(), po::value(t)->default_value(*t), h.c_str());
  }
  void integer(const std::string& n, int64_t* t, const std::string& h) override {
    g_.add_options()(n.c_str(), po::value(t)->default_value(*t), h.c_str());
  }
  void real(const std::string& n, double* t, const std::string& h) override {
    g_.add_options()(n.c_str(), po::value(t)->default_value(*t), h.c_str());
  }
  void text(const std::string& n, std::string* t, const std::string& h) override {
    g_.add_options()(n.c_str(), po::value(t)->default_value(*t), h.c_str());
  }
  void flag(const std::string& n, bool* t, bool when_given, const std::string& h) override {
    if (when_given && !*t) {
      g_.add_options()(n.c_str(), po::bool_switch(t), h.c_str());
      return;
    }
    g_.add_options()(n.c_str(), po::bool_switch()->notifier([t, when_given](bool given) {
      if (given) *t = when_given;
    }),
                     h.c_str());
  }

 private:
  po::options_description& g_;
};

class ModelOptions : public OptionGroup {
 public:
  void add(OptionParser& p, RunOptions& o) override {
    po::options_description& model = p.group("Model");
    declare_model_options(model, "Model", o.model);
    model.add_options()("norm-epsilon", po::value(&norm_epsilon_),
                        "epsilon of the norms (Megatron's name for --layernorm-epsilon)");
    declare_model_options(p.group("Multi-latent attention (DeepSeek)"),
                          "Multi-latent attention (DeepSeek)", o.model);
    p.alternatives({"layernorm-epsilon", "norm-epsilon"});
  }

  void resolve(const OptionParser& p, RunOptions& o, StartupNotes&) override {
    GPTConfig& m = o.model;
    // (--rope-type yarn without MLA has its own message, GPTConfig::validate.)
    refuse_unused_model_options(
        p, "Multi-latent attention (DeepSeek)", m.multi_latent_attention,
        "--multi-latent-attention",
        {"multi-latent-attention", "mtp-num-layers", "mtp-loss-scaling-factor", "rope-type"});
    if (p.given("num-query-groups") && !m.group_query_attention)
      throw ConfigError(detail::concat("--num-query-groups=", m.num_query_groups,
                                       " needs --group-query-attention (without it every head has "
                                       "keys and values of its own)"));
    if (p.given("norm-epsilon")) {
      if (p.given("layernorm-epsilon") && norm_epsilon_ != m.layernorm_epsilon)
        throw ConfigError(detail::concat("--norm-epsilon=", norm_epsilon_,
                                         " and --layernorm-epsilon=", m.layernorm_epsilon,
                                         " disagree; give one"));
      m.layernorm_epsilon = norm_epsilon_;
    }
  }

  void dry_run(DryRunSection s, const DryRunContext& d, std::ostream& out) const override {
    const GPTConfig& m = d.o.model;
    if (s == DryRunSection::Totals) {
      char buf[400];
      std::snprintf(buf, sizeof buf,
                    "parameters: %lld (model%s); padded vocabulary %lld (true "
                    "%lld, multiple of %d x TP)\n",
                    (long long)m.num_parameters(), m.tied_head() ? ", tied head counted once" : "",
                    (long long)m.padded_vocab_size(d.o.tp), (long long)m.vocab_size,
                    m.make_vocab_size_divisible_by);
      out << buf;
      if (m.mtp()) {  // Hugging Face's model class counts the rest (it does not load MTP layers)
        GPTConfig main = m;
        main.mtp_num_layers = 0;
        std::snprintf(buf, sizeof buf,
                      "multi-token prediction: %lld of them in %d layer%s (the embedding and "
                      "output layer shared); the model without them %lld\n",
                      (long long)(m.num_parameters() - main.num_parameters()), m.mtp_num_layers,
                      m.mtp_num_layers == 1 ? "" : "s", (long long)main.num_parameters());
        out << buf;
      }
    } else if (s == DryRunSection::Setup) {
      out << "architecture: " << m.describe() << "\n";
    }
  }

 private:
  double norm_epsilon_ = 0;
};

}  // namespace

void declare_model_options(po::options_description& g, const std::string& title, GPTConfig& m) {
  ParserDeclarer d(g);
  declare_model_options(title, d, m);
}

void refuse_unused_model_options(const OptionParser& p, const std::string& title, bool has,
                                 const std::string& feature,
                                 const std::vector<std::string>& except) {
  // With --use-checkpoint-args the model is the checkpoint's (it may have the feature).
  if (has || p.given("use-checkpoint-args")) return;
  for (const ModelField& f : model_fields())
    if (f.group == title && f.declare && p.given(f.option) &&
        std::find(except.begin(), except.end(), f.option) == except.end())
      throw ConfigError(p.with_origins("--" + f.option + " has no effect without " + feature +
                                       ": give that, or leave it out"));
}

std::unique_ptr<OptionGroup> make_model_options() {
  return std::make_unique<ModelOptions>();
}

}  // namespace tessera
