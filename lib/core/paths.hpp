// paths.hpp: output paths. Every option that names a file or directory to write creates the
// directories above it, as `--save` always has (docs/megatron-options.md).
#pragma once

#include <sys/stat.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "core/error.hpp"

namespace tessera {

// Creates the directories that hold `path` (a file, or a prefix such as data/corpus for
// data/corpus_00000.h5). ConfigError naming `option` when one cannot be made.
// A directory / a regular file exists at `p` (following links).
inline bool is_dir(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
inline bool is_file(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

inline void create_parent_dirs(const std::string& path, const std::string& option) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  if (ec || !std::filesystem::is_directory(parent))
    throw ConfigError(option + " '" + path + "': cannot create the directory '" + parent.string() +
                      "'" + (ec ? ": " + ec.message() : std::string()));
}

}  // namespace tessera
