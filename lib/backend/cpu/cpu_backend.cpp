// cpu_backend.cpp: the reference backend: the templated kernels of backend/cpu/ on host tensors;
// f32 in place, bf16/f16 through f32 copies (compute in f32, round on store).
#include <cstring>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cpu/attention.hpp"
#include "backend/cpu/cross_entropy.hpp"
#include "backend/cpu/dropout.hpp"
#include "backend/cpu/embedding.hpp"
#include "backend/cpu/fp8.hpp"
#include "backend/cpu/gelu.hpp"
#include "backend/cpu/layernorm.hpp"
#include "backend/cpu/matmul.hpp"
#include "backend/cpu/optim.hpp"
#include "backend/cpu/ring_attention.hpp"
#include "backend/cpu/rmsnorm.hpp"
#include "backend/cpu/rope.hpp"
#include "backend/cpu/swiglu.hpp"

namespace tessera {

namespace {

int64_t rows_of(const Tensor& t) {
  return t.numel() / t.shape().back();
}
int64_t cols_of(const Tensor& t) {
  return t.shape().back();
}

// The dropout the kernels should apply: none when absent or at p = 0.
const AttentionDropout* live(const AttentionDropout* d) {
  return d && d->spec.active() ? d : nullptr;
}

bool is_float(DType d) {
  return d == DType::F32 || d == DType::BF16 || d == DType::F16;
}

// A float pointer to a host tensor of any floating dtype, for the f32 kernels. An f32 tensor is
// used in place; a bf16 or f16 one (mixed precision) through an f32 copy, which an output view
// rounds back into the tensor when it goes out of scope. So every precision runs the same
// reference kernels: compute in f32, store in the tensor's dtype.
class F32 {
 public:
  F32(const Tensor& t, bool read, bool write, const char* what) : t_(t), write_(write) {
    TESSERA_CHECK(t.defined(), what, " is undefined");
    TESSERA_CHECK(t.device() == Device::CPU && is_float(t.dtype()), what,
                  " must be a floating-point host tensor for the CPU backend (got ",
                  dtype_name(t.dtype()), " on ", device_name(t.device()), ")");
    if (t.dtype() == DType::F32) {
      p_ = t.data<float>();
      return;
    }
    copy_.resize(static_cast<size_t>(t.numel()));
    p_ = copy_.data();
    if (!read) return;
    const uint16_t* h = t.data<uint16_t>();
    if (t.dtype() == DType::BF16)
      for (size_t i = 0; i < copy_.size(); ++i) copy_[i] = bf16_to_f32(h[i]);
    else
      for (size_t i = 0; i < copy_.size(); ++i) copy_[i] = f16_to_f32(h[i]);
  }
  ~F32() {
    if (!write_ || t_.dtype() == DType::F32) return;
    uint16_t* h = t_.data<uint16_t>();
    if (t_.dtype() == DType::BF16)
      for (size_t i = 0; i < copy_.size(); ++i) h[i] = f32_to_bf16(copy_[i]);
    else
      for (size_t i = 0; i < copy_.size(); ++i) h[i] = f32_to_f16(copy_[i]);
  }
  F32(const F32&) = delete;
  F32& operator=(const F32&) = delete;
  float* get() const { return p_; }

