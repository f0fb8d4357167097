// pipeline.hpp: the pipeline schedules.
//  - 1F1B (PipeDream-Flush): stage s of P runs min(P - s - 1, m) warm-up forwards, then alternates
//    one forward and one backward, then drains the remaining backwards, so at most P - s
//    micro-batches are in flight on it.
//  - Interleaved 1F1B (Megatron-LM's, Narayanan et al. 2021): each rank holds V model chunks
//    (virtual stages p, p + P, ...); a forward step k on a rank is micro-batch
//    (k / (P V)) P + k mod P of chunk (k / P) mod V, a backward step the same micro-batch of chunk
//    V - 1 - (k / P) mod V; (P - p - 1) * 2 + (V - 1) * P warm-up forwards (all of them when
//    m = P), then one forward and one backward, then the remaining backwards. The bubble shrinks
//    by V: (P - 1) / (V m) of the ideal time, against (P - 1) / m.
#pragma once

#include <string>
#include <vector>

namespace tessera {

struct PipeStep {
  bool forward = true;
  int micro = 0;
  int chunk = 0;  // the model chunk (virtual stage index on this rank); 0 without interleaving
  bool operator==(const PipeStep& o) const {
    return forward == o.forward && micro == o.micro && chunk == o.chunk;
  }
};

std::vector<PipeStep> schedule_1f1b(int pp_size, int pp_rank, int num_micro);
// Megatron's interleaved schedule for `virtual_stages` model chunks per rank (1: schedule_1f1b).
// num_micro must be a multiple of pp_size (checked by the caller with a clear message).
std::vector<PipeStep> schedule_interleaved(int pp_size, int pp_rank, int num_micro,
                                           int virtual_stages);
// Activation slots stage pp_rank needs: the most micro-batches in flight at once.
int pipeline_slots(int pp_size, int pp_rank, int num_micro);
// The same for any schedule, per model chunk: the most micro-batches of each chunk in flight at
// once (forwarded, not yet backwarded). Micro-batches of a chunk run forward and backward in
// order, so micro-batch m can use slot m % slots[chunk].
std::vector<int> pipeline_chunk_slots(const std::vector<PipeStep>& steps, int virtual_stages);
// "F0 F1 B0 F2 B1 ..." for logs and tests; with chunks "F0.1" is micro-batch 0 of chunk 1.
std::string schedule_string(const std::vector<PipeStep>& steps);
// The idle fraction of an ideal 1F1B pipeline with equal stage times: (P-1)/(m+P-1); with V model
// chunks per rank (interleaved) the warm-up and cool-down shrink V-fold: (P-1)/V / (m+(P-1)/V).
double theoretical_bubble(int pp_size, int num_micro, int virtual_stages = 1);
// Megatron's bubble ratio: bubble time over ideal (busy) time, (P-1)/(V m) (V = 1: plain 1F1B).
double theoretical_bubble_ratio(int pp_size, int num_micro, int virtual_stages);

}  // namespace tessera
