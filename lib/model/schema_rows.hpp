// schema_rows.hpp: the row builders of the model's option table (model/config_schema.cpp only):
// an integer, a flag, a real or a text option, each recorded as an earlier checkpoint records it.
#pragma once

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "model/config_schema.hpp"

namespace tessera::schema {

using When = std::function<bool(const GPTConfig&)>;
using IntOf = std::function<int64_t(const GPTConfig&)>;

inline std::string real_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

const char* const kReload = "; load it with the model options it was trained with";

template <class T>
std::string differ(const std::string& path, const std::string& opt, const T& have, const T& want) {
  if (have == want) return "";
  return detail::concat("checkpoint '", path, "' has --", opt, "=", have, " but this run has ",
                        want, kReload);
}

inline std::string out_of_range(const std::string& file, const std::string& name, int64_t v,
                                int64_t lo, int64_t hi) {
  return detail::concat("checkpoint file '", file, "' has ", name, " ", v, ", outside ", lo, "..",
                        hi, " (damaged?)");
}

inline std::string lacks(const std::string& file, const std::string& name) {
  return "checkpoint file '" + file + "' lacks attribute '" + name +
         "'; it was not written by tessera (or is corrupt)";
}

inline bool always(const GPTConfig&) {
  return true;
}

// When a row applies.
inline bool rope(const GPTConfig& c) {
  return c.rope();
}
inline bool yarn(const GPTConfig& c) {
  return c.rope() && c.yarn();
}
inline bool rope_scaling(const GPTConfig& c) {
  return c.rope() && c.use_rope_scaling;
}
inline bool mla(const GPTConfig& c) {
  return c.mla();
}
inline bool moe(const GPTConfig& c) {
  return c.moe();
}
inline bool moe_groups(const GPTConfig& c) {
  return c.moe() && c.moe_router_num_groups > 0;
}
inline int64_t experts(const GPTConfig& c) {
  return c.num_experts;
}

// --help's groups of the model's options.
const char* const kModel = "Model";
const char* const kMla = "Multi-latent attention (DeepSeek)";
const char* const kMoe = "Mixture of Experts";

using Says = std::function<std::string(const GPTConfig&)>;
using Declare =
    std::function<void(OptionDeclarer&, GPTConfig&, const std::string&, const std::string&)>;

// What every row builder has: the option's --help group and text, its words in the architecture
// line, and how its field is declared (set by the builder).
template <class D>
struct Row {
  std::string group_, help_;
  Says says_;
  Declare declare_;

  D& help(std::string group, std::string text) {
    group_ = std::move(group);
    help_ = std::move(text);
    return static_cast<D&>(*this);
  }
  D& says(Says s) {
    says_ = std::move(s);
    return static_cast<D&>(*this);
  }
  void documented(ModelField& f) const {
    f.group = group_;
    f.says = says_;
    if (group_.empty()) return;
    const Declare d = declare_;
    const std::string o = f.option, h = help_;
    f.declare = [d, o, h](OptionDeclarer& out, GPTConfig& c) { d(out, c, o, h); };
  }
};

// An integer option recorded as an integer attribute.
struct Int : Row<Int> {
  std::string opt, attr;
  IntOf get;  // the value written and compared
  std::function<void(GPTConfig&, int64_t)> set;
  int64_t lo = 0;
  IntOf hi = [](const GPTConfig&) { return int64_t(1) << 30; };
  bool required_ = false;  // absent: an error (else: the default)
  bool key_ = false;       // its presence says the model has the feature (read whatever when_)
  When when_ = always;     // recorded (and read, and compared) when the model has it
  IntOf compare_;          // compared as this (default: get)
  bool compared_ = true;

