// tessera-checkpoint: checkpoint maintenance. `verify DIR [--iteration N]` reads every tensor of
// every file of a checkpoint (model and optimizer state, the replicated copies that loading never
// reads included) against its checksum and the layout (lib/checkpoint/verify.hpp). Exit status:
// 0 clean, 1 damaged, 2 bad input (no such directory, no checkpoint in it).
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "checkpoint/verify.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/timer.hpp"

using namespace tessera;

namespace {

const char* const kUsage =
    "usage: tessera-checkpoint verify DIR [--iteration N]\n"
    "  verify  read every tensor of every file of the checkpoint in DIR (a run's --save "
    "directory:\n"
    "          its latest checkpoint, or iteration N; or an iter_NNNNNNN directory) and check its\n"
    "          checksum and layout; one line per problem; exit 0 clean, 1 damaged, 2 bad input\n"
    "Run 'tessera-checkpoint verify --help' for the options.\n";

int verify(int argc, char** argv) {
  // DIR is the one argument that is neither an option nor an option's value; the parser sees the
  // rest (it takes options only).
  std::vector<const char*> args{"tessera-checkpoint verify"};
  std::vector<std::string> dirs;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.size() > 1 && a[0] == '-') {
      args.push_back(argv[i]);
      if ((a == "--iteration" || a == "--config") && i + 1 < argc) args.push_back(argv[++i]);
    } else {
      dirs.push_back(a);
    }
  }
  int64_t iteration = -1;
  OptionParser p("tessera-checkpoint verify", "DIR [--iteration N]");
  p.group("Verify").add_options()(
      "iteration", po::value(&iteration),
      "check the checkpoint of this iteration (DIR/iter_NNNNNNN) instead of the latest");
  if (!p.parse(static_cast<int>(args.size()), args.data())) return 0;
  if (dirs.size() != 1)
    throw ConfigError(dirs.empty() ? "verify needs the checkpoint directory DIR"
                                   : "verify takes one DIR, got " + std::to_string(dirs.size()) +
                                         " ('" + dirs[0] + "', '" + dirs[1] + "', ...)");
  if (p.given("iteration") && iteration < 0)
    throw ConfigError("--iteration=" + std::to_string(iteration) +
                      " is out of range (allowed: >= 0)");
  Timer t;
  const CheckpointVerifyReport r = verify_checkpoint(
      dirs[0], iteration, [](const std::string& line) { std::cout << line << std::endl; });
  for (const std::string& line : r.problems) std::cout << line << std::endl;
  const double seconds = t.seconds();
  std::string summary = "tessera-checkpoint: verified " + (r.dir.empty() ? dirs[0] : r.dir);
  if (r.iteration >= 0 || r.tp_size > 0) {
    summary += " (";
    if (r.iteration >= 0) summary += "iteration " + std::to_string(r.iteration) + ", ";
    summary += r.tp_size > 0
                   ? "TP " + std::to_string(r.tp_size) + " x PP " + std::to_string(r.pp_size) + ")"
                   : std::string("layout unreadable)");
  }
  char figures[256];
  std::snprintf(figures, sizeof figures,
                ": %d file%s, %lld tensors, %lld bytes checked in %.2f s (%.0f MB/s): ", r.files,
                r.files == 1 ? "" : "s", (long long)r.tensors, (long long)r.bytes, seconds,
                seconds > 0 ? r.bytes / 1e6 / seconds : 0.0);
  summary += figures;
  const size_t n = r.problems.size();
  summary += n == 0 ? std::string("clean")
                    : std::to_string(n) + (n == 1 ? " problem" : " problems") + " (damaged)";
  std::cout << summary << std::endl;
  return r.clean() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
      (argc < 2 ? std::cerr : std::cout) << kUsage;
      return argc < 2 ? 2 : 0;
    }
    if (std::strcmp(argv[1], "verify") == 0) return verify(argc, argv);
    throw ConfigError(std::string("unknown command '") + argv[1] + "' (allowed: verify)");
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "tessera-checkpoint: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-checkpoint: error: %s\n", e.what());
    return 1;
  }
}
