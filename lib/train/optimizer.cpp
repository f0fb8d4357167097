// optimizer.cpp: AdamW and gradient clipping.
#include "train/optimizer.hpp"

namespace tessera {

AdamW::AdamW(ParamStore& params, Backend& backend, double beta1, double beta2, double eps,
             double weight_decay)
    : params_(params), be_(backend), weight_decay_(weight_decay) {
  hyper_.beta1 = beta1;
  hyper_.beta2 = beta2;
  hyper_.eps = eps;
  AllocationLabel label("the Adam moments (2 x fp32 per parameter)");
  m_ = Tensor({params.numel()}, DType::F32, backend.allocator());
  v_ = Tensor({params.numel()}, DType::F32, backend.allocator());
  be_.zero(m_);
  be_.zero(v_);
}

void AdamW::step(double lr) {
  ++step_;
  hyper_.lr = lr;
  for (const ParamSpec& s : params_.specs()) {
    Tensor p = params_.param(s);
    const Tensor g = params_.grad(s);
    Tensor m = m_.view(s.flat_offset, s.local_shape), v = v_.view(s.flat_offset, s.local_shape);
    be_.adamw_step(p, g, m, v, hyper_, s.weight_decay ? weight_decay_ : 0.0, step_);
  }
}

double grad_sum_squares(ParamStore& params, Backend& backend) {
  return backend.sum_squares(params.flat_grads());
}

double clip_grads(ParamStore& params, Backend& backend, double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return 1.0;
  backend.scale(params.flat_grads(), static_cast<float>(coef));
  return coef;
}

}  // namespace tessera
