// config.hpp: options from an INI config file plus command-line overrides (Boost.ProgramOptions).
// The file holds the same keys as the command line without the dashes (`num-layers = 12`); the
// command line wins. Errors become one ConfigError line naming the option or the file.
#pragma once

#include <boost/program_options.hpp>
#include <memory>
#include <string>
#include <vector>

namespace tessera {

namespace po = boost::program_options;

class OptionParser {
 public:
  OptionParser(std::string program, std::string usage);
  // Add a group of options; --help and --config are added by the parser itself.
  po::options_description& group(const std::string& title);
  // Returns false when --help was given (the help text has been printed to stdout).
  bool parse(int argc, const char* const* argv);
  const po::variables_map& vm() const { return vm_; }
  bool given(const std::string& name) const { return vm_.count(name) && !vm_[name].defaulted(); }
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
};

}  // namespace tessera
