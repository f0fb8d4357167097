// loss_scaler.cpp: constant and dynamic loss scaling.
#include "step/loss_scaler.hpp"

#include <algorithm>

namespace tessera {

LossScaler LossScaler::constant(double scale) {
  LossScaler s;
  s.scale_ = scale;
  return s;
}

LossScaler LossScaler::dynamic(double initial, double min_scale, int64_t window,
                               int64_t hysteresis) {
  LossScaler s;
  s.dynamic_ = true;
  s.scale_ = initial;
  s.min_scale_ = min_scale;
  s.window_ = window;
  s.hysteresis_ = hysteresis;
  s.hysteresis_tracker_ = hysteresis;
  return s;
}

void LossScaler::update(bool found_inf) {
  if (!dynamic_) return;
  if (found_inf) {
    growth_tracker_ = 0;
    if (--hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * 0.5, min_scale_);
    return;
  }
  if (++growth_tracker_ == window_) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = hysteresis_;
    scale_ *= 2.0;
  }
}

void LossScaler::restore(double scale, int64_t growth_tracker, int64_t hysteresis_tracker) {
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  hysteresis_tracker_ = hysteresis_tracker;
}

}  // namespace tessera
