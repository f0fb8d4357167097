// moe_ops.cpp: Backend's default MoE ops: the host reference (backend/cpu/moe.hpp), on the
// tensors themselves for f32 host storage, else staged through f32 host copies.
#include <cstring>

#include "backend/backend.hpp"

namespace tessera {

namespace {

bool direct(const Backend& be, std::initializer_list<const Tensor*> ts) {
  if (be.device() != Device::CPU) return false;
  for (const Tensor* t : ts)
    if (t->dtype() != DType::F32 && t->dtype() != DType::I32) return false;
  return true;
}

// A tensor's values as host f32 (or int32, bit for bit, for I32 tensors).
class HostF32 {
 public:
  HostF32(Backend& be, const Tensor& t, bool read) : be_(be), t_(t) {
    if (t.dtype() == DType::F32 || t.dtype() == DType::I32) {
      data_.resize(static_cast<size_t>(t.numel()));
      if (read) be.copy_to_host(data_.data(), t);
      return;
    }
    TESSERA_CHECK(t.dtype() == DType::BF16 || t.dtype() == DType::F16, "MoE op: dtype ",
                  dtype_name(t.dtype()));
    data_.resize(static_cast<size_t>(t.numel()));
    if (!read) return;
    std::vector<uint16_t> h(static_cast<size_t>(t.numel()));
    be.copy_to_host(h.data(), t);
    for (size_t i = 0; i < h.size(); ++i)
      data_[i] = t.dtype() == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
  }
  float* f() { return data_.data(); }
  int32_t* i() { return reinterpret_cast<int32_t*>(data_.data()); }
  void store(Tensor& dst) {
    if (dst.dtype() == DType::F32 || dst.dtype() == DType::I32) {
      be_.copy_from_host(dst, data_.data());
      return;
    }
    std::vector<uint16_t> h(data_.size());
    for (size_t k = 0; k < h.size(); ++k)
      h[k] = dst.dtype() == DType::BF16 ? f32_to_bf16(data_[k]) : f32_to_f16(data_[k]);
    be_.copy_from_host(dst, h.data());
  }

