// config.cpp: parsing the command line and the INI config file.
#include "core/config.hpp"

#include <cctype>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "core/error.hpp"

namespace tessera {

OptionParser::OptionParser(std::string program, std::string usage)
    : program_(std::move(program)), usage_(std::move(usage)) {
  auto& g = group("General");
  g.add_options()("help,h", "print this help and exit")(
      "config", po::value<std::string>(),
      "INI file with the same keys as the command line (`hidden-size = 768`); the command line "
      "overrides it");
}

po::options_description& OptionParser::group(const std::string& title) {
  groups_.push_back(std::make_unique<po::options_description>(title, 100, 50));
  return *groups_.back();
}

std::string OptionParser::help() const {
  std::ostringstream os;
  os << "Usage: " << program_ << " " << usage_ << "\n";
  for (const auto& g : groups_) os << "\n" << *g;
  return os.str();
}

std::string OptionParser::to_ini() const {
  std::ostringstream os;
  for (const auto& [key, value] : vm_) {
    if (key == "help" || key == "config") continue;
    const boost::any& v = value.value();
    os << key << " = ";
    if (auto p = boost::any_cast<int>(&v))
      os << *p;
    else if (auto p = boost::any_cast<int64_t>(&v))
      os << *p;
    else if (auto p = boost::any_cast<uint64_t>(&v))
      os << *p;
    else if (auto p = boost::any_cast<double>(&v))
      os << *p;
    else if (auto p = boost::any_cast<bool>(&v))
      os << (*p ? "true" : "false");
    else if (auto p = boost::any_cast<std::string>(&v))
      os << *p;
    else if (auto p = boost::any_cast<std::vector<std::string>>(&v)) {
      for (size_t i = 0; i < p->size(); ++i) os << (i ? " " : "") << (*p)[i];
    }
    os << "\n";
  }
  return os.str();
}

namespace {

// Boost.ProgramOptions fills its error messages by replacing placeholders such as %value% or
// %invalid_line% with the user's text until none is left: text that itself holds a placeholder
// makes that loop endless (found by tests/fuzz/fuzz_config.cpp, twice). Every replacement comes
// from the user's own text (option prefixes and section joins add no '%'), so refusing any
// "%word%" (a '%', letters or '_', a '%') before Boost sees the text rules the loop out; a lone
// '%', as in a path like run_%j, stays allowed.
void refuse_placeholders(const std::string& text, const std::string& where) {
  for (size_t i = text.find('%'); i != std::string::npos; i = text.find('%', i + 1)) {
    size_t j = i + 1;
    while (j < text.size() && (std::isalpha(static_cast<unsigned char>(text[j])) || text[j] == '_'))
      ++j;
    if (j > i + 1 && j < text.size() && text[j] == '%')
      throw ConfigError(where + " contains '" + text.substr(i, j + 1 - i) +
                        "', which the option parser cannot report on; remove it");
  }
}

}  // namespace

bool OptionParser::parse(int argc, const char* const* argv) {
  po::options_description all;
  for (const auto& g : groups_) all.add(*g);
  for (int i = 1; i < argc; ++i)
    refuse_placeholders(argv[i], "command-line argument " + std::to_string(i));
  try {
    po::parsed_options parsed = po::command_line_parser(argc, argv).options(all).run();
    // As argparse does (and Megatron-LM's launch scripts rely on: `... $EXTRA_ARGS` overriding an
    // option given earlier), a repeated option takes its last value; options that collect their
    // occurrences (--prompt, --data-path lists) keep them all.
    std::map<std::string, size_t> last;
    for (size_t i = 0; i < parsed.options.size(); ++i) last[parsed.options[i].string_key] = i;
    std::vector<po::option> kept;
    for (size_t i = 0; i < parsed.options.size(); ++i) {
      const po::option& o = parsed.options[i];
      const po::option_description* d = all.find_nothrow(o.string_key, false);
      if (!d || d->semantic()->is_composing() || last[o.string_key] == i) kept.push_back(o);
    }
    parsed.options = std::move(kept);
    po::store(parsed, vm_);
    if (vm_.count("help")) {
      std::cout << help();
      return false;
    }
    if (vm_.count("config")) {
      const std::string path = vm_["config"].as<std::string>();
      std::ifstream in(path);
      if (!in) throw ConfigError("--config '" + path + "' cannot be opened; check the path");
      {
        std::ostringstream text;
        text << in.rdbuf();
        refuse_placeholders(text.str(), "config file '" + path + "'");
        in.clear();
        in.seekg(0);
      }
      try {
        po::store(po::parse_config_file(in, all, /*allow_unregistered=*/false), vm_);
      } catch (const po::error& e) {
        throw ConfigError("config file '" + path + "': " + e.what() +
                          " (keys are the command-line option names without dashes; see --help)");
      }
    }
    po::notify(vm_);
  } catch (const po::error& e) {
    throw ConfigError(std::string(e.what()) + " (run " + program_ + " --help for the options)");
  }
  return true;
}

}  // namespace tessera
