// optimizer.cpp: AdamW and gradient clipping.
#include "step/optimizer.hpp"

namespace tessera {

AdamW::AdamW(ParamStore& params, Backend& backend, double beta1, double beta2, double eps)
    : params_(params), be_(backend) {
  hyper_.beta1 = beta1;
  hyper_.beta2 = beta2;
  hyper_.eps = eps;
  AllocationLabel label("the Adam moments (2 x fp32 per parameter)");
  m_ = Tensor({params.numel()}, DType::F32, backend.allocator());
  v_ = Tensor({params.numel()}, DType::F32, backend.allocator());
  be_.zero(m_);
  be_.zero(v_);
}

void AdamW::step(double lr, double weight_decay, double grad_scale) {
  ++step_;
  hyper_.lr = lr;
  hyper_.grad_scale = grad_scale;
  if (segments_.empty()) {  // adjacent parameters that both decay, or both not, make one segment
    for (size_t i = 0; i < params_.specs().size(); ++i) {
      const ParamSpec& s = params_.specs()[i];
      if (i < skip_.size() && skip_[i]) continue;
      const int64_t end = s.flat_offset + s.numel();
      if (!segments_.empty() && segments_.back().end == s.flat_offset &&
          decays_.back() == s.weight_decay) {
        segments_.back().end = end;
      } else {
        segments_.push_back({s.flat_offset, end, 0.0});
        decays_.push_back(s.weight_decay);
      }
    }
  }
  for (size_t i = 0; i < segments_.size(); ++i)
    segments_[i].weight_decay = decays_[i] ? weight_decay : 0.0;
  // Mixed precision: the compute copy is written in the same pass (no cast pass after it).
  Tensor* compute = params_.compute_dtype() != DType::F32 ? &params_.flat_compute() : nullptr;
  be_.adamw_step_flat(params_.flat_params(), params_.flat_grads(), m_, v_, segments_, hyper_, step_,
                      compute);
}

double grad_sum_squares(ParamStore& params, Backend& backend) {
  return backend.sum_squares(params.flat_grads());
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double coef = max_norm / (norm + 1e-6);
  return coef >= 1.0 ? 1.0 : coef;
}

double clip_grads(ParamStore& params, Backend& backend, double norm, double max_norm) {
  const double coef = clip_coefficient(norm, max_norm);
  if (coef != 1.0) backend.scale(params.flat_grads(), static_cast<float>(coef));
  return coef;
}

}  // namespace tessera