 private:
  Backend& be_;
  const Tensor& t_;
  std::vector<float> data_;  // int32 tensors are held bit for bit
};

void check_slots(const Tensor& row, int64_t N, int64_t* K) {
  TESSERA_CHECK(row.dtype() == DType::I32 && row.ndim() == 2 && row.dim(0) == N, "MoE op: slots ",
                shape_str(row.shape()), " for ", N, " tokens");
  *K = row.dim(1);
}

int64_t cols(const Tensor& t) {
  return t.shape().back();
}

}  // namespace

int64_t Backend::moe_route(Tensor& expert, Tensor& weight, Tensor& row, const Tensor& logits,
                           const MoERouting& r, int64_t group_rows, std::vector<int64_t>& routed,
                           std::vector<int64_t>& kept) {
  const int64_t N = logits.numel() / r.experts;
  TESSERA_CHECK(logits.dtype() == DType::F32 && cols(logits) == r.experts &&
                    weight.dtype() == DType::F32 && expert.numel() == N * r.topk &&
                    weight.numel() == N * r.topk && row.numel() == N * r.topk,
                "moe_route: shapes");
  if (direct(*this, {&expert, &weight, &row, &logits}))
    return moe_route_host(logits.f32(), N, r, group_rows, expert.i32(), weight.f32(), row.i32(),
                          routed, kept);
  HostF32 z(*this, logits, true), e(*this, expert, false), w(*this, weight, false),
      rw(*this, row, false);
  const int64_t R = moe_route_host(z.f(), N, r, group_rows, e.i(), w.f(), rw.i(), routed, kept);
  e.store(expert);
  w.store(weight);
  rw.store(row);
  return R;
}

void Backend::moe_router_stats(const Tensor& logits, const MoERouting& r, int64_t group_rows,
                               std::vector<double>& score_sums, double& lse_sq_sum) {
  const int64_t N = logits.numel() / r.experts;
  if (direct(*this, {&logits})) {
    moe_router_stats_host(logits.f32(), N, r, group_rows, score_sums, lse_sq_sum);
    return;
  }
  HostF32 z(*this, logits, true);
  moe_router_stats_host(z.f(), N, r, group_rows, score_sums, lse_sq_sum);
}

void Backend::moe_router_backward(Tensor& dlogits, const Tensor& logits, const Tensor& expert,
                                  const Tensor& weight, const Tensor& dweight, const MoERouting& r,
                                  int64_t group_rows, const std::vector<double>& aux_grad,
                                  double z_grad) {
  const int64_t N = logits.numel() / r.experts;
  TESSERA_CHECK(dlogits.shape() == logits.shape() && dweight.numel() == N * r.topk,
                "moe_router_backward: shapes");
  if (direct(*this, {&dlogits, &logits, &expert, &weight, &dweight})) {
    moe_router_backward_host(dlogits.f32(), logits.f32(), N, r, expert.i32(), weight.f32(),
                             dweight.f32(), group_rows, aux_grad, z_grad);
    return;
  }
  HostF32 dz(*this, dlogits, false), z(*this, logits, true), e(*this, expert, true),
      w(*this, weight, true), dw(*this, dweight, true);
  moe_router_backward_host(dz.f(), z.f(), N, r, e.i(), w.f(), dw.f(), group_rows, aux_grad, z_grad);
  dz.store(dlogits);
}

void Backend::moe_permute(Tensor& x_perm, const Tensor& x, const Tensor& row) {
  const int64_t C = cols(x), N = x.numel() / C;
  int64_t K = 0;
  check_slots(row, N, &K);
  TESSERA_CHECK(cols(x_perm) == C, "moe_permute: shapes");
  if (direct(*this, {&x_perm, &x, &row})) {
    moe_permute_host(x_perm.f32(), x.f32(), row.i32(), N, static_cast<int>(K), C);
    return;
  }
  HostF32 xp(*this, x_perm, false), xs(*this, x, true), rw(*this, row, true);
  moe_permute_host(xp.f(), xs.f(), rw.i(), N, static_cast<int>(K), C);
  xp.store(x_perm);
}

void Backend::moe_unpermute(Tensor& y, const Tensor& out, const Tensor& row, const Tensor& weight) {
  const int64_t C = cols(y), N = y.numel() / C;
  int64_t K = 0;
  check_slots(row, N, &K);
  TESSERA_CHECK(cols(out) == C && weight.numel() == N * K, "moe_unpermute: shapes");
  if (direct(*this, {&y, &out, &row, &weight})) {
    moe_unpermute_host(y.f32(), out.f32(), row.i32(), weight.f32(), N, static_cast<int>(K), C);
    return;
  }
  HostF32 yy(*this, y, false), o(*this, out, true), rw(*this, row, true), w(*this, weight, true);
  moe_unpermute_host(yy.f(), o.f(), rw.i(), w.f(), N, static_cast<int>(K), C);
  yy.store(y);
}

void Backend::moe_unpermute_backward(Tensor& dout, Tensor& dweight, const Tensor& dy,
                                     const Tensor& out, const Tensor& row, const Tensor& weight) {
  const int64_t C = cols(dy), N = dy.numel() / C;
  int64_t K = 0;
  check_slots(row, N, &K);
  TESSERA_CHECK(cols(out) == C && cols(dout) == C && dweight.numel() == N * K,
                "moe_unpermute_backward: shapes");
  if (direct(*this, {&dout, &dweight, &dy, &out, &row, &weight})) {
    moe_unpermute_backward_host(dout.f32(), dweight.f32(), dy.f32(), out.f32(), row.i32(),
                                weight.f32(), N, static_cast<int>(K), C);
    return;
  }
  HostF32 d(*this, dout, false), dw(*this, dweight, false), g(*this, dy, true), o(*this, out, true),
      rw(*this, row, true), w(*this, weight, true);
  moe_unpermute_backward_host(d.f(), dw.f(), g.f(), o.f(), rw.i(), w.f(), N, static_cast<int>(K),
                              C);
  d.store(dout);
  dw.store(dweight);
}

void Backend::moe_permute_backward(Tensor& dx, const Tensor& dx_perm, const Tensor& row) {
  const int64_t C = cols(dx), N = dx.numel() / C;
  int64_t K = 0;
  check_slots(row, N, &K);
  TESSERA_CHECK(cols(dx_perm) == C, "moe_permute_backward: shapes");
  if (direct(*this, {&dx, &dx_perm, &row})) {
    moe_permute_backward_host(dx.f32(), dx_perm.f32(), row.i32(), N, static_cast<int>(K), C);
    return;
  }
  HostF32 d(*this, dx, false), dp(*this, dx_perm, true), rw(*this, row, true);
  moe_permute_backward_host(d.f(), dp.f(), rw.i(), N, static_cast<int>(K), C);
  d.store(dx);
}

}  // namespace tessera
