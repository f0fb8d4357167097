// loss_scaler.hpp: loss scaling for fp16 training (Megatron's ConstantGradScaler and
// DynamicGradScaler). The loss gradient is multiplied by scale() before the backward; the
// gradients are divided by it before clipping and the optimizer. With dynamic scaling, a step
// whose gradients overflowed is skipped: after `hysteresis` overflows in a row the scale halves
// (not below the minimum), and after `window` good steps in a row it doubles.
#pragma once

#include <cstdint>

namespace tessera {

class LossScaler {
 public:
  // A constant scale (1 for fp32 and bf16: no scaling).
  static LossScaler constant(double scale);
  static LossScaler dynamic(double initial, double min_scale, int64_t window, int64_t hysteresis);

  double scale() const { return scale_; }
  bool is_dynamic() const { return dynamic_; }
  // After the backward: found_inf when any gradient is inf or NaN (the step is then skipped).
  void update(bool found_inf);

  // State for checkpoints (exact resume).
  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  void restore(double scale, int64_t growth_tracker, int64_t hysteresis_tracker);

 private:
  double scale_ = 1, min_scale_ = 1;
  bool dynamic_ = false;
  int64_t window_ = 1000, hysteresis_ = 2;
  int64_t growth_tracker_ = 0, hysteresis_tracker_ = 2;
};

}  // namespace tessera
