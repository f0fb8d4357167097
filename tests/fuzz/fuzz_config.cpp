// fuzz_config.cpp: the INI config reader (tessera's OptionParser over Boost.ProgramOptions) on any
// file, with options of every kind the apps declare (integers, floats, strings, switches,
// repeated and multi-token values). Bad input may only throw ConfigError.
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "fuzz_util.hpp"

using namespace tessera;
namespace po = boost::program_options;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::scratch_dir() + "/run.ini";
  fuzz::write_file(path, data, size);
  int layers = 0;
  int64_t iters = 0;
  double lr = 0;
  std::string style;
  bool bf16 = false;
  std::vector<std::string> data_path, ramp;
  OptionParser p("fuzz_config", "[options]");
  p.group("Options").add_options()("num-layers", po::value(&layers)->default_value(12), "")(
      "train-iters", po::value(&iters)->default_value(0), "")(
      "lr", po::value(&lr)->default_value(1e-4), "")(
      "lr-decay-style", po::value(&style)->default_value("linear"), "")(
      "bf16", po::bool_switch(&bf16), "")("data-path", po::value(&data_path)->composing(), "")(
      "rampup-batch-size", po::value(&ramp)->multitoken(), "");
  const std::string config = "--config=" + path;
  const char* argv[] = {"fuzz_config", config.c_str(), "--train-iters", "7"};
  try {
    if (p.parse(4, argv)) (void)p.to_ini();
  } catch (const ConfigError&) {
  }
  return 0;
}
