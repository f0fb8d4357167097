// optimizer.hpp: AdamW with fp32 moments over a ParamStore, global-norm gradient clipping.
#pragma once

#include <vector>

#include "backend/backend.hpp"
#include "model/params.hpp"

namespace tessera {

class AdamW {
 public:
  AdamW(ParamStore& params, Backend& backend, double beta1, double beta2, double eps);
  // One update with learning rate lr and weight decay wd (the schedules' values of this step);
  // the decay only for parameters whose spec says so. Each gradient is multiplied by
  // `grad_scale` as it is read (clip_coefficient's factor: the clip without a pass of its own).
  // In mixed precision the bf16/f16 compute copy of the weights is refreshed in the same pass.
  void step(double lr, double weight_decay, double grad_scale = 1.0);
  // The parameters another optimizer updates (Muon's matrices: `skip[i]` for spec i): this one
  // leaves them alone. Before the first step.
  void skip_params(std::vector<bool> skip) { skip_ = std::move(skip); }
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }
  Tensor& exp_avg() { return m_; }
  Tensor& exp_avg_sq() { return v_; }

 private:
  ParamStore& params_;
  Backend& be_;
  AdamWHyper hyper_;
  Tensor m_, v_;  // flat, same layout as the parameters
  // The flat buffer cut where the decay starts or stops, built on the first step; decays_[i]:
  // segment i takes the step's weight decay (else 0).
  std::vector<AdamWSegment> segments_;
  std::vector<bool> decays_;
  std::vector<bool> skip_;
  int64_t step_ = 0;
};

// Sum of squares of this rank's gradients (the caller reduces it across ranks and takes the root).
double grad_sum_squares(ParamStore& params, Backend& backend);
// torch's clip_grad_norm_ factor: max_norm / (norm + 1e-6) when that is below 1, else 1 (and 1
// without clipping, max_norm <= 0). The optimizers apply it as they read the gradients.
double clip_coefficient(double norm, double max_norm);
// Scales all gradients by clip_coefficient in a pass of their own; returns the factor.
double clip_grads(ParamStore& params, Backend& backend, double norm, double max_norm);

}  // namespace tessera
