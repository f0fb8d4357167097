// pipeline.cpp: 1F1B schedule generation.
#include "train/pipeline.hpp"

#include <algorithm>

namespace tessera {

std::vector<PipeStep> schedule_1f1b(int pp_size, int pp_rank, int num_micro) {
  const int warmup = std::min(pp_size - pp_rank - 1, num_micro);
  std::vector<PipeStep> s;
  int f = 0, b = 0;
  for (; f < warmup; ++f) s.push_back({true, f});
  while (f < num_micro) {  // steady state: one forward, one backward
    s.push_back({true, f++});
    s.push_back({false, b++});
  }
  while (b < num_micro) s.push_back({false, b++});  // cool-down
  return s;
}

int pipeline_slots(int pp_size, int pp_rank, int num_micro) {
  return std::max(1, std::min(pp_size - pp_rank, num_micro));
}

std::string schedule_string(const std::vector<PipeStep>& steps) {
  std::string out;
  for (const PipeStep& p : steps) {
    if (!out.empty()) out += ' ';
    out += (p.forward ? "F" : "B") + std::to_string(p.micro);
  }
  return out;
}

double theoretical_bubble(int pp_size, int num_micro) {
  return static_cast<double>(pp_size - 1) / (num_micro + pp_size - 1);
}

}  // namespace tessera
