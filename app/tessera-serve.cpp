// tessera-serve: a text-generation server over a checkpoint of any layout (Megatron-LM's
// run_text_generation_server.py): PUT or POST /api with {"prompts": [...], "tokens_to_generate":
// N, ...} answers {"text": [...], "segments": [...], "logprobs": [...]}. Under mpirun or srun at
// any TP x PP, world rank 0 serves HTTP and every rank computes.
#include <cstdio>

#include "comm/mpi/mpi.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "inference/text_server.hpp"
#include "inference_setup.hpp"

using namespace tessera;

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  const bool root = mpi.world_rank() == 0;
  InferenceSetup setup;
  ServerOptions so;
  try {
    OptionParser p("tessera-serve", "--load CKPT [--port 5000] [options]");
    setup.add_options(p);
    p.group("Server").add_options()("host", po::value(&so.host)->default_value(so.host),
                                    "address to listen on (127.0.0.1: this machine only)")(
        "port", po::value(&so.port)->default_value(so.port), "TCP port (0: any free port)")(
        "max-batch-prompts", po::value(&so.max_batch_prompts)->default_value(so.max_batch_prompts),
        "queued requests are generated together up to this many prompts")(
        "max-prompts", po::value(&so.max_prompts)->default_value(so.max_prompts),
        "prompts one request may carry");
    if (!p.parse(argc, argv)) return 0;
    if (so.port < 0 || so.port > 65535)
      throw ConfigError(
          detail::concat("--port=", so.port, " is out of range (allowed: 0 to 65535)"));
    if (so.max_batch_prompts < 1 || so.max_prompts < 1)
      throw ConfigError("--max-batch-prompts and --max-prompts must be >= 1");
    InferenceSetup::Loaded L = setup.open("tessera-serve", true);
    so.context = L.context;
    serve_text_generation(*L.model, L.ctx, L.tokenizer, so);
  } catch (const ConfigError& e) {
    if (root) std::fprintf(stderr, "tessera-serve: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
  return 0;
}
