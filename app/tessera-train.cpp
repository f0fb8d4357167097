// tessera-train: trains a GPT model (see --help). Thin: parses options and calls lib/.
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/logging.hpp"
#include "data/dataset.hpp"
#include "train/options.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {
std::string host_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}
}  // namespace

int main(int argc, char** argv) {
  RunOptions opts;
  const std::string host = host_name();
  try {
    if (!parse_run_options(argc, argv, opts)) return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "rank 0 (%s): error: %s\n", host.c_str(), e.what());
    return 2;
  }
  try {
    opts.log.rank = 0;
    opts.log.host = host;
    init_logging(opts.log);
    const int threads = opts.threads > 0 ? opts.threads : affinity_cores();
    set_num_threads(threads);
    if (opts.train.dry_run) {
      std::cout << dry_run_report(opts);
      return 0;
    }
    auto backend = make_cpu_backend();
    auto data = make_mock_dataset(opts.model.vocab_size, opts.model.seq_length, opts.train.seed);
    TLOG(info) << "tessera-train: " << opts.model.num_layers << " layers, hidden "
               << opts.model.hidden_size << ", " << opts.model.num_attention_heads << " heads, seq "
               << opts.model.seq_length << ", vocab " << opts.model.vocab_size << " (padded "
               << opts.model.padded_vocab_size(1) << "), " << opts.model.num_parameters()
               << " parameters; backend " << backend->name() << ", " << threads
               << " threads; data: " << data->describe();
    Trainer trainer(opts.model, opts.train, *backend, *data);
    trainer.train();
    TLOG(info) << "training finished after " << trainer.iteration() << " iterations, "
               << trainer.consumed_samples() << " samples";
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "rank 0 (%s): error: %s\n", host.c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank 0 (%s): error: %s\n", host.c_str(), e.what());
    return 1;
  }
  return 0;
}
