// cpu_backend.cpp: the reference backend: the templated kernels of backend/cpu/ on f32 host
// tensors.
#include <cstring>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cpu/attention.hpp"
#include "backend/cpu/cross_entropy.hpp"
#include "backend/cpu/embedding.hpp"
#include "backend/cpu/gelu.hpp"
#include "backend/cpu/layernorm.hpp"
#include "backend/cpu/matmul.hpp"
#include "backend/cpu/optim.hpp"

namespace tessera {

namespace {

int64_t rows_of(const Tensor& t) {
  return t.numel() / t.shape().back();
}
int64_t cols_of(const Tensor& t) {
  return t.shape().back();
}

void expect_cpu_f32(const Tensor& t, const char* what) {
  TESSERA_CHECK(t.defined(), what, " is undefined");
  TESSERA_CHECK(t.device() == Device::CPU && t.dtype() == DType::F32, what,
                " must be an f32 host tensor for the CPU backend");
}

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::CPU; }
  const char* name() const override { return "cpu"; }
  Allocator& allocator() override { return cpu_allocator(); }

  void zero(Tensor& t) override { t.zero_(); }
  void copy_from_host(Tensor& dst, const void* src) override {
    TESSERA_CHECK(dst.device() == Device::CPU, "copy_from_host: not a host tensor");
    std::memcpy(dst.raw(), src, dst.nbytes());
  }
  void copy_to_host(void* dst, const Tensor& src) override {
    TESSERA_CHECK(src.device() == Device::CPU, "copy_to_host: not a host tensor");
    std::memcpy(dst, src.raw(), src.nbytes());
  }