  template <class T>
  Int(std::string o, std::string a, T GPTConfig::*f) : opt(std::move(o)), attr(std::move(a)) {
    get = [f](const GPTConfig& c) { return static_cast<int64_t>(c.*f); };
    set = [f](GPTConfig& c, int64_t v) { c.*f = static_cast<T>(v); };
    declare_ = [f](OptionDeclarer& d, GPTConfig& c, const std::string& o, const std::string& h) {
      d.integer(o, &(c.*f), h);
    };
  }
  Int& range(int64_t l, int64_t h) {
    lo = l;
    hi = [h](const GPTConfig&) { return h; };
    return *this;
  }
  Int& range(int64_t l, IntOf h) {
    lo = l;
    hi = std::move(h);
    return *this;
  }
  Int& required() {
    required_ = true;
    return *this;
  }
  Int& when(When w) {
    when_ = std::move(w);
    return *this;
  }
  Int& key() {
    key_ = true;
    return *this;
  }
  Int& written_as(IntOf g) {
    get = std::move(g);
    return *this;
  }
  Int& compared_as(IntOf g) {
    compare_ = std::move(g);
    return *this;
  }
  Int& not_compared() {
    compared_ = false;
    return *this;
  }
  operator ModelField() const {  // NOLINT: a row of the table
    ModelField f;
    f.option = opt;
    documented(f);
    f.attributes = {attr};
    f.recorded = when_;
    const std::string a = attr;
    const IntOf g = get;
    f.write = [a, g](const GPTConfig& c, AttributeSink& out) { out.put(a, g(c)); };
    const int64_t l = lo;
    const IntOf h = hi;
    const bool req = required_, key = key_;
    const When w = when_;
    const auto s = set;
    f.read = [a, l, h, req, key, w, s](AttributeSource& in, GPTConfig& m, const std::string& file) {
      if (!key && !w(m)) return;  // the checkpoint's model has no such feature
      int64_t x = 0;
      if (!in.get(a, x)) {
        if (req) throw ConfigError(lacks(file, a));
        return;
      }
      if (x < l || x > h(m)) throw ConfigError(out_of_range(file, a, x, l, h(m)));
      s(m, x);
    };
    if (compared_) {
      f.compared = when_;
      const IntOf cmp = compare_ ? compare_ : get;
      const std::string o = opt;
      f.mismatch = [o, cmp](const GPTConfig& m, const GPTConfig& c, const std::string& path) {
        return differ(path, o, cmp(m), cmp(c));
      };
    }
    return f;
  }
};

// An option that is on or off, recorded as 0 or 1; its mismatch says what a checkpoint with and
// without it holds.
struct Flag : Row<Flag> {
  std::string opt, attr, with, without;
  bool GPTConfig::*member;
  When when_ = always;
  bool when_given_ = true;                         // the field's value when the switch is given
  std::function<bool(const GPTConfig&)> compare_;  // compared as this (default: the member)

  Flag(std::string o, std::string a, bool GPTConfig::*f, std::string w, std::string wo)
      : opt(std::move(o)),
        attr(std::move(a)),
        with(std::move(w)),
        without(std::move(wo)),
        member(f) {
    declare_ = [f](OptionDeclarer& d, GPTConfig& c, const std::string& o, const std::string& h) {
      d.flag(o, &(c.*f), true, h);
    };
  }
  // A --disable- switch: given, the field is false.
  Flag& negated() {
    bool GPTConfig::*f = member;
    declare_ = [f](OptionDeclarer& d, GPTConfig& c, const std::string& o, const std::string& h) {
      d.flag(o, &(c.*f), false, h);
    };
    return *this;
  }
  Flag& when(When w) {
    when_ = std::move(w);
    return *this;
  }
  Flag& compared_as(std::function<bool(const GPTConfig&)> g) {
    compare_ = std::move(g);
    return *this;
  }
  operator ModelField() const {  // NOLINT: a row of the table
    ModelField f;
    f.option = opt;
    documented(f);
    bool GPTConfig::*mb = member;
    if (!attr.empty()) {
      f.attributes = {attr};
      const std::string a = attr;
      f.recorded = when_;
      f.write = [a, mb](const GPTConfig& c, AttributeSink& out) { out.put(a, int64_t(c.*mb)); };
      f.read = [a, mb](AttributeSource& in, GPTConfig& m, const std::string&) {
        int64_t x = 0;
        if (in.get(a, x)) m.*mb = x != 0;
      };
    }
    f.compared = when_;
    const auto cmp = compare_ ? compare_ : [mb](const GPTConfig& c) { return c.*mb; };
    const std::string o = opt, w = with, wo = without;
    f.mismatch = [o, w, wo, cmp](const GPTConfig& m, const GPTConfig& c, const std::string& path) {
      const bool have = cmp(m), want = cmp(c);
      if (have == want) return std::string();
      return detail::concat("checkpoint '", path, "' was trained ", have ? "with " : "without ",
                            "--", o, " (", have ? w : wo, ") but this run ",
                            want ? "gives it" : "does not", kReload);
    };
    return f;
  }
};

// A real option, recorded exactly as text (%.17g).
struct Real : Row<Real> {
  std::string opt, attr;
  double GPTConfig::*member;
  When when_ = always, compared_when_;

