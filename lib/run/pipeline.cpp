// pipeline.cpp: schedule generation (1F1B, interleaved 1F1B, zero-bubble ZB-H1).
#include "run/pipeline.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <tuple>

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

std::vector<PipeStep> schedule_zero_bubble(int pp_size, int pp_rank, int num_micro,
                                           int virtual_stages, int held) {
  if (held <= 0)  // nothing held: each backward whole, 1F1B's steps
    return schedule_interleaved(pp_size, pp_rank, num_micro, virtual_stages);
  std::vector<PipeStep> s;
  std::deque<PipeStep> pending;  // B passes whose W has not run, oldest first
  for (const PipeStep& p : schedule_interleaved(pp_size, pp_rank, num_micro, virtual_stages)) {
    if (!p.forward)  // room for this B's operands: at most `held` passes at once
      for (; static_cast<int>(pending.size()) >= held; pending.pop_front())
        s.push_back(pending.front());
    s.push_back(p);
    if (p.forward) continue;
    PipeStep w = p;
    w.weight = true;
    pending.push_back(w);
  }
  s.insert(s.end(), pending.begin(), pending.end());
  return s;
}

int zero_bubble_held(int pp_size, int pp_rank, int num_micro, int virtual_stages, double slot_bytes,
                     double w_bytes) {
  auto slots = [&](int rank) {
    if (virtual_stages <= 1) return pipeline_slots(pp_size, rank, num_micro);
    int n = 0;
    for (int c : pipeline_chunk_slots(
             schedule_interleaved(pp_size, rank, num_micro, virtual_stages), virtual_stages))
      n += c;
    return n;
  };
  const int k = std::max(0, slots(0) - slots(pp_rank));
  if (k == 0) return 0;  // no slot to spare: whole backwards
  if (w_bytes <= 0) return k + 1;
  return static_cast<int>(std::min<double>(k + 1, std::floor(k * slot_bytes / w_bytes)));
}

int pipeline_slots(int pp_size, int pp_rank, int num_micro) {
  return std::max(1, std::min(pp_size - pp_rank, num_micro));
}

std::vector<int> pipeline_chunk_slots(const std::vector<PipeStep>& steps, int virtual_stages) {
  std::vector<int> live(static_cast<size_t>(virtual_stages), 0), most(live.size(), 1);
  for (const PipeStep& p : steps) {
    if (p.weight) continue;  // zero-bubble: the slot is free after B (W holds its own copies)
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
    out += (p.forward ? "F" : p.weight ? "W" : "B") + std::to_string(p.micro);
    if (chunks) out += "." + std::to_string(p.chunk);
  }
  return out;
}

std::string schedule_timeline(const std::vector<std::vector<PipeStep>>& stages, int f, int b, int w,
                              int* makespan) {
  const int P = static_cast<int>(stages.size());
  std::vector<bool> split(static_cast<size_t>(P), false);  // the stage runs B and W apart
  int most = 0;
  for (int r = 0; r < P; ++r)
    for (const PipeStep& p : stages[static_cast<size_t>(r)]) {
      if (p.weight) split[static_cast<size_t>(r)] = true;
      most = std::max(most, p.micro);
    }
  auto length = [&](int r, const PipeStep& p) {
    return p.forward ? f : p.weight ? w : split[static_cast<size_t>(r)] ? b : b + w;
  };
  // Each stage runs its steps in order; F of micro m waits for the previous stage's F of m, a
  // backward (B) for the next stage's B of m.
  std::map<std::tuple<int, bool, int>, int> done;  // (stage, forward, micro) -> end time
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  std::vector<int> clock(static_cast<size_t>(P), 0);
  std::vector<std::vector<std::pair<int, const PipeStep*>>> placed(static_cast<size_t>(P));
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < P; ++r) {
      const auto& s = stages[static_cast<size_t>(r)];
      for (size_t& i = next[static_cast<size_t>(r)]; i < s.size(); ++i) {
        const PipeStep& p = s[i];
        int ready = clock[static_cast<size_t>(r)];
        if (!p.weight && (p.forward ? r > 0 : r < P - 1)) {
          const auto it = done.find({p.forward ? r - 1 : r + 1, p.forward, p.micro});
          if (it == done.end()) break;
          ready = std::max(ready, it->second);
        }
        placed[static_cast<size_t>(r)].push_back({ready, &p});
        clock[static_cast<size_t>(r)] = ready + length(r, p);
        if (!p.weight) done[{r, p.forward, p.micro}] = clock[static_cast<size_t>(r)];
        moved = true;
      }
    }
  }
  const int end = *std::max_element(clock.begin(), clock.end());
  if (makespan) *makespan = end;
  const size_t width = std::to_string(most).size() + 2;
  std::string out;
  for (int r = 0; r < P; ++r) {
    std::vector<std::string> cells(static_cast<size_t>(end), ".");
    for (const auto& [start, p] : placed[static_cast<size_t>(r)])
      for (int t = start; t < start + length(r, *p); ++t)
        cells[static_cast<size_t>(t)] = (p->forward  ? "F"
                                         : p->weight ? "W"
                                                     : "B") +
                                        std::to_string(p->micro);
    std::string row = "stage " + std::to_string(r) + " |";
    for (const std::string& c : cells) row += c + std::string(width - c.size(), ' ');
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
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
