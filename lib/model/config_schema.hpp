// config_schema.hpp: the model's options as one table (issue 55): for each, its option name, its
// --help group and text, the GPTConfig field it sets, the checkpoint attribute that records it,
// the range a checkpoint's value must lie in, how a checkpoint that differs from the run is
// described, and its words in the --dry-run architecture line. tessera-train declares the options
// from it (lib/options/model.cpp, moe.cpp), checkpoints write and read their model
// attributes from it (lib/checkpoint/checkpoint.cpp) and compare a run against a checkpoint with
// it, and GPTConfig::describe() is its words in order; a new model option is one line in
// model_fields() (config_schema.cpp).
//
// The attributes are those of every earlier checkpoint: checkpoints written before the table
// load as before. Groups of attributes are written only where the model has the feature (the
// multi-latent attention dimensions, the MoE router's settings), and a checkpoint without them
// holds a model without it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/gpt_config.hpp"

namespace tessera {

// The checkpoint's root attributes as the schema writes and reads them (integers and text).
class AttributeSink {
 public:
  virtual ~AttributeSink() = default;
  virtual void put(const std::string& name, int64_t value) = 0;
  virtual void put(const std::string& name, const std::string& value) = 0;
};
class AttributeSource {
 public:
  virtual ~AttributeSource() = default;
  // false when the attribute is absent (or not of that type).
  virtual bool get(const std::string& name, int64_t& value) = 0;
  virtual bool get(const std::string& name, std::string& value) = 0;
};

// Where the table's options are declared (tessera-train's parser): each sets its field of the
// GPTConfig given; the field's value then is the option's default.
class OptionDeclarer {
 public:
  virtual ~OptionDeclarer() = default;
  virtual void integer(const std::string& name, int* target, const std::string& help) = 0;
  virtual void integer(const std::string& name, int64_t* target, const std::string& help) = 0;
  virtual void real(const std::string& name, double* target, const std::string& help) = 0;
  virtual void text(const std::string& name, std::string* target, const std::string& help) = 0;
  // A switch: given, `target` becomes `when_given` (false for --disable-bias-linear), else
  // stays as it is.
  virtual void flag(const std::string& name, bool* target, bool when_given,
                    const std::string& help) = 0;
};

struct ModelField {
  std::string option;  // tessera-train's option without the dashes ("" : none of its own)
  // --help's group ("Model", "Multi-latent attention (DeepSeek)", "Mixture of Experts"; "": the
  // option is declared by hand, or there is none) and the declaration of its field.
  std::string group;
  std::function<void(OptionDeclarer&, GPTConfig&)> declare;
  // Its words in the architecture line ("" or null: none), e.g. ", RMSNorm".
  std::function<std::string(const GPTConfig&)> says;
  // The checkpoint attributes it writes (none: implied by another field's, such as
  // --group-query-attention by num_query_groups).
  std::vector<std::string> attributes;
  // Written when the model has it (null: always); read when present (a required field's absence
  // is an error).
  std::function<bool(const GPTConfig&)> recorded;
  std::function<void(const GPTConfig&, AttributeSink&)> write;
  // Reads the field from `in` into `m` (the fields before it already read); `file` names the
  // checkpoint file in errors. ConfigError on a value outside its range.
  std::function<void(AttributeSource& in, GPTConfig& m, const std::string& file)> read;
  // Compared when the checkpoint's model `m` has the field (null: always); mismatch returns how
  // the checkpoint at `path` differs from the run's model `c` ("" : it does not).
  std::function<bool(const GPTConfig&)> compared;
  std::function<std::string(const GPTConfig& m, const GPTConfig& c, const std::string& path)>
      mismatch;
};

// Every model field, in the order they are written, read and compared.
const std::vector<ModelField>& model_fields();

// The table applied: the model's attributes into `out`; a model from `in` (defaults where an
// optional attribute is absent); the first way the checkpoint's model `m` (at `path`) differs
// from the run's `c`, as a ConfigError.
void write_model_attributes(const GPTConfig& cfg, AttributeSink& out);
void read_model_attributes(AttributeSource& in, GPTConfig& m, const std::string& file);
void check_same_model(const GPTConfig& m, const GPTConfig& c, const std::string& path);
// Declares the options of --help group `group`, in the table's order, with `m`'s fields as
// their targets.
void declare_model_options(const std::string& group, OptionDeclarer& d, GPTConfig& m);
// The architecture line (GPTConfig::describe): the rows' words in the table's order.
std::string describe_model(const GPTConfig& c);
// The attribute names of the table (tessera-checkpoint verify compares them between files).
std::vector<std::string> model_attribute_names();

}  // namespace tessera
