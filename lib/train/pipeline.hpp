// pipeline.hpp: the 1F1B (PipeDream-Flush) pipeline schedule. Stage s of P runs
// min(P - s - 1, m) warm-up forwards, then alternates one forward and one backward, then drains
// the remaining backwards, so at most P - s micro-batches are in flight on it.
#pragma once

#include <string>
#include <vector>

namespace tessera {

struct PipeStep {
  bool forward = true;
  int micro = 0;
  bool operator==(const PipeStep& o) const { return forward == o.forward && micro == o.micro; }
};

std::vector<PipeStep> schedule_1f1b(int pp_size, int pp_rank, int num_micro);
// Activation slots stage pp_rank needs: the most micro-batches in flight at once.
int pipeline_slots(int pp_size, int pp_rank, int num_micro);
// "F0 F1 B0 F2 B1 ..." for logs and tests.
std::string schedule_string(const std::vector<PipeStep>& steps);
// The idle fraction of an ideal 1F1B pipeline with equal stage times: (P-1)/(m+P-1).
double theoretical_bubble(int pp_size, int num_micro);

}  // namespace tessera
