// lr_schedule.hpp: linear warm-up, then constant, linear or cosine decay to min-lr (Megatron's).
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

class LrSchedule {
 public:
  LrSchedule(double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
             std::string style);
  // Learning rate used at iteration `iter` (1-based): warm-up reaches max_lr at iter ==
  // warmup_iters; decay runs from warmup_iters to decay_iters and then stays at min_lr.
  double lr(int64_t iter) const;

 private:
  double max_lr_, min_lr_;
  int64_t warmup_, decay_;
  std::string style_;
};

}  // namespace tessera
