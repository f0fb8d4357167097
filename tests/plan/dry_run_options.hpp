// dry_run_options.hpp: tessera-train's options parsed as a --dry-run (the plan tests' models and
// layouts from the command line a user gives).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "options/options.hpp"

namespace tessera {

inline RunOptions dry_run_options(std::vector<std::string> args) {
  args.insert(args.begin(), "tessera-train");
  args.push_back("--dry-run");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  RunOptions o;
  EXPECT_TRUE(parse_run_options(static_cast<int>(argv.size()), argv.data(), o));
  return o;
}

}  // namespace tessera