  Real(std::string o, std::string a, double GPTConfig::*f)
      : opt(std::move(o)), attr(std::move(a)), member(f) {
    declare_ = [f](OptionDeclarer& d, GPTConfig& c, const std::string& o, const std::string& h) {
      d.real(o, &(c.*f), h);
    };
  }
  Real& when(When w) {
    when_ = std::move(w);
    return *this;
  }
  Real& compared_when(When w) {
    compared_when_ = std::move(w);
    return *this;
  }
  operator ModelField() const {  // NOLINT: a row of the table
    ModelField f;
    f.option = opt;
    documented(f);
    double GPTConfig::*mb = member;
    if (!attr.empty()) {
      f.attributes = {attr};
      const std::string a = attr;
      f.recorded = when_;
      f.write = [a, mb](const GPTConfig& c, AttributeSink& out) { out.put(a, real_text(c.*mb)); };
      f.read = [a, mb](AttributeSource& in, GPTConfig& m, const std::string&) {
        std::string t;
        if (in.get(a, t)) m.*mb = std::strtod(t.c_str(), nullptr);
      };
    }
    f.compared = compared_when_ ? compared_when_ : when_;
    const std::string o = opt;
    f.mismatch = [o, mb](const GPTConfig& m, const GPTConfig& c, const std::string& path) {
      return differ(path, o, m.*mb, c.*mb);
    };
    return f;
  }
};

// A text option, recorded as text.
struct Text : Row<Text> {
  std::string opt, attr;
  std::string GPTConfig::*member;
  When when_ = always, compared_when_;

  Text(std::string o, std::string a, std::string GPTConfig::*f)
      : opt(std::move(o)), attr(std::move(a)), member(f) {
    declare_ = [f](OptionDeclarer& d, GPTConfig& c, const std::string& o, const std::string& h) {
      d.text(o, &(c.*f), h);
    };
  }
  Text& when(When w) {
    when_ = std::move(w);
    return *this;
  }
  Text& compared_when(When w) {
    compared_when_ = std::move(w);
    return *this;
  }
  operator ModelField() const {  // NOLINT: a row of the table
    ModelField f;
    f.option = opt;
    documented(f);
    f.attributes = {attr};
    std::string GPTConfig::*mb = member;
    const std::string a = attr;
    f.recorded = when_;
    f.write = [a, mb](const GPTConfig& c, AttributeSink& out) { out.put(a, c.*mb); };
    f.read = [a, mb](AttributeSource& in, GPTConfig& m, const std::string&) {
      std::string t;
      if (in.get(a, t)) m.*mb = t;
    };
    f.compared = compared_when_ ? compared_when_ : when_;
    const std::string o = opt;
    f.mismatch = [o, mb](const GPTConfig& m, const GPTConfig& c, const std::string& path) {
      return differ(path, o, m.*mb, c.*mb);
    };
    return f;
  }
};

// Several reals in one text attribute (earlier checkpoints' rope_scaling and yarn), written when
// `when` holds; the fields are compared one by one by their own rows.
inline ModelField packed(const std::string& attr, When when, std::vector<double GPTConfig::*> reals,
                         int GPTConfig::*last_int, std::function<void(GPTConfig&)> on_read) {
  ModelField f;
  f.attributes = {attr};
  f.recorded = when;
  f.write = [attr, reals, last_int](const GPTConfig& c, AttributeSink& out) {
    std::string t;
    for (double GPTConfig::*r : reals) t += (t.empty() ? "" : " ") + real_text(c.*r);
    if (last_int) t += " " + std::to_string(c.*last_int);
    out.put(attr, t);
  };
  f.read = [attr, reals, last_int, on_read](AttributeSource& in, GPTConfig& m,
                                            const std::string& file) {
    std::string t;
    if (!in.get(attr, t)) return;
    std::istringstream s(t);
    for (double GPTConfig::*r : reals) s >> m.*r;
    if (last_int) s >> m.*last_int;
    if (!s)
      throw ConfigError("checkpoint file '" + file + "' has a malformed " + attr + " attribute '" +
                        t + "'");
    on_read(m);
  };
  return f;
}

// A field compared only (its value recorded by another row).
inline ModelField compared_only(Real r) {
  r.attr.clear();
  return r;
}

// An option of the model that checkpoints do not record (dropout, the loss coefficients): declared
// and described only.
inline ModelField option_only(ModelField f) {
  f.attributes.clear();
  f.recorded = nullptr;
  f.write = nullptr;
  f.read = nullptr;
  f.compared = nullptr;
  f.mismatch = nullptr;
  return f;
}

// A row recorded by another one (its attributes there): declared, compared and described only.
inline ModelField recorded_elsewhere(ModelField f) {
  f.attributes.clear();
  f.write = nullptr;
  f.read = nullptr;
  return f;
}

// The rows of multi-token prediction, multi-latent attention and YaRN, and of the Mixture of
// Experts (model/schema_mla_moe.cpp).
void deepseek_fields(std::vector<ModelField>& t);
void moe_fields(std::vector<ModelField>& t);

}  // namespace tessera::schema