  void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                         int64_t row_begin) override {
    expect_cpu_f32(out, "embedding output");
    TESSERA_CHECK(ids.numel() == rows_of(out) && cols_of(table) == cols_of(out),
                  "embedding shapes");
    cpu::embedding_forward(out.f32(), ids.i32(), table.f32(), ids.numel(), cols_of(out), row_begin,
                           rows_of(table));
  }
  void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                          int64_t row_begin) override {
    TESSERA_CHECK(ids.numel() == rows_of(dout), "embedding backward shapes");
    cpu::embedding_backward(dtable.f32(), dout.f32(), ids.i32(), ids.numel(), cols_of(dout),
                            row_begin, rows_of(dtable));
  }
  void position_embedding_forward(Tensor& out, const Tensor& wpe) override {
    TESSERA_CHECK(out.ndim() == 3 && out.dim(1) <= wpe.dim(0), "position embedding shapes");
    cpu::position_embedding_forward(out.f32(), wpe.f32(), out.dim(0), out.dim(1), out.dim(2));
  }
  void position_embedding_backward(Tensor& dwpe, const Tensor& dout) override {
    TESSERA_CHECK(dout.ndim() == 3 && dout.dim(1) <= dwpe.dim(0), "position embedding shapes");
    cpu::position_embedding_backward(dwpe.f32(), dout.f32(), dout.dim(0), dout.dim(1), dout.dim(2));
  }

  void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                         const Tensor& weight, const Tensor& bias, double eps) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    TESSERA_CHECK(out.numel() == inp.numel() && mean.numel() == N && rstd.numel() == N &&
                      weight.numel() == C && bias.numel() == C,
                  "layernorm shapes");
    cpu::layernorm_forward(out.f32(), mean.f32(), rstd.f32(), inp.f32(), weight.f32(), bias.f32(),
                           N, C, eps);
  }
  void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout,
                          const Tensor& inp, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel(), "layernorm shapes");
    cpu::layernorm_backward(dinp.f32(), dweight.f32(), dbias.f32(), dout.f32(), inp.f32(),
                            weight.f32(), mean.f32(), rstd.f32(), N, C);
  }

  void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                      const Tensor* bias) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    TESSERA_CHECK(cols_of(weight) == IC && out.numel() == N * OC && (!bias || bias->numel() == OC),
                  "matmul shapes: inp ", shape_str(inp.shape()), " weight ",
                  shape_str(weight.shape()), " out ", shape_str(out.shape()));
    cpu::matmul_forward(out.f32(), inp.f32(), weight.f32(), bias ? bias->f32() : nullptr, N, IC,
                        OC);
  }
  void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    TESSERA_CHECK(
        dout.numel() == N * OC && dweight.numel() == OC * IC && (!dinp || dinp->numel() == N * IC),
        "matmul backward shapes");
    cpu::matmul_backward(dinp ? dinp->f32() : nullptr, dweight.f32(),
                         dbias ? dbias->f32() : nullptr, dout.f32(), inp.f32(), weight.f32(), N, IC,
                         OC);
  }

  void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads) override {
    TESSERA_CHECK(qkv.ndim() == 3 && qkv.dim(2) % (3 * heads) == 0, "attention qkv shape ",
                  shape_str(qkv.shape()));
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (3 * heads);
    TESSERA_CHECK(out.numel() == B * T * heads * hd && lse.numel() == B * heads * T,
                  "attention output shapes");
    cpu::attention_forward(out.f32(), lse.f32(), qkv.f32(), B, T, heads, hd, scratch(T));
  }
  void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int64_t heads) override {
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (3 * heads);
    TESSERA_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == out.numel(),
                  "attention backward shapes");
    cpu::attention_backward(dqkv.f32(), dout.f32(), qkv.f32(), out.f32(), lse.f32(), B, T, heads,
                            hd, scratch(T));
  }

  void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                    const std::vector<KvSegment>& segments, int64_t heads) override {
    TESSERA_CHECK(k_cache.ndim() == 4 && k_cache.dim(1) == heads, "kv cache shape ",
                  shape_str(k_cache.shape()));
    const int64_t hd = k_cache.dim(3), Tmax = k_cache.dim(2);
    TESSERA_CHECK(cols_of(qkv) == 3 * heads * hd && cols_of(out) == heads * hd,
                  "kv attention shapes");
    for (const KvSegment& s : segments)
      TESSERA_CHECK(s.slot >= 0 && s.slot < k_cache.dim(0) && s.pos0 + s.count <= Tmax &&
                        s.row0 + s.count <= rows_of(qkv),
                    "kv attention segment outside the cache or the rows");
    cpu::kv_attention(out.f32(), qkv.f32(), k_cache.f32(), v_cache.f32(), segments, heads, hd,
                      Tmax);
  }

  void gelu_forward(Tensor& out, const Tensor& inp) override {
    TESSERA_CHECK(out.numel() == inp.numel(), "gelu shapes");
    cpu::gelu_forward(out.f32(), inp.f32(), inp.numel());
  }
  void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel(), "gelu shapes");
    cpu::gelu_backward(dinp.f32(), inp.f32(), dout.f32(), inp.numel());
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override {
    TESSERA_CHECK(out.numel() == a.numel() && a.numel() == b.numel(), "add shapes");
    cpu::add(out.f32(), a.f32(), b.f32(), a.numel());
  }

  void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid_cols) override {
    cpu::xent_row_max(rowmax.f32(), logits.f32(), rows_of(logits), cols_of(logits), valid_cols);
  }
  void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits,
                     const Tensor& rowmax, const Tensor& targets, int64_t valid_cols,
                     int64_t col_begin) override {
    TESSERA_CHECK(targets.numel() == rows_of(logits), "cross-entropy targets shape");
    cpu::xent_row_sums(sumexp.f32(), target_logit.f32(), logits.f32(), rowmax.f32(), targets.i32(),
                       rows_of(logits), cols_of(logits), valid_cols, col_begin);
  }
  void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax,
                          const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets,
                          int64_t valid_cols, int64_t col_begin, float grad_scale) override {
    cpu::xent_loss_and_grad(losses.f32(), logits.f32(), rowmax.f32(), sumexp.f32(),
                            target_logit.f32(), targets.i32(), rows_of(logits), cols_of(logits),
                            valid_cols, col_begin, grad_scale);
  }

  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                  double weight_decay, int64_t step) override {
    TESSERA_CHECK(
        grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
        "adamw shapes");
    cpu::adamw_step(param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), h.lr, h.beta1,
                    h.beta2, h.eps, weight_decay, step);
  }
  double sum_squares(const Tensor& x) override { return cpu::sum_squares(x.f32(), x.numel()); }
  void scale(Tensor& x, float s) override { cpu::scale_inplace(x.f32(), x.numel(), s); }

 private:
  // Grow-only workspace for attention, so steady-state steps allocate nothing.
  float* scratch(int64_t T) {
    const size_t need = static_cast<size_t>(cpu::attention_scratch_elems(T));
    if (scratch_.size() < need) scratch_.resize(need);
    return scratch_.data();
  }
  std::vector<float> scratch_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<CpuBackend>();
}

}  // namespace tessera
