// timers.cpp: Megatron-LM's iteration timers: timing, the collection over ranks and the log text.
#include "step/timers.hpp"

#include <algorithm>
#include <cstdio>

#include "core/error.hpp"

namespace tessera {

const char* IterationTimers::name(Id id, bool distributed_optimizer) {
  switch (id) {
    case ForwardBackward:
      return "forward-backward";
    case ForwardCompute:
      return "forward-compute";
    case BackwardCompute:
      return "backward-compute";
    case BatchGenerator:
      return "batch-generator";
    case ForwardRecv:
      return "forward-recv";
    case ForwardSend:
      return "forward-send";
    case BackwardRecv:
      return "backward-recv";
    case BackwardSend:
      return "backward-send";
    case GradsAllReduce:
      return distributed_optimizer ? "grads-reduce-scatter" : "grads-all-reduce";
    case EmbeddingGradsAllReduce:
      return "embedding-grads-all-reduce";
    case ParamsAllGather:
      return "params-all-gather";
    case Optimizer:
      return "optimizer";
    case SaveCheckpoint:
      return "save-checkpoint";
    default:
      return "?";
  }
}

// Megatron-LM's levels (megatron/training/training.py, the pipeline schedules).
int IterationTimers::level(Id id) {
  switch (id) {
    case SaveCheckpoint:
      return 0;
    case ForwardBackward:
    case GradsAllReduce:
    case EmbeddingGradsAllReduce:
    case ParamsAllGather:
    case Optimizer:
      return 1;
    default:
      return 2;
  }
}

void IterationTimers::configure(int level, std::string option, std::unique_ptr<PhaseClock> clock,
                                bool distributed_optimizer) {
  if (level < 0 || level > 2)
    throw ConfigError(
        detail::concat("--timing-log-level=", level, " is out of range (allowed: 0, 1, 2)"));
  if (option != "minmax" && option != "max" && option != "all")
    throw ConfigError("--timing-log-option '" + option +
                      "' is not an option (allowed: minmax, max, all)");
  level_ = level;
  option_ = std::move(option);
  clock_ = std::move(clock);
  dist_opt_ = distributed_optimizer;
}

IterationTimers::Scope::Scope(IterationTimers& t, Id id)
    : t_(t.on(id) && t.clock_ ? &t : nullptr), id_(id) {
  if (!t_) return;
  slot_ = t_->next_slot_++;
  t_->clock_->record(slot_);
}

IterationTimers::Scope::~Scope() {
  if (!t_) return;
  const int end = t_->next_slot_++;
  t_->clock_->record(end);
  t_->pending_.push_back({id_, slot_, end});
  ++t_->calls_[id_];
}

void IterationTimers::settle() {
  if (pending_.empty()) return;
  clock_->synchronize();
  for (const Interval& i : pending_) ms_[i.id] += clock_->elapsed_ms(i.from, i.to);
  pending_.clear();
  next_slot_ = 0;
}

std::vector<IterationTimers::Id> IterationTimers::iteration_timers() const {
  std::vector<Id> ids;
  for (int i = 0; i < kCount; ++i)
    if (i != SaveCheckpoint && on(static_cast<Id>(i))) ids.push_back(static_cast<Id>(i));
  return ids;
}

std::vector<IterationTimers::Row> IterationTimers::collect(Communicator& world,
                                                           const std::vector<Id>& ids,
                                                           int iterations) {
  settle();
  const int R = world.size(), N = static_cast<int>(ids.size());
  // Every rank's times (and whether it ran each timer), gathered exactly by a sum of slots.
  std::vector<double> all(static_cast<size_t>(2 * R * N), 0.0);
  for (int k = 0; k < N; ++k) {
    all[static_cast<size_t>(world.rank() * N + k)] = ms_[ids[k]];
    all[static_cast<size_t>(R * N + world.rank() * N + k)] = static_cast<double>(calls_[ids[k]]);
  }
  if (!all.empty())
    world.all_reduce_f64(all.data(), static_cast<int64_t>(all.size()), ReduceOp::Sum);
  for (Id id : ids) ms_[id] = 0, calls_[id] = 0;
  std::vector<Row> rows;
  const double per = 1.0 / std::max(iterations, 1);
  for (int k = 0; k < N; ++k) {
    Row r;
    r.name = name(ids[k], dist_opt_);
    bool ran = false;
    for (int q = 0; q < R; ++q) {
      const double ms = all[static_cast<size_t>(q * N + k)] * per;
      const bool here = all[static_cast<size_t>(R * N + q * N + k)] > 0;
      r.rank_ms.push_back(here ? ms : 0.0);
      if (!here) continue;
      r.min_ms = ran ? std::min(r.min_ms, ms) : ms;
      r.max_ms = ran ? std::max(r.max_ms, ms) : ms;
      ran = true;
    }
    if (ran) rows.push_back(std::move(r));
  }
  return rows;
}

std::string IterationTimers::format(const std::vector<Row>& rows) const {
  if (rows.empty()) return "";
  std::string out = option_ == "minmax" ? "(min, max) time across ranks (ms):"
                    : option_ == "max"  ? "max time across ranks (ms):"
                                        : "times across ranks (ms):";
  char line[256];
  for (const Row& r : rows) {
    std::string dots = "    " + r.name + " ";
    dots.resize(std::max<size_t>(dots.size(), 52), '.');
    if (option_ == "minmax") {
      std::snprintf(line, sizeof line, "%s: (%.2f, %.2f)", dots.c_str(), r.min_ms, r.max_ms);
      out += "\n" + std::string(line);
    } else if (option_ == "max") {
      std::snprintf(line, sizeof line, "%s: %.2f", dots.c_str(), r.max_ms);
      out += "\n" + std::string(line);
    } else {
      out += "\n  " + r.name + ":";
      for (size_t q = 0; q < r.rank_ms.size(); ++q) {
        std::snprintf(line, sizeof line, "\n     rank %2zu: %.2f", q, r.rank_ms[q]);
        out += line;
      }
    }
  }
  return out;
}

std::string IterationTimers::json(const std::vector<Row>& rows) {
  std::string out = "{";
  char buf[256];
  for (size_t i = 0; i < rows.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%s\"%s\": {\"min\": %.4f, \"max\": %.4f}", i ? ", " : "",
                  rows[i].name.c_str(), rows[i].min_ms, rows[i].max_ms);
    out += buf;
  }
  return out + "}";
}

}  // namespace tessera
