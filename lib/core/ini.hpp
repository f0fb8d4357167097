// ini.hpp: the `key = value` lines of INI text as Config::to_ini writes it (the options a run saved
// with its checkpoints), as a map; other lines (sections, comments) are skipped.
#pragma once

#include <map>
#include <sstream>
#include <string>

namespace tessera {

inline std::map<std::string, std::string> ini_values(const std::string& ini) {
  std::map<std::string, std::string> kv;
  std::istringstream in(ini);
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 3);
  }
  return kv;
}

}  // namespace tessera
