// config.cpp: parsing the command line and the INI config file.
#include "core/config.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
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

void OptionParser::alternatives(std::vector<std::string> names) {
  alternatives_.push_back(std::move(names));
}

std::string OptionParser::with_origins(const std::string& message) const {
  std::vector<std::pair<size_t, std::string>> found;  // (where the message names it, --name)
  for (const auto& [key, value] : vm_) {
    if (!from_config_file(key)) continue;
    const std::string flag = "--" + key;
    for (size_t at = message.find(flag); at != std::string::npos; at = message.find(flag, at + 1)) {
      const size_t end = at + flag.size();
      const bool whole =
          end == message.size() || !(std::isalnum(static_cast<unsigned char>(message[end])) ||
                                     message[end] == '-' || message[end] == '_');
      if (whole) {
        found.emplace_back(at, flag);
        break;
      }
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> named;
  for (const auto& f : found) named.push_back(f.second);
  if (named.empty()) return message;
  std::string list;
  for (size_t i = 0; i < named.size(); ++i)
    list += (i == 0 ? "" : i + 1 == named.size() ? " and " : ", ") + named[i];
  // A switch the file turns on: the command line's spelling for off.
  std::string offs;
  for (const std::string& flag : named)
    for (const auto& g : groups_)
      if (const po::option_description* d = g->find_nothrow(flag.substr(2), false))
        if (d->semantic()->max_tokens() == 0)
          offs += (offs.empty() ? "" : ", ") + ("--no-" + flag.substr(2));
  return message + " (" + list + (named.size() == 1 ? " is" : " are") + " set in config file '" +
         config_path_ + "'" +
         (offs.empty() ? "" : "; " + offs + " on the command line turns it off") + ")";
}

namespace {

// The option a value belongs to, for messages: "--name".
std::string flag_of(const po::option& o) {
  return o.original_tokens.empty() || o.original_tokens[0].rfind("--", 0) != 0
             ? "--" + o.string_key
             : o.original_tokens[0].substr(0, o.original_tokens[0].find('='));
}

// What an option's value must be, for the error of a value that is not one (": it takes a whole
// number"), from its declared type; "" for other types.
std::string value_kind(const po::options_description& all, const std::string& option) {
  const std::string bare = option.substr(std::min(option.find_first_not_of('-'), option.size()));
  const po::option_description* d = all.find_nothrow(bare, false);
  if (!d) return "";
  const po::value_semantic* v = d->semantic().get();
  if (dynamic_cast<const po::typed_value<int>*>(v) ||
      dynamic_cast<const po::typed_value<int64_t>*>(v) ||
      dynamic_cast<const po::typed_value<long long>*>(v) ||
      dynamic_cast<const po::typed_value<uint64_t>*>(v))
    return ": it takes a whole number";
  if (dynamic_cast<const po::typed_value<double>*>(v) ||
      dynamic_cast<const po::typed_value<float>*>(v))
    return ": it takes a number";
  return "";
}

// The error of an unknown command-line option: a negative number read as one (a blend weight,
// or a value that needs --name=VALUE), an abbreviation of one option (named), or Boost's words.
ConfigError unknown_option_error(const std::string& name, const po::options_description& all,
                                 const std::string& program) {
  if (name.size() > 1 && name[0] == '-' &&
      (std::isdigit(static_cast<unsigned char>(name[1])) || name[1] == '.'))
    return ConfigError("'" + name +
                       "' is not an option: a negative number is read as one (blend weights of "
                       "--data-path and the like must be positive; give another negative value "
                       "as --option=" +
                       name + ")");
  const std::string bare = name.substr(std::min(name.find_first_not_of('-'), name.size()));
  std::string whole;
  int matches = 0;
  for (const auto& d : all.options())
    if (!bare.empty() && d->long_name().rfind(bare, 0) == 0) {
      whole = d->long_name();
      ++matches;
    }
  if (matches == 1)
    return ConfigError("unrecognised option '" + name +
                       "': options are not abbreviated (as in Megatron-LM); did you mean --" +
                       whole + "?");
  return ConfigError("unrecognised option '" + name + "' (run " + program +
                     " --help for the options)");
}

// Megatron's spellings of a switch's state beside the bare `--X` (on): `--no-X` (argparse's
// BooleanOptionalAction, as Megatron's ArgumentGroupFactory generates) and `--X=false` /
// `--X false` (also `=true`, and 1/0, yes/no, on/off), so a config file's switch can be turned
// off on the command line (the separate word only true or false: `--bf16 yes` stays an error);
// `--no-X` or `--disable-X` of a true/false option (--overlap-grad-reduce) is
// `--X=false`. Returns the arguments Boost parses: each switch's last spelling decides it (as a
// repeated option's last value does), on as `--X`, off in `off`.
std::vector<std::string> switch_spellings(int argc, const char* const* argv,
                                          const po::options_description& all,
                                          std::set<std::string>& off) {
  auto find = [&](const std::string& key) { return all.find_nothrow(key, false); };
  auto is_switch = [&](const std::string& key) {
    const po::option_description* d = find(key);
    return d && d->semantic()->max_tokens() == 0;
  };
  auto is_true_false = [&](const std::string& key) {
    const po::option_description* d = find(key);
    return d && dynamic_cast<const po::typed_value<bool>*>(d->semantic().get()) &&
           d->semantic()->max_tokens() == 1;
  };
  auto truth = [](std::string v, int& out) {
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
    if (v == "true" || v == "1" || v == "yes" || v == "on") return out = 1, true;
    if (v == "false" || v == "0" || v == "no" || v == "off") return out = 0, true;
    return false;
  };
  // Each argument as given, a switch's spelling as (key, on) at its place.
  struct Arg {
    std::string text, key;
    bool on = true;
  };
  std::vector<Arg> given;
  std::map<std::string, size_t> last;  // a switch's last spelling
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a == "--") {
      given.push_back({a, "", true});
      continue;
    }
    const size_t eq = a.find('=');
    const std::string key = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    // Megatron's ArgumentGroupFactory gives a true-by-default option --no-X and --disable-X.
    if (eq == std::string::npos && !find(key) && key.rfind("disable-", 0) == 0 &&
        is_true_false(key.substr(8))) {
      given.push_back({"--" + key.substr(8) + "=false", "", true});
      continue;
    }
    if (eq == std::string::npos && !find(key) && key.rfind("no-", 0) == 0) {
      const std::string base = key.substr(3);
      if (is_switch(base)) {
        last[base] = given.size();
        given.push_back({a, base, false});
        continue;
      }
      if (is_true_false(base)) {
        given.push_back({"--" + base + "=false", "", true});
        continue;
      }
    }
    if (!is_switch(key)) {
      given.push_back({a, "", true});
      continue;
    }
    int on = 1;
    if (eq != std::string::npos) {
      if (!truth(a.substr(eq + 1), on))
        throw ConfigError("--" + key + "=" + a.substr(eq + 1) +
                          ": a switch is given alone (on), as --no-" + key +
                          " (off), or with true or false");
    } else if (i + 1 < argc) {  // `--X false` / `--X true`: its value (other words stay stray)
      std::string next = argv[i + 1];
      std::transform(next.begin(), next.end(), next.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      if (next == "true" || next == "false") {
        on = next == "true";
        ++i;
      }
    }
    last[key] = given.size();
    given.push_back({a, key, on != 0});
  }
  std::vector<std::string> args{argc > 0 ? argv[0] : "program"};
  for (size_t i = 0; i < given.size(); ++i) {
    const Arg& g = given[i];
    if (g.key.empty()) {
      args.push_back(g.text);
    } else if (last[g.key] == i) {
      if (g.on)
        args.push_back("--" + g.key);
      else
        off.insert(g.key);
    }
  }
  return args;
}

}  // namespace

bool OptionParser::parse(int argc, const char* const* argv) {
  po::options_description all;
  for (const auto& g : groups_) all.add(*g);
  for (int i = 1; i < argc; ++i)
    refuse_placeholders(argv[i], "command-line argument " + std::to_string(i));
  std::set<std::string> off;
  const std::vector<std::string> spelled = switch_spellings(argc, argv, all, off);
  std::vector<const char*> args;
  for (const std::string& a : spelled) args.push_back(a.c_str());
  argc = static_cast<int>(args.size());
  argv = args.data();
  // A word that belongs to no option (`--bf16 yes`, an unquoted prompt) is caught here and named,
  // instead of Boost's "too many positional options".
  constexpr const char* kStray = "\x01stray";
  po::options_description with_stray;
  with_stray.add(all);
  with_stray.add_options()(kStray, po::value<std::vector<std::string>>());
  po::positional_options_description stray;
  stray.add(kStray, -1);
  try {
    po::parsed_options parsed =
        po::command_line_parser(argc, argv)
            .options(with_stray)
            .positional(stray)
            // No abbreviations (--train-iter for --train-iters), as Megatron's
            // allow_abbrev=False and as the config file's keys.
            .style(po::command_line_style::default_style & ~po::command_line_style::allow_guessing)
            .run();
    for (size_t i = 0; i < parsed.options.size(); ++i) {
      const po::option& o = parsed.options[i];
      if (o.string_key != kStray) continue;
      const std::string word = o.value.empty() ? std::string() : o.value[0];
      if (i == 0 || parsed.options[i - 1].string_key == kStray)
        throw ConfigError("unexpected argument '" + word +
                          "' (not an option's value; options are --name VALUE or --name=VALUE: "
                          "see " +
                          program_ + " --help)");
      const po::option& before = parsed.options[i - 1];
      const po::option_description* d = all.find_nothrow(before.string_key, false);
      const bool is_switch = d && d->semantic()->max_tokens() == 0;
      throw ConfigError("unexpected argument '" + word + "' after " + flag_of(before) +
                        (is_switch ? ", a switch: leave the value out (on), or give true or false"
                                   : ", which takes one value (quote a value that has spaces)"));
    }
    // As argparse does (and Megatron-LM's launch scripts rely on: `... $EXTRA_ARGS` overriding an
    // option given earlier), a repeated option takes its last value; options that collect their
    // occurrences (--prompt) keep them all.
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
    for (const auto& [key, value] : vm_)
      if (!value.defaulted()) command_line_.insert(key);
    // A switch turned off on the command line keeps its default (off): the config file's value
    // of it is dropped below.
    for (const std::string& key : off) command_line_.insert(key);
    if (vm_.count("help")) {
      std::cout << help();
      return false;
    }
    if (vm_.count("config")) {
      config_path_ = vm_["config"].as<std::string>();
      const std::string& path = config_path_;
      std::error_code ec;
      if (std::filesystem::is_directory(path, ec))
        throw ConfigError("--config '" + path +
                          "' is a directory; give an INI file (e.g. configs/gpt2-124m.ini)");
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
        po::parsed_options file = po::parse_config_file(in, all, /*allow_unregistered=*/false);
        // An option given on the command line replaces the config file's alternatives to it.
        auto replacing = [&](const std::string& key) -> std::string {
          for (const auto& family : alternatives_) {
            if (std::find(family.begin(), family.end(), key) == family.end()) continue;
            for (const std::string& other : family)
              if (other != key && command_line_.count(other)) return other;
          }
          return "";
        };
        std::vector<po::option> kept_file;
        for (po::option& o : file.options) {
          if (off.count(o.string_key)) {
            replaced_.push_back("--no-" + o.string_key + " on the command line replaces " +
                                o.string_key + " of config file '" + path + "'");
            continue;
          }
          const std::string by = replacing(o.string_key);
          if (by.empty()) {
            kept_file.push_back(std::move(o));
            continue;
          }
          std::string value;
          for (const std::string& v : o.value) value += (value.empty() ? "" : " ") + v;
          replaced_.push_back("--" + by + " on the command line replaces " + o.string_key + " = " +
                              value + " of config file '" + path + "'");
        }
        file.options = std::move(kept_file);
        po::store(file, vm_);
      } catch (const po::invalid_option_value& e) {
        throw ConfigError("config file '" + path + "': " + e.what() +
                          value_kind(all, e.get_option_name()));
      } catch (const po::error& e) {
        throw ConfigError("config file '" + path + "': " + e.what() +
                          " (keys are the command-line option names without dashes; see --help)");
      }
    }
    // An empty value is never taken as "off": `--save ""` (an unset shell variable) is an error.
    for (const auto& [key, value] : vm_) {
      if (value.defaulted() || allow_empty_.count(key)) continue;
      const boost::any& v = value.value();
      bool empty = false;
      if (auto p = boost::any_cast<std::string>(&v)) empty = p->empty();
      if (auto p = boost::any_cast<std::vector<std::string>>(&v))
        empty = std::any_of(p->begin(), p->end(), [](const std::string& x) {
          return x.find_first_not_of(" \t") == std::string::npos;
        });
      if (empty)
        throw ConfigError(
            "--" + key + " is empty" +
            (from_config_file(key) ? " in config file '" + config_path_ + "'" : std::string()) +
            "; give it a value or leave the option out");
    }
    po::notify(vm_);
  } catch (const po::invalid_option_value& e) {
    throw ConfigError(std::string(e.what()) + value_kind(all, e.get_option_name()) + " (run " +
                      program_ + " --help for the options)");
  } catch (const po::unknown_option& e) {
    throw unknown_option_error(e.get_option_name(), all, program_);
  } catch (const po::error& e) {
    throw ConfigError(std::string(e.what()) + " (run " + program_ + " --help for the options)");
  }
  return true;
}

}  // namespace tessera
