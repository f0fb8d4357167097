// text_server.hpp: a text-generation server like Megatron-LM's run_text_generation_server.py.
// World rank 0 answers HTTP (Boost.Beast) on PUT/POST /api; queued requests are batched and every
// rank of the model's layout runs the batch's generation together.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.hpp"
#include "data/tokenizer.hpp"
#include "data/unicode.hpp"  // json_quote
#include "model/gpt.hpp"

namespace tessera {

// A request the API refuses (HTTP 400 with this one-line reason).
struct ApiError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The JSON body of PUT /api (Megatron-LM's fields and defaults).
struct ApiRequest {
  std::vector<std::string> prompts;
  int64_t tokens_to_generate = 64;  // 0 scores the prompts (needs logprobs)
  double temperature = 1.0;         // (0, 100]; 0 is greedy
  int top_k = 0;                    // [0, 1000]; 0: no limit
  double top_p = 0.0;               // [0, 1]; 0: no nucleus truncation
  double top_p_decay = 0.0, top_p_bound = 0.0;
  bool logprobs = false;
  bool add_BOS = false;
  int64_t random_seed = -1;  // -1: a seed of the server's choosing
  int beam_width = 0;        // 0: sampling; >= 1: beam search (one prompt)
  int64_t stop_token = -1;   // -1: the tokenizer's end-of-document token
  double length_penalty = 1.0;
};

// Parses and checks a request body; throws ApiError saying what is wrong.
ApiRequest parse_api_request(std::string_view body);

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 5000;
  int max_batch_prompts = 64;  // prompts of queued requests run together in one batch
  int max_prompts = 128;       // per request (Megatron-LM's limit)
  int64_t context = 0;         // prompt plus new tokens at most (0: the model's positions)
  // Called on rank 0 with the port once it listens (tests: --port 0).
  std::function<void(int port)> on_listening;
};

// Serves until SIGINT, SIGTERM or SIGUSR1 reaches world rank 0 (then every rank returns). At the
// stop the batch in progress finishes, queued and late requests get 503, every connection is
// answered and closed, and every thread the server started is joined before it returns. Collective
// over all ranks of ctx.world; `model` is this rank's shard, `tok` the tokenizer of the model.
// Throws ConfigError when rank 0 cannot listen on the address (every rank throws it).
void serve_text_generation(GPTModel& model, const ParallelContext& ctx,
                           std::shared_ptr<const Tokenizer> tok, const ServerOptions& opts);

}  // namespace tessera
