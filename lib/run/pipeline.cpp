// pipeline.cpp: schedule generation (1F1B and interleaved 1F1B).
#include "run/pipeline.hpp"

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

std::vector<PipeStep> schedule_interleaved(int pp_size, int pp_rank, int num_micro,
                                           int virtual_stages) {
  if (virtual_stages <= 1) return schedule_1f1b(pp_size, pp_rank, num_micro);
  const int P = pp_size, V = virtual_stages, total = num_micro * V;
  auto step = [&](int k, bool forward) {
    const int group = k / P;  // which run of P consecutive micro-batches of one chunk
    const int chunk = group % V;
    PipeStep s;
    s.forward = forward;
    s.chunk = forward ? chunk : V - 1 - chunk;
    s.micro = (k / (P * V)) * P + k % P;
    return s;
  };
  const int warmup = num_micro == P ? total : std::min(total, (P - pp_rank - 1) * 2 + (V - 1) * P);
  std::vector<PipeStep> s;
  int f = 0, b = 0;
  for (; f < warmup; ++f) s.push_back(step(f, true));
  while (f < total) {  // steady state: forward k + warmup, then backward k
    s.push_back(step(f++, true));
    s.push_back(step(b++, false));
  }
  while (b < total) s.push_back(step(b++, false));  // cool-down
  return s;
}

int pipeline_slots(int pp_size, int pp_rank, int num_micro) {
  return std::max(1, std::min(pp_size - pp_rank, num_micro));
}

std::vector<int> pipeline_chunk_slots(const std::vector<PipeStep>& steps, int virtual_stages) {
  std::vector<int> live(static_cast<size_t>(virtual_stages), 0), most(live.size(), 1);
  for (const PipeStep& p : steps) {
    int& n = live[static_cast<size_t>(p.chunk)];
    n += p.forward ? 1 : -1;
    most[static_cast<size_t>(p.chunk)] = std::max(most[static_cast<size_t>(p.chunk)], n);
  }
  return most;
}

std::string schedule_string(const std::vector<PipeStep>& steps) {
  bool chunks = false;
  for (const PipeStep& p : steps) chunks |= p.chunk != 0;
  std::string out;
  for (const PipeStep& p : steps) {
    if (!out.empty()) out += ' ';
    out += (p.forward ? "F" : "B") + std::to_string(p.micro);
    if (chunks) out += "." + std::to_string(p.chunk);
  }
  return out;
}

double theoretical_bubble(int pp_size, int num_micro, int virtual_stages) {
  const double idle = static_cast<double>(pp_size - 1) / std::max(1, virtual_stages);
  return idle / (num_micro + idle);
}

double theoretical_bubble_ratio(int pp_size, int num_micro, int virtual_stages) {
  return static_cast<double>(pp_size - 1) / (static_cast<double>(virtual_stages) * num_micro);
}

}  // namespace tessera