 private:
  const Tensor& t_;
  bool write_;
  float* p_ = nullptr;
  std::vector<float> copy_;
};
// The views an op needs, named after the tensor they view (for the error messages).
#define TESSERA_F32_IN(name, t) F32 name(t, true, false, #t)
#define TESSERA_F32_OUT(name, t) F32 name(t, false, true, #t)
#define TESSERA_F32_INOUT(name, t) F32 name(t, true, true, #t)

const int32_t* ids_of(const Tensor& t, const char* what) {
  TESSERA_CHECK(t.device() == Device::CPU && t.dtype() == DType::I32, what,
                " must be an i32 host tensor");
  return t.i32();
}

// The document tables of an attention call of `rows` rows, as host pointers (null when absent).
struct DocTables {
  const int32_t* key_begin = nullptr;
  const int32_t* positions = nullptr;
};
DocTables doc_tables(const AttentionDocuments* docs, int64_t rows) {
  DocTables t;
  if (!docs) return t;
  for (const Tensor* x : {docs->key_begin, docs->positions})
    TESSERA_CHECK(!x || x->numel() == rows, "attention documents: a table of ", x->numel(),
                  " rows for ", rows, " query rows");
  if (docs->key_begin) t.key_begin = ids_of(*docs->key_begin, "the documents' key_begin");
  if (docs->positions) t.positions = ids_of(*docs->positions, "the documents' positions");
  return t;
}

// A ring block's document tables: the whole samples', (B, cp*T) by global position.
cpu::ring::RingDocs ring_docs(const RingBlockSpec& b, const RingShape& r) {
  const DocTables t = doc_tables(b.docs, r.B * b.cp * r.T);
  return {t.key_begin, t.positions};
}

// fp8(t * scale) / scale of a host tensor, in an f32 copy (op.scale: a (1) f32 host tensor).
std::vector<float> dequantized(const Tensor& t, const Backend::Fp8Operand& op) {
  TESSERA_CHECK(op.scale && op.scale->numel() == 1 && op.scale->dtype() == DType::F32 &&
                    op.scale->device() == Device::CPU,
                "fp8 operand without a (1) f32 host scale");
  TESSERA_F32_IN(v, t);
  std::vector<float> q(static_cast<size_t>(t.numel()));
  cpu::fp8_quantize_dequantize(q.data(), v.get(), t.numel(), op.scale->data<float>()[0], op.format);
  return q;
}

// out (N,OC) += bias (OC), the bias read in its own precision.
void add_bias(float* out, const Tensor& bias, int64_t N, int64_t OC) {
  TESSERA_F32_IN(b, bias);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) out[n * OC + o] += b.get()[o];
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
  void cast(Tensor& dst, const Tensor& src) override {
    TESSERA_CHECK(dst.numel() == src.numel(), "cast shapes");
    if (dst.dtype() == src.dtype()) {
      if (dst.raw() != src.raw()) std::memcpy(dst.raw(), src.raw(), src.nbytes());
      return;
    }
    TESSERA_F32_IN(s_, src);
    TESSERA_F32_OUT(d_, dst);
    std::memcpy(d_.get(), s_.get(), sizeof(float) * static_cast<size_t>(src.numel()));
  }

