// timers.hpp: Megatron-LM's named iteration timers (--timing-log-level, --timing-log-option).
//
// The trainer times the phases Megatron users read in its log: forward-backward, forward-compute,
// backward-compute, the pipeline's sends and receives, the gradient reduction, the parameter
// gather, the optimizer, the batch generator, the checkpoint save. Each timer has Megatron's level
// (1: the step's main phases, 2: everything); a timer above --timing-log-level costs one branch.
// A timed phase records a timestamp on a PhaseClock at its start and end: CUDA events on the
// compute stream (the device work between them, with no host synchronization inside the step,
// so the pipeline's transfers are never held up) or, on the CPU, the host clock. The timestamps
// are read once per step, after the step's own synchronization (settle()).
//
// At each --log-interval the trainer collects the timers over all ranks (collective) and prints,
// after the iteration line, per timer the min and max over the ranks that ran it (minmax), the
// max (max), or every rank's value (all), in ms per iteration.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/phase_timer.hpp"

namespace tessera {

class IterationTimers {
 public:
  enum Id {
    ForwardBackward,
    ForwardCompute,
    BackwardCompute,
    BatchGenerator,
    ForwardRecv,
    ForwardSend,
    BackwardRecv,
    BackwardSend,
    GradsAllReduce,
    EmbeddingGradsAllReduce,
    ParamsAllGather,
    Optimizer,
    SaveCheckpoint,
    kCount
  };
  static const char* name(Id id, bool distributed_optimizer);
  static int level(Id id);

  // level 0: only save-checkpoint (printed when a checkpoint is saved); option: minmax | max |
  // all; `clock` takes the timestamps (runtime/select.hpp make_phase_clock).
  void configure(int level, std::string option, std::unique_ptr<PhaseClock> clock,
                 bool distributed_optimizer);
  bool on(Id id) const { return level(id) <= level_; }

  // Times `id` while it lives (nothing when the timer's level is above the configured one).
  class Scope {
   public:
    Scope(IterationTimers& t, Id id);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    IterationTimers* t_;
    Id id_;
    int slot_ = 0;
  };
  // Reads the timestamps recorded so far into the totals (waits for the device's events).
  void settle();

  struct Row {
    std::string name;
    double min_ms = 0, max_ms = 0;  // over the ranks that ran it, per iteration
    std::vector<double> rank_ms;    // every rank's (0: did not run it)
  };
  // Collective over `world`: the timers in `ids` that ran on some rank since the last collect,
  // each divided by `iterations`; resets them.
  std::vector<Row> collect(Communicator& world, const std::vector<Id>& ids, int iterations);
  // Every timer at or below the configured level except save-checkpoint.
  std::vector<Id> iteration_timers() const;
  // The rows as Megatron prints them (empty when there are none).
  std::string format(const std::vector<Row>& rows) const;
  // The rows as a JSON object {"name": {"min": ms, "max": ms}, ...}.
  static std::string json(const std::vector<Row>& rows);

 private:
  int level_ = 0;
  std::string option_ = "minmax";
  std::unique_ptr<PhaseClock> clock_;
  bool dist_opt_ = false;
  struct Interval {
    Id id;
    int from, to;
  };
  std::vector<Interval> pending_;
  int next_slot_ = 0;
  std::array<double, kCount> ms_{};
  std::array<int64_t, kCount> calls_{};
};

}  // namespace tessera
