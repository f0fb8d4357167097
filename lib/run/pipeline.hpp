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
//  - Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the forwards
//    and backwards of 1F1B (or of the interleaved schedule) in the same order, each backward
//    split into B, the input gradients the previous stage waits for, and W, the weight gradients
//    nobody waits for (model/weight_grads.hpp). A stage holds the operands of up to h_s B passes
//    whose W has not run: before each B it runs the oldest W while h_s are held, and the rest
//    after its last B. B reaches the previous stage a W sooner, and the W's fill the cool-down's
//    waits. ZB-H1 is h_s = k_s + 1, k_s the activation slots stage s holds fewer than stage 0 (s
//    for plain 1F1B: every stage then has P micro-batches between F and W); h_s is cut so that
//    the held operands fit in those k_s slots' bytes (activation memory no higher than 1F1B's
//    first stage of the same layers). A stage with h_s = 0 (stage 0 itself; or W operands larger
//    than the slots they would fill, as with full recomputation) runs 1F1B's whole backwards.
//    On an ideal pipeline (W <= F) the idle time per stage shrinks from 1F1B's (P-1)(F+B+W) to
//    (P-1)(F+B-W) + W: ZB-H1's, plus one W that stage 0's whole backwards cost (9 -> 4 units at
//    P = 4, F = B = W = 1; schedule_timeline draws it, docs/parallelism.md shows it).
#pragma once

#include <string>
#include <vector>

namespace tessera {

struct PipeStep {
  bool forward = true;
  int micro = 0;
  int chunk = 0;  // the model chunk (virtual stage index on this rank); 0 without interleaving
  // Zero-bubble: a backward step is B (weight false) or W (true); 1F1B's backward is both at once.
  bool weight = false;
  bool operator==(const PipeStep& o) const {
    return forward == o.forward && micro == o.micro && chunk == o.chunk && weight == o.weight;
  }
};

std::vector<PipeStep> schedule_1f1b(int pp_size, int pp_rank, int num_micro);
// Megatron's interleaved schedule for `virtual_stages` model chunks per rank (1: schedule_1f1b).
// num_micro must be a multiple of pp_size (checked by the caller with a clear message).
std::vector<PipeStep> schedule_interleaved(int pp_size, int pp_rank, int num_micro,
                                           int virtual_stages);
// ZB-H1: the forwards and backwards of schedule_interleaved (each backward its B pass), the W
// passes placed as the header says, `held` B passes' operands at most at once (the recording
// one's included). held = 0: schedule_interleaved itself (every backward whole).
std::vector<PipeStep> schedule_zero_bubble(int pp_size, int pp_rank, int num_micro,
                                           int virtual_stages, int held);
// h_s of stage pp_rank: min(k + 1, floor(k * slot_bytes / w_bytes)), k the activation slots it
// holds fewer than stage 0 (0 when k is: stage 0 runs whole backwards; slot_bytes: a
// micro-batch's slot of one model chunk, averaged over the rank's chunks; w_bytes: what one B
// pass holds for its W, the largest chunk's).
int zero_bubble_held(int pp_size, int pp_rank, int num_micro, int virtual_stages, double slot_bytes,
                     double w_bytes);
// Activation slots stage pp_rank needs: the most micro-batches in flight at once.
int pipeline_slots(int pp_size, int pp_rank, int num_micro);
// The same for any schedule, per model chunk: the most micro-batches of each chunk in flight at
// once (forwarded, not yet backwarded). Micro-batches of a chunk run forward and backward in
// order, so micro-batch m can use slot m % slots[chunk].
std::vector<int> pipeline_chunk_slots(const std::vector<PipeStep>& steps, int virtual_stages);
// "F0 F1 B0 F2 B1 ..." for logs and tests; with chunks "F0.1" is micro-batch 0 of chunk 1; a W
// pass is "W0".
std::string schedule_string(const std::vector<PipeStep>& steps);
// The ASCII timeline of every stage's schedule (one model chunk per rank) on an ideal pipeline
// (docs/parallelism.md): one row per rank, one cell per time unit, F taking `f` units, B `b` and
// W `w` (1F1B's backward, both at once: b + w); each step waits for its input from the
// neighbour stage (no transfer time). A cell is the step's letter and micro-batch ("F3", "B3",
// "W3"; 1F1B's backward "B3"), "." idle. `makespan`: the total time, when given.
std::string schedule_timeline(const std::vector<std::vector<PipeStep>>& stages, int f, int b, int w,
                              int* makespan = nullptr);

// The idle fraction of an ideal 1F1B pipeline with equal stage times: (P-1)/(m+P-1); with V model
// chunks per rank (interleaved) the warm-up and cool-down shrink V-fold: (P-1)/V / (m+(P-1)/V).
double theoretical_bubble(int pp_size, int num_micro, int virtual_stages = 1);
// Megatron's bubble ratio: bubble time over ideal (busy) time, (P-1)/(V m) (V = 1: plain 1F1B).
double theoretical_bubble_ratio(int pp_size, int num_micro, int virtual_stages);

}  // namespace tessera
