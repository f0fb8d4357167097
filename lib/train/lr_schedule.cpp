// lr_schedule.cpp: the learning-rate schedule.
#include "train/lr_schedule.hpp"

#include <cmath>

#include "core/error.hpp"

namespace tessera {

LrSchedule::LrSchedule(double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
                       std::string style)
    : max_lr_(max_lr),
      min_lr_(min_lr),
      warmup_(warmup_iters),
      decay_(decay_iters),
      style_(std::move(style)) {
  if (style_ != "constant" && style_ != "linear" && style_ != "cosine")
    throw ConfigError("--lr-decay-style=" + style_ +
                      " is not a style (allowed: constant, linear, cosine)");
}

double LrSchedule::lr(int64_t iter) const {
  if (warmup_ > 0 && iter <= warmup_) return max_lr_ * static_cast<double>(iter) / warmup_;
  if (style_ == "constant") return max_lr_;
  if (iter >= decay_) return min_lr_;
  const double span = static_cast<double>(decay_ - warmup_);
  const double ratio = span > 0 ? static_cast<double>(iter - warmup_) / span : 1.0;
  const double coeff = style_ == "linear" ? 1.0 - ratio : 0.5 * (std::cos(M_PI * ratio) + 1.0);
  return min_lr_ + coeff * (max_lr_ - min_lr_);
}

}  // namespace tessera
