// context_parallel.hpp (train): what the trainer adds for context parallelism
// (docs/parallelism.md): the option checks, each CP rank's tokens of a sample, and the ring's
// traffic that --dry-run prints. The ring itself
// is the model's (model/context_parallel.cpp); the grid's groups are runtime/process_grid.*.
#pragma once

#include <cstdint>

#include "model/gpt_config.hpp"
#include "run/train_config.hpp"

namespace tessera {

// ConfigError naming the options when CP cannot run this model and layout: CP < 1, a sequence
// not divisible by 2·CP (or, with sequence parallelism, S/CP not divisible by TP), MoE with a
// capacity factor. Nothing to check at CP 1.
void validate_context_parallel(const GPTConfig& cfg, const TrainConfig& t, int tp, int cp);

// CP rank `rank`'s ids and targets (T = S / CP each) of one sample of S + 1 tokens: its chunks r
// and 2·CP−1−r, the targets shifted on the whole sample (the target of position p is token p + 1).
// Testing: TESSERA_FAULT_CP=contiguous-split gives rank r the r-th contiguous S / CP instead, which
// the ring's schedule and the positions do not expect (the layout test's mutation).
void cp_sample_tokens(const int32_t* sample, int T, int rank, int cp, int32_t* ids,
                      int32_t* targets);

// Context parallelism's ring (model/context_parallel.cpp): the bytes one rank sends per
// transformer layer per micro-batch. A K/V block is the rank's key and value heads
// (B x S/CP x 2 x KV heads/TP x head dim, compute dtype); the forward sends CP − 1 of them, the
// backward CP − 1 again plus CP dK/dV blocks (the last one home to its owner); recomputation
// (selective or full) runs the forward's ring again. Zeros at CP 1.
struct RingTraffic {
  double block = 0, forward = 0, backward = 0, recompute = 0;
  double per_layer() const { return forward + backward + recompute; }
};
RingTraffic cp_ring_traffic(const GPTConfig& cfg, const TrainConfig& t, int tp, int cp);

}  // namespace tessera