  void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                         int64_t row_begin) override {
    TESSERA_CHECK(ids.numel() == rows_of(out) && cols_of(table) == cols_of(out),
                  "embedding shapes");
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_IN(tb, table);
    cpu::embedding_forward(o.get(), ids_of(ids, "ids"), tb.get(), ids.numel(), cols_of(out),
                           row_begin, rows_of(table));
  }
  void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                          int64_t row_begin) override {
    TESSERA_CHECK(ids.numel() == rows_of(dout), "embedding backward shapes");
    TESSERA_F32_INOUT(dt, dtable);
    TESSERA_F32_IN(d, dout);
    cpu::embedding_backward(dt.get(), d.get(), ids_of(ids, "ids"), ids.numel(), cols_of(dout),
                            row_begin, rows_of(dtable));
  }
  void position_embedding_forward(Tensor& out, const Tensor& wpe) override {
    TESSERA_CHECK(out.ndim() == 3 && out.dim(1) <= wpe.dim(0), "position embedding shapes");
    TESSERA_F32_INOUT(o, out);
    TESSERA_F32_IN(w, wpe);
    cpu::position_embedding_forward(o.get(), w.get(), out.dim(0), out.dim(1), out.dim(2));
  }
  void position_embedding_backward(Tensor& dwpe, const Tensor& dout) override {
    TESSERA_CHECK(dout.ndim() == 3 && dout.dim(1) <= dwpe.dim(0), "position embedding shapes");
    TESSERA_F32_INOUT(dw, dwpe);
    TESSERA_F32_IN(d, dout);
    cpu::position_embedding_backward(dw.get(), d.get(), dout.dim(0), dout.dim(1), dout.dim(2));
  }

  void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                         const Tensor& weight, const Tensor& bias, double eps) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    TESSERA_CHECK(out.numel() == inp.numel() && mean.numel() == N && rstd.numel() == N &&
                      weight.numel() == C && bias.numel() == C,
                  "layernorm shapes");
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_OUT(mu, mean);
    TESSERA_F32_OUT(rs, rstd);
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(w, weight);
    TESSERA_F32_IN(b, bias);
    cpu::layernorm_forward(o.get(), mu.get(), rs.get(), x.get(), w.get(), b.get(), N, C, eps);
  }
  void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout,
                          const Tensor& inp, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel(), "layernorm shapes");
    TESSERA_F32_INOUT(dx, dinp);
    TESSERA_F32_INOUT(dw, dweight);
    TESSERA_F32_INOUT(db, dbias);
    TESSERA_F32_IN(d, dout);
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(w, weight);
    TESSERA_F32_IN(mu, mean);
    TESSERA_F32_IN(rs, rstd);
    cpu::layernorm_backward(dx.get(), dw.get(), db.get(), d.get(), x.get(), w.get(), mu.get(),
                            rs.get(), N, C);
  }

  void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       double eps) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    TESSERA_CHECK(out.numel() == inp.numel() && rstd.numel() == N && weight.numel() == C,
                  "rmsnorm shapes");
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_OUT(rs, rstd);
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(w, weight);
    cpu::rmsnorm_forward(o.get(), rs.get(), x.get(), w.get(), N, C, eps);
  }
  void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& rstd) override {
    const int64_t N = rows_of(inp), C = cols_of(inp);
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel() &&
                      dweight.numel() == C && rstd.numel() == N,
                  "rmsnorm shapes");
    TESSERA_F32_INOUT(dx, dinp);
    TESSERA_F32_INOUT(dw, dweight);
    TESSERA_F32_IN(d, dout);
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(w, weight);
    TESSERA_F32_IN(rs, rstd);
    cpu::rmsnorm_backward(dx.get(), dw.get(), d.get(), x.get(), w.get(), rs.get(), N, C);
  }

  void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                      const Tensor* bias) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    TESSERA_CHECK(cols_of(weight) == IC && out.numel() == N * OC && (!bias || bias->numel() == OC),
                  "matmul shapes: inp ", shape_str(inp.shape()), " weight ",
                  shape_str(weight.shape()), " out ", shape_str(out.shape()));
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(w, weight);
    std::unique_ptr<F32> b;
    if (bias) b = std::make_unique<F32>(*bias, true, false, "bias");
    cpu::matmul_forward(o.get(), x.get(), w.get(), b ? b->get() : nullptr, N, IC, OC);
  }
  void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    const bool weights = dweight.defined();  // else the input gradient alone (a B pass)
    TESSERA_CHECK(dout.numel() == N * OC && (!weights || dweight.numel() == OC * IC) &&
                      (!dinp || dinp->numel() == N * IC),
                  "matmul backward shapes");
    std::unique_ptr<F32> dx, dw, db;
    if (dinp) dx = std::make_unique<F32>(*dinp, false, true, "dinp");
    if (weights) dw = std::make_unique<F32>(dweight, true, true, "dweight");
    if (weights && dbias) db = std::make_unique<F32>(*dbias, true, true, "dbias");
    TESSERA_F32_IN(d, dout);
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(w, weight);
    cpu::matmul_backward(dx ? dx->get() : nullptr, dw ? dw->get() : nullptr,
                         db ? db->get() : nullptr, d.get(), x.get(), w.get(), N, IC, OC);
  }

  // FP8: the exact emulation (backend/cpu/fp8.hpp): quantized operands dequantized into f32
  // copies, then the f32 GEMMs above.
  void fp8_amax(Tensor& amax, const Tensor& x, bool accumulate) override {
    TESSERA_CHECK(amax.numel() == 1 && amax.dtype() == DType::F32,
                  "fp8_amax: amax must be (1) f32");
    TESSERA_F32_IN(xs, x);
    const float m = cpu::fp8_amax(xs.get(), x.numel());
    float& a = amax.data<float>()[0];
    a = accumulate && a > m ? a : m;
  }
  void fp8_current_scale(Tensor& scale, const Tensor& amax, Fp8Format format) override {
    TESSERA_CHECK(amax.numel() == 1 && scale.numel() == 1 && amax.dtype() == DType::F32 &&
                      scale.dtype() == DType::F32,
                  "fp8_current_scale: (1) f32 tensors");
    scale.data<float>()[0] = cpu::fp8_current_scale(amax.data<float>()[0], format);
  }
  void fp8_delayed_update(Tensor& history, Tensor& scale, Tensor& amax, const Tensor& fp8_max,
                          bool most_recent, int margin) override {
    const int64_t n = scale.numel();
    TESSERA_CHECK(n > 0 && amax.numel() == n && fp8_max.numel() == n && history.numel() % n == 0,
                  "fp8_delayed_update shapes");
    const int64_t H = history.numel() / n;
    float* h = history.data<float>();
    float* s = scale.data<float>();
    float* a = amax.data<float>();
    const float* fm = fp8_max.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      cpu::fp8_delayed_update(h + i, H, n, s[i], a[i], fm[i], most_recent, margin);
      a[i] = 0;
    }
  }
  void fp8_matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                          const Fp8Operand& x, const Fp8Operand& w) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    TESSERA_CHECK(cols_of(weight) == IC && out.numel() == N * OC && (!bias || bias->numel() == OC),
                  "fp8 matmul shapes: inp ", shape_str(inp.shape()), " weight ",
                  shape_str(weight.shape()), " out ", shape_str(out.shape()));
    const std::vector<float> xq = dequantized(inp, x), wq = dequantized(weight, w);
    TESSERA_F32_OUT(o, out);
    cpu::matmul_forward(o.get(), xq.data(), wq.data(), static_cast<const float*>(nullptr), N, IC,
                        OC);
    if (bias) add_bias(o.get(), *bias, N, OC);
  }
  void fp8_matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                           const Tensor& inp, const Tensor& weight, const Fp8Operand& g,
                           const Fp8Operand& x, const Fp8Operand& w) override {
    const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
    TESSERA_CHECK(
        dout.numel() == N * OC && dweight.numel() == OC * IC && (!dinp || dinp->numel() == N * IC),
        "fp8 matmul backward shapes");
    const std::vector<float> gq = dequantized(dout, g), xq = dequantized(inp, x),
                             wq = dequantized(weight, w);
    std::unique_ptr<F32> dx;
    if (dinp) dx = std::make_unique<F32>(*dinp, false, true, "dinp");
    TESSERA_F32_INOUT(dw, dweight);
    cpu::matmul_backward(dx ? dx->get() : nullptr, dw.get(), static_cast<float*>(nullptr),
                         gq.data(), xq.data(), wq.data(), N, IC, OC);
    if (dbias) {  // from the unquantized gradient
      TESSERA_F32_INOUT(db, *dbias);
      TESSERA_F32_IN(d, dout);
      float* dbp = db.get();
      const float* dp = d.get();
#pragma omp parallel for schedule(static)
      for (int64_t o = 0; o < OC; ++o) {  // matmul_backward's sum, in its order
        float sum = 0;
        for (int64_t n = 0; n < N; ++n) sum += dp[n * OC + o];
        dbp[o] += sum;
      }
    }
  }

  void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads,
                         const AttentionDropout* drop, int64_t kv_heads,
                         const AttentionAlibi* alibi, const AttentionDocuments* docs) override {
    const int64_t G = kv_heads > 0 ? kv_heads : heads;
    TESSERA_CHECK(qkv.ndim() == 3 && heads % G == 0 && qkv.dim(2) % (heads + 2 * G) == 0,
                  "attention qkv shape ", shape_str(qkv.shape()), " for ", heads, " heads and ", G,
                  " key/value heads");
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (heads + 2 * G);
    TESSERA_CHECK(out.numel() == B * T * heads * hd && lse.numel() == B * heads * T,
                  "attention output shapes");
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_OUT(l, lse);
    TESSERA_F32_IN(q, qkv);
    check_alibi_heads(alibi, heads);
    const DocTables dt = doc_tables(docs, B * T);
    cpu::attention_forward(o.get(), l.get(), q.get(), B, T, heads, hd, scratch(T), live(drop), G,
                           alibi, dt.key_begin, dt.positions);
  }
  void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int64_t heads, const AttentionDropout* drop,
                          int64_t kv_heads, const AttentionAlibi* alibi,
                          const AttentionDocuments* docs) override {
    const int64_t G = kv_heads > 0 ? kv_heads : heads;
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (heads + 2 * G);
    TESSERA_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == out.numel(),
                  "attention backward shapes");
    TESSERA_F32_OUT(dq, dqkv);
    TESSERA_F32_IN(d, dout);
    TESSERA_F32_IN(q, qkv);
    TESSERA_F32_IN(o, out);
    TESSERA_F32_IN(l, lse);
    check_alibi_heads(alibi, heads);
    const DocTables dt = doc_tables(docs, B * T);
    cpu::attention_backward(dq.get(), d.get(), q.get(), o.get(), l.get(), B, T, heads, hd,
                            scratch(T), live(drop), G, alibi, dt.key_begin, dt.positions);
  }

  void ring_block_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv,
                          const RingBlock& blk) override {
    const RingShape r = check_ring_block(qkv, kv, blk);
    TESSERA_CHECK(out.numel() == r.B * blk.nq * blk.heads * r.hd &&
                      lse.numel() == r.B * blk.heads * blk.nq && lse.dtype() == DType::F32,
                  "ring block: out must be (B,nq,H*hd) and lse (B,H,nq) f32");
    check_alibi_heads(blk.alibi, blk.heads);
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_IN(q, qkv);
    TESSERA_F32_IN(k, kv);
    cpu::ring::ring_block_forward(o.get(), lse.data<float>(), q.get(), k.get(), r.B, r.T, r.hd, blk,
                                  ring_docs(blk, r));
  }
  void ring_block_backward(Tensor& dqkv, Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                           const Tensor& kv, const Tensor& out, const Tensor& lse,
                           const RingBlock& blk) override {
    const RingShape r = check_ring_block(qkv, kv, blk);
    TESSERA_CHECK(dqkv.numel() == qkv.numel() && dkv.numel() == kv.numel() &&
                      dout.numel() == r.B * r.T * blk.heads * r.hd && out.numel() == dout.numel() &&
                      lse.numel() == r.B * blk.heads * r.T && lse.dtype() == DType::F32,
                  "ring block backward shapes");
    check_alibi_heads(blk.alibi, blk.heads);
    TESSERA_F32_INOUT(dq, dqkv);
    TESSERA_F32_INOUT(dk, dkv);
    TESSERA_F32_IN(d, dout);
    TESSERA_F32_IN(q, qkv);
    TESSERA_F32_IN(k, kv);
    TESSERA_F32_IN(o, out);
    cpu::ring::ring_block_backward(dq.get(), dk.get(), d.get(), q.get(), k.get(), o.get(),
                                   lse.data<float>(), r.B, r.T, r.hd, blk, ring_docs(blk, r));
  }
  void attention_merge(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse,
                       int64_t q0) override {
    const MergeShape m = check_attention_merge(out, lse, part_out, part_lse, q0);
    TESSERA_F32_INOUT(o, out);
    TESSERA_F32_IN(p, part_out);
    cpu::ring::merge_block(o.get(), lse.data<float>(), p.get(), part_lse.data<float>(), m.B, m.T,
                           m.H, m.hd, q0, m.nq);
  }
  void copy_columns(Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                    int64_t cols) override {
    const ColumnCopy c = check_copy_columns(dst, dst_col, src, src_col, cols);
    TESSERA_CHECK(dst.device() == Device::CPU && src.device() == Device::CPU,
                  "copy_columns: host tensors");
    const size_t e = dtype_size(dst.dtype());
    const char* in = static_cast<const char*>(src.raw());
    char* o = static_cast<char*>(dst.raw());
    for (int64_t r = 0; r < c.rows; ++r)
      std::memcpy(o + (r * c.dst_width + dst_col) * e, in + (r * c.src_width + src_col) * e,
                  static_cast<size_t>(cols) * e);
  }

  void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                    const std::vector<KvSegment>& segments, int64_t heads, int64_t kv_heads,
                    const AttentionAlibi* alibi) override {
    const int64_t G = check_kv_attention(out, qkv, k_cache, v_cache, segments, heads, kv_heads);
    const int64_t hd = k_cache.dim(3), Tmax = k_cache.dim(2);
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_IN(q, qkv);
    // A bf16/f16 cache (a bf16 model's generation) through f32 copies of the whole cache, read
    // and written back: the reference for the CUDA kernels, not a fast path.
    F32 kc(k_cache, true, true, "k cache"), vc(v_cache, true, true, "v cache");
    check_alibi_heads(alibi, heads);
    cpu::kv_attention(o.get(), q.get(), kc.get(), vc.get(), segments, heads, hd, Tmax, G, alibi);
  }

  void gelu_forward(Tensor& out, const Tensor& inp) override {
    TESSERA_CHECK(out.numel() == inp.numel(), "gelu shapes");
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_IN(x, inp);
    cpu::gelu_forward(o.get(), x.get(), inp.numel());
  }
  void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel(), "gelu shapes");
    if (dinp.dtype() == DType::F32) {  // in place allowed (dinp may be dout)
      cpu::gelu_backward(dinp.f32(), F32(inp, true, false, "inp").get(), dout.f32(), inp.numel());
      return;
    }
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(d, dout);
    TESSERA_F32_OUT(dx, dinp);
    cpu::gelu_backward(dx.get(), x.get(), d.get(), inp.numel());
  }
  void squared_relu_forward(Tensor& out, const Tensor& inp) override {
    TESSERA_CHECK(out.numel() == inp.numel(), "squared relu shapes");
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_IN(x, inp);
    cpu::squared_relu_forward(o.get(), x.get(), inp.numel());
  }
  void squared_relu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel(),
                  "squared relu shapes");
    if (dinp.dtype() == DType::F32) {  // in place allowed (dinp may be dout)
      cpu::squared_relu_backward(dinp.f32(), F32(inp, true, false, "inp").get(), dout.f32(),
                                 inp.numel());
      return;
    }
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(d, dout);
    TESSERA_F32_OUT(dx, dinp);
    cpu::squared_relu_backward(dx.get(), x.get(), d.get(), inp.numel());
  }
  void swiglu_forward(Tensor& out, const Tensor& inp) override {
    const int64_t N = rows_of(inp), F = cols_of(inp) / 2;
    TESSERA_CHECK(cols_of(inp) % 2 == 0 && out.numel() == N * F, "swiglu shapes");
    TESSERA_F32_OUT(o, out);
    TESSERA_F32_IN(x, inp);
    cpu::swiglu_forward(o.get(), x.get(), N, F);
  }
  void swiglu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    const int64_t N = rows_of(inp), F = cols_of(inp) / 2;
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == N * F, "swiglu shapes");
    TESSERA_F32_OUT(dx, dinp);
    TESSERA_F32_IN(x, inp);
    TESSERA_F32_IN(d, dout);
    cpu::swiglu_backward(dx.get(), x.get(), d.get(), N, F);
  }
  void rope(Tensor& qkv, const RopeSpec& r, const Tensor* positions, bool inverse) override {
    const int64_t N = rows_of(qkv);
    TESSERA_CHECK(cols_of(qkv) == (r.heads + 2 * r.kv_heads) * r.head_dim && r.rot_dim % 2 == 0 &&
                      r.rot_dim <= r.head_dim && (positions || r.seq_len > 0) &&
                      (!positions || positions->numel() == N),
                  "rope shapes: qkv ", shape_str(qkv.shape()));
    TESSERA_F32_INOUT(x, qkv);
    cpu::rope(x.get(), N, r.heads, r.kv_heads, r.head_dim, r.rot_dim, r.base,
              positions ? ids_of(*positions, "positions") : nullptr, r.seq_len, inverse, r.scaling,
              r.interleaved);
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override {
    TESSERA_CHECK(out.numel() == a.numel() && a.numel() == b.numel(), "add shapes");
    TESSERA_F32_IN(x, a);
    TESSERA_F32_IN(y, b);
    TESSERA_F32_OUT(o, out);
    cpu::add(o.get(), x.get(), y.get(), a.numel());
  }
  void dropout(Tensor& out, const Tensor& in, const DropoutSpec& d, int64_t row_begin,
               int64_t seq_len) override {
    TESSERA_CHECK(out.numel() == in.numel() && in.ndim() >= 1 && seq_len > 0, "dropout shapes");
    const int64_t C = in.dim(in.ndim() - 1), rows = in.numel() / C;
    if (out.dtype() == DType::F32 && in.dtype() == DType::F32) {  // in place allowed
      cpu::dropout(out.f32(), in.f32(), d, rows, C, row_begin, seq_len);
      return;
    }
    TESSERA_F32_IN(x, in);
    TESSERA_F32_OUT(o, out);
    cpu::dropout(o.get(), x.get(), d, rows, C, row_begin, seq_len);
  }

  void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid_cols) override {
    TESSERA_F32_OUT(m, rowmax);
    TESSERA_F32_IN(lg, logits);
    cpu::xent_row_max(m.get(), lg.get(), rows_of(logits), cols_of(logits), valid_cols);
  }
  void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits,
                     const Tensor& rowmax, const Tensor& targets, int64_t valid_cols,
                     int64_t col_begin) override {
    TESSERA_CHECK(targets.numel() == rows_of(logits), "cross-entropy targets shape");
    TESSERA_F32_OUT(se, sumexp);
    TESSERA_F32_OUT(tl, target_logit);
    TESSERA_F32_IN(lg, logits);
    TESSERA_F32_IN(m, rowmax);
    cpu::xent_row_sums(se.get(), tl.get(), lg.get(), m.get(), ids_of(targets, "targets"),
                       rows_of(logits), cols_of(logits), valid_cols, col_begin);
  }
  void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax,
                          const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets,
                          int64_t valid_cols, int64_t col_begin, float grad_scale) override {
    TESSERA_F32_OUT(l, losses);
    TESSERA_F32_INOUT(lg, logits);
    TESSERA_F32_IN(m, rowmax);
    TESSERA_F32_IN(se, sumexp);
    TESSERA_F32_IN(tl, target_logit);
    cpu::xent_loss_and_grad(l.get(), lg.get(), m.get(), se.get(), tl.get(),
                            ids_of(targets, "targets"), rows_of(logits), cols_of(logits),
                            valid_cols, col_begin, grad_scale);
  }

  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                  double weight_decay, int64_t step) override {
    TESSERA_CHECK(
        grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
        "adamw shapes");
    TESSERA_CHECK(param.dtype() == DType::F32 && grad.dtype() == DType::F32 &&
                      m.dtype() == DType::F32 && v.dtype() == DType::F32,
                  "AdamW runs on the f32 master weights, gradients and moments");
    cpu::adamw_step(param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), h.lr, h.beta1,
                    h.beta2, h.eps, weight_decay, step, h.grad_scale);
  }
  double sum_squares(const Tensor& x) override {
    TESSERA_F32_IN(v, x);
    return cpu::sum_squares(v.get(), x.numel());
  }
  void scale(Tensor& x, float s) override {
    TESSERA_F32_INOUT(v, x);
    cpu::scale_inplace(v.get(), x.numel(), s);
  }
  void gemm(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha,
            float beta) override {
    if (c.ndim() == 3 && a.ndim() == 3 && b.ndim() == 3 && a.dim(0) == c.dim(0) &&
        b.dim(0) == c.dim(0)) {  // a batch: each matrix in turn
      const Shape cs{c.dim(1), c.dim(2)}, as{a.dim(1), a.dim(2)}, bs{b.dim(1), b.dim(2)};
      for (int64_t i = 0; i < c.dim(0); ++i) {
        Tensor ci = c.view(i * cs[0] * cs[1], cs);
        gemm(ci, a.view(i * as[0] * as[1], as), ta, b.view(i * bs[0] * bs[1], bs), tb, alpha, beta);
      }
      return;
    }
    TESSERA_CHECK(a.dtype() == DType::F32 && b.dtype() == DType::F32 && c.dtype() == DType::F32 &&
                      a.shape().size() == 2 && b.shape().size() == 2 && c.shape().size() == 2,
                  "gemm: 2-D (or a batch of 3-D) f32 tensors on the CPU, got ",
                  shape_str(a.shape()), " ", shape_str(b.shape()), " ", shape_str(c.shape()));
    const int64_t M = c.dim(0), N = c.dim(1), K = ta ? a.dim(0) : a.dim(1);
    TESSERA_CHECK((ta ? a.dim(1) : a.dim(0)) == M && (tb ? b.dim(0) : b.dim(1)) == N &&
                      (tb ? b.dim(1) : b.dim(0)) == K,
                  "gemm: shapes ", shape_str(a.shape()), " x ", shape_str(b.shape()), " -> ",
                  shape_str(c.shape()));
    cpu::gemm(ta, tb, M, N, K, alpha, a.f32(), a.dim(1), b.f32(), b.dim(1), beta, c.f32(), N);
  }

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
