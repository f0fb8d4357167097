// config.hpp: options from an INI config file plus command-line overrides (Boost.ProgramOptions).
// The file holds the same keys as the command line without the dashes (`num-layers = 12`); the
// command line wins. Errors become one ConfigError line naming the option or the file.
#pragma once

#include <boost/program_options.hpp>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace tessera {

namespace po = boost::program_options;

class OptionParser {
 public:
  OptionParser(std::string program, std::string usage);
  // Add a group of options; --help and --config are added by the parser itself.
  po::options_description& group(const std::string& title);
  // Options that replace each other (e.g. train-iters and train-samples): one given on the command
  // line drops the others' config-file values, so a command line can switch a config's family.
  void alternatives(std::vector<std::string> names);
  // A string option whose empty value means something (every other given string option must not
  // be empty: `--save ""` is an error naming the option, never a silently disabled feature).
  void allow_empty(const std::string& name) { allow_empty_.insert(name); }
  // Returns false when --help was given (the help text has been printed to stdout).
  bool parse(int argc, const char* const* argv);
  const po::variables_map& vm() const { return vm_; }
  bool given(const std::string& name) const { return vm_.count(name) && !vm_[name].defaulted(); }
  // True when `name`'s value came from the --config file (not the command line, not a default).
  bool from_config_file(const std::string& name) const {
    return !config_path_.empty() && given(name) && !command_line_.count(name);
  }
  // `message` with a note naming the options it mentions (as --name) whose values came from the
  // config file, e.g. "... (--train-iters is set in config file 'configs/gpt2-tiny.ini')".
  std::string with_origins(const std::string& message) const;
  // One line per config-file value a command-line alternative replaced (for the start-up log).
  const std::vector<std::string>& replaced() const { return replaced_; }
  template <typename T>
  T get(const std::string& name) const {
    return vm_[name].as<T>();
  }
  std::string help() const;
  // Every option's effective value as INI text (`key = value` lines), for checkpoints.
  std::string to_ini() const;

 private:
  std::string program_, usage_;
  std::vector<std::unique_ptr<po::options_description>> groups_;
  po::variables_map vm_;
  std::string config_path_;
  std::set<std::string> command_line_;  // options given on the command line
  std::vector<std::vector<std::string>> alternatives_;
  std::set<std::string> allow_empty_;
  std::vector<std::string> replaced_;
};

}  // namespace tessera
