// cuda_backend.cu: the CUDA implementation of the Backend interface. CudaBackend owns the stream,
// the cuBLAS handle, a ring of pinned buffers for small host-to-device copies and the grow-only
// scratch buffers (Workspace); each op checks its arguments and calls its launcher (ops.hpp), which
// lives in the file named like the op's CPU reference (attention.cu <-> cpu/attention.hpp, ...).
#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <algorithm>

#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/cudnn_attention.hpp"
#include "backend/cuda/device.hpp"
#include "backend/cuda/flash_attention_tc.hpp"
#include "backend/cuda/ops.hpp"

namespace tessera {

namespace cuda_ops {

namespace {
// What each scratch buffer is for, in out-of-memory errors (by Scratch value).
const char* const kScratchLabels[] = {
    "reduction scratch",
    "attention backward workspace",
    "embedding backward workspace",
    "gradient-norm partial sums",
    "result validation's gradient-bucket sums",
    "the AdamW segment table",
    "the KV-attention row table",
    "the flash-decoding partials",
    "the flash-decoding split counters",
    "the prefill log-sum-exp",
    "the sampling rules",
    "the sampling sort buffers",
    "the cuBLASLt workspace",
    "the MoE router scores",
    "the MoE load-balancing gradient",
    "the MoE router's expert bias",
    "the grouped GEMM's pointer arrays",
    "the cuDNN attention workspace",
    "the FP8 GEMMs' quantized operands",
    "a ring block's document table",
};
static_assert(sizeof(kScratchLabels) / sizeof(kScratchLabels[0]) ==
              static_cast<size_t>(Scratch::kCount));
}  // namespace

void* Workspace::get(Scratch which, size_t bytes) {
  Tensor& t = buffers_[static_cast<int>(which)];
  if (t.nbytes() < bytes) {
    AllocationLabel label(kScratchLabels[static_cast<int>(which)]);
    if (t.defined()) retired_.push_back(t);
    t = Tensor({static_cast<int64_t>((bytes + 3) / 4)}, DType::F32, alloc_);  // raw storage
  }
  return t.defined() ? t.raw() : nullptr;
}

void* Workspace::get_zeroed(Scratch which, size_t bytes, cudaStream_t s) {
  const bool fresh = buffers_[static_cast<int>(which)].nbytes() < bytes;
  void* p = get(which, bytes);
  if (fresh && p) CUDA_CHECK(cudaMemsetAsync(p, 0, buffers_[static_cast<int>(which)].nbytes(), s));
  return p;
}

void* Workspace::upload(Scratch which, const void* host, size_t bytes, cudaStream_t s) {
  void* dev = get(which, bytes);
  if (bytes == 0) return dev;
  std::vector<char>& copy = host_[static_cast<int>(which)];
  copy.assign(static_cast<const char*>(host), static_cast<const char*>(host) + bytes);
  CUDA_CHECK(cudaMemcpyAsync(dev, copy.data(), bytes, cudaMemcpyHostToDevice, s));
  return dev;
}

}  // namespace cuda_ops

namespace {

using cuda_ops::cols_of;
using cuda_ops::expect_device;
using cuda_ops::expect_dtype;
using cuda_ops::rows_of;
using cuda_ops::Workspace;

// ---- RAII for the handles ---------------------------------------------------------------------

class CublasHandle {
 public:
  explicit CublasHandle(cudaStream_t s) {
    CUBLAS_CHECK(cublasCreate(&h_));
    CUBLAS_CHECK(cublasSetStream(h_, s));
  }
  ~CublasHandle() { cublasDestroy(h_); }
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

// The key/value head count of an attention call (0 means `heads`), after checking that qkv
// (B, T, (heads + 2G) hd) fits it.
// Documents inside a sample (--reset-attention-mask, --sft; core/documents.hpp): the first
// visible key of each row, (B*T) int32 on the device, or null. The tensor-core kernels mask them;
// ALiBi's reset positions need no table there (inside a document the distances are the rows'), but
// --reset-position-ids with ALiBi and without the mask (keys of other documents at their own
// positions) is refused.
const int32_t* document_keys(const AttentionDocuments* docs, int64_t rows) {
  if (!docs || !docs->active()) return nullptr;
  if (!docs->key_begin)
    throw ConfigError(
        "--reset-position-ids with ALiBi and without --reset-attention-mask on --device cuda: the "
        "CUDA attention kernels take ALiBi's distances by row (give --reset-attention-mask too, or "
        "--device cpu)");
  expect_device(*docs->key_begin, "the documents' first visible keys");
  expect_dtype(*docs->key_begin, DType::I32, "the documents' first visible keys");
  TESSERA_CHECK(docs->key_begin->numel() == rows, "attention documents: a table of ",
                docs->key_begin->numel(), " rows for ", rows, " query rows");
  return docs->key_begin->i32();
}

int64_t check_attention_shape(const Tensor& qkv, int64_t heads, int64_t kv_heads) {
  const int64_t G = kv_heads > 0 ? kv_heads : heads;
  TESSERA_CHECK(heads > 0 && heads % G == 0 && qkv.ndim() == 3 && qkv.dim(2) % (heads + 2 * G) == 0,
                "attention qkv shape ", shape_str(qkv.shape()), " for ", heads, " heads and ", G,
                " key/value heads");
  return G;
}
// ALiBi's heads: this call's `heads` are global heads [head_begin, head_begin + heads) of
// heads_total.
class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    if (cuda::device_count() == 0)
      throw Error(
          "--device cuda: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)");
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    blas_ = std::make_unique<CublasHandle>(stream_);
    for (Stage& st : stages_) {
      CUDA_CHECK(cudaHostAlloc(&st.host, kStageBytes, cudaHostAllocDefault));
      CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventRecord(st.done, stream_));
    }
  }
  ~CudaBackend() override {  // reverse order of creation
    cudaStreamSynchronize(stream_);
    for (cudaGraphExec_t g : graphs_)
      if (g) cudaGraphExecDestroy(g);
    for (Stage& st : stages_) {
      if (st.done) cudaEventDestroy(st.done);
      if (st.host) cudaFreeHost(st.host);
    }
    cudnn_.reset();
    blas_.reset();
    cudaStreamDestroy(stream_);
  }
  Device device() const override { return Device::CUDA; }
  const char* name() const override { return "cuda"; }
  Allocator& allocator() override { return cuda::device_allocator(); }

  void zero(Tensor& t) override {
    expect_device(t, "zero");
    CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.nbytes(), stream_));
  }
  void copy_from_host(Tensor& dst, const void* src) override {
    expect_device(dst, "copy_from_host destination");
    const size_t n = dst.nbytes();
    if (n > kStageBytes) {
      // Large copies (checkpoint loads): pageable, staged by the driver before the call returns.
      CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src, n, cudaMemcpyHostToDevice, stream_));
      return;
    }
    // Small per-step copies (token ids, targets): through a ring of pinned buffers, so the copy
    // is a real asynchronous DMA and the caller's buffer is free at once. A buffer is reused once
    // the copy that last read it has finished (its event).
    Stage& st = stages_[next_stage_];
    next_stage_ = (next_stage_ + 1) % kStages;
    CUDA_CHECK(cudaEventSynchronize(st.done));
    std::memcpy(st.host, src, n);
    CUDA_CHECK(cudaMemcpyAsync(dst.raw(), st.host, n, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(st.done, stream_));
  }
  void copy_to_host(void* dst, const Tensor& src) override {
    expect_device(src, "copy_to_host source");
    CUDA_CHECK(cudaMemcpyAsync(dst, src.raw(), src.nbytes(), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void* alloc_host(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes > 0 ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess)
      throw Error("pinned host allocation of " + std::to_string(bytes) +
                  " bytes failed: " + cudaGetErrorString(e));
    return p;
  }
  void free_host(void* p) override {
    if (p) cudaFreeHost(p);
  }
  void synchronize() override { CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  void* stream() override { return stream_; }
  void profiler_start() override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaProfilerStart());
  }
  void profiler_stop() override {
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaProfilerStop());
  }
  void cast(Tensor& dst, const Tensor& src) override {
    expect_device(dst, "cast destination");
    expect_device(src, "cast source");
    TESSERA_CHECK(dst.numel() == src.numel(), "cast shapes");
    if (dst.numel() == 0) return;
    cuda_ops::cast(dst, src, stream_);
  }
  void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                         int64_t row_begin) override {
    TESSERA_CHECK(rows_of(out) == ids.numel() && cols_of(table) == cols_of(out),
                  "embedding shapes");
    expect_dtype(table, out.dtype(), "embedding table");
    cuda_ops::embedding_forward(out, ids, table, row_begin, stream_);
  }
  void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                          int64_t row_begin) override {
    expect_dtype(dtable, DType::F32, "embedding gradient");
    cuda_ops::embedding_backward(dtable, dout, ids, row_begin, ws_, stream_);
  }
  void position_embedding_forward(Tensor& out, const Tensor& wpe) override {
    expect_dtype(wpe, out.dtype(), "position embedding");
    cuda_ops::position_embedding_forward(out, wpe, stream_);
  }
  void position_embedding_backward(Tensor& dwpe, const Tensor& dout) override {
    expect_dtype(dwpe, DType::F32, "position embedding gradient");
    cuda_ops::position_embedding_backward(dwpe, dout, stream_);
  }
  void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                         const Tensor& w, const Tensor& b, double eps) override {
    expect_dtype(mean, DType::F32, "layernorm mean");
    expect_dtype(rstd, DType::F32, "layernorm rstd");
    cuda_ops::layernorm_forward(out, mean, rstd, inp, w, b, static_cast<float>(eps), stream_);
  }
  void layernorm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout,
                          const Tensor& inp, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd) override {
    expect_dtype(dw, DType::F32, "layernorm weight gradient");
    expect_dtype(db, DType::F32, "layernorm bias gradient");
    cuda_ops::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, ws_, stream_);
  }
  void add_layernorm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                             const Tensor& b, const Tensor& w, const Tensor& bias,
                             double eps) override {
    expect_dtype(mean, DType::F32, "layernorm mean");
    expect_dtype(rstd, DType::F32, "layernorm rstd");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&sum, &out, &b, &w, &bias})
      expect_dtype(*t, a.dtype(), "add+layernorm operand");
    cuda_ops::add_layernorm_forward(sum, out, mean, rstd, a, b, w, bias, static_cast<float>(eps),
                                    stream_);
  }
  void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& w,
                       double eps) override {
    TESSERA_CHECK(
        out.numel() == inp.numel() && rstd.numel() == rows_of(inp) && w.numel() == cols_of(inp),
        "rmsnorm shapes: inp ", shape_str(inp.shape()));
    expect_dtype(rstd, DType::F32, "rmsnorm rstd");
    expect_dtype(out, inp.dtype(), "rmsnorm output");
    expect_dtype(w, inp.dtype(), "rmsnorm weight");
    cuda_ops::rmsnorm_forward(out, rstd, inp, w, static_cast<float>(eps), stream_);
  }
  void add_rmsnorm_forward(Tensor& sum, Tensor& out, Tensor& rstd, const Tensor& a, const Tensor& b,
                           const Tensor& w, double eps) override {
    TESSERA_CHECK(sum.numel() == a.numel() && out.numel() == a.numel() && b.numel() == a.numel() &&
                      rstd.numel() == rows_of(a) && w.numel() == cols_of(a),
                  "add+rmsnorm shapes: a ", shape_str(a.shape()));
    expect_dtype(rstd, DType::F32, "rmsnorm rstd");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&sum, &out, &b, &w})
      expect_dtype(*t, a.dtype(), "add+rmsnorm operand");
    cuda_ops::add_rmsnorm_forward(sum, out, rstd, a, b, w, static_cast<float>(eps), stream_);
  }
  void rmsnorm_backward(Tensor& dinp, Tensor& dw, const Tensor& dout, const Tensor& inp,
                        const Tensor& w, const Tensor& rstd) override {
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel() &&
                      dw.numel() == cols_of(inp) && w.numel() == cols_of(inp) &&
                      rstd.numel() == rows_of(inp),
                  "rmsnorm backward shapes: inp ", shape_str(inp.shape()));
    expect_dtype(dw, DType::F32, "rmsnorm weight gradient");
    expect_dtype(rstd, DType::F32, "rmsnorm rstd");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&dinp, &dout, &w})
      expect_dtype(*t, inp.dtype(), "rmsnorm backward operand");
    cuda_ops::rmsnorm_backward(dinp, dw, dout, inp, w, rstd, ws_, stream_);
  }
  void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                      const Tensor* bias) override {
    TESSERA_CHECK(cols_of(weight) == cols_of(inp) && out.numel() == rows_of(inp) * rows_of(weight),
                  "matmul shapes");
    expect_dtype(weight, inp.dtype(), "matmul weight");
    expect_dtype(out, inp.dtype(), "matmul output");
    if (bias) expect_dtype(*bias, inp.dtype(), "matmul bias");
    cuda_ops::matmul_forward(out, inp, weight, bias, blas_->get(), &lt_, ws_, stream_);
  }
  void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight) override {
    if (dweight.defined()) expect_dtype(dweight, DType::F32, "matmul weight gradient");
    if (dbias) expect_dtype(*dbias, DType::F32, "matmul bias gradient");
    cuda_ops::matmul_backward(dinp, dweight, dbias, dout, inp, weight, blas_->get(), ws_, stream_);
  }
  // FP8 (fp8.cu): the scaling state stays on the device; the GEMMs are cuBLASLt's, TN.
  void fp8_amax(Tensor& amax, const Tensor& x, bool accumulate) override {
    TESSERA_CHECK(amax.numel() == 1, "fp8_amax: amax must be (1) f32");
    cuda_ops::fp8_amax(amax, x, accumulate, ws_, stream_);
  }
  void fp8_current_scale(Tensor& scale, const Tensor& amax, Fp8Format format) override {
    TESSERA_CHECK(amax.numel() == 1 && scale.numel() == 1, "fp8_current_scale: (1) tensors");
    expect_dtype(scale, DType::F32, "fp8 scale");
    expect_dtype(amax, DType::F32, "fp8 amax");
    cuda_ops::fp8_current_scale(scale, amax, format, stream_);
  }
  void fp8_delayed_update(Tensor& history, Tensor& scale, Tensor& amax, const Tensor& fp8_max,
                          bool most_recent, int margin) override {
    for (const Tensor* t : std::initializer_list<const Tensor*>{&history, &scale, &amax, &fp8_max})
      expect_dtype(*t, DType::F32, "fp8 scaling state");
    cuda_ops::fp8_delayed_update(history, scale, amax, fp8_max, most_recent, margin, stream_);
  }
  void fp8_matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                          const Fp8Operand& x, const Fp8Operand& w) override {
    TESSERA_CHECK(cols_of(weight) == cols_of(inp) && out.numel() == rows_of(inp) * rows_of(weight),
                  "fp8 matmul shapes");
    expect_dtype(weight, inp.dtype(), "fp8 matmul weight");
    expect_dtype(out, inp.dtype(), "fp8 matmul output");
    if (bias) expect_dtype(*bias, inp.dtype(), "fp8 matmul bias");
    cuda_ops::fp8_matmul_forward(out, inp, weight, bias, x, w, fp8_lt_, ws_, stream_);
  }
  void fp8_matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                           const Tensor& inp, const Tensor& weight, const Fp8Operand& g,
                           const Fp8Operand& x, const Fp8Operand& w) override {
    TESSERA_CHECK(dout.numel() == rows_of(inp) * rows_of(weight) &&
                      dweight.numel() == weight.numel() && (!dinp || dinp->numel() == inp.numel()),
                  "fp8 matmul backward shapes");
    if (dbias) expect_dtype(*dbias, DType::F32, "fp8 matmul bias gradient");
    cuda_ops::fp8_matmul_backward(dinp, dweight, dbias, dout, inp, weight, g, x, w, fp8_lt_, ws_,
                                  stream_);
  }
  void grouped_matmul_forward(const std::vector<GroupedGemm>& groups) override {
    for (const GroupedGemm& g : groups) {
      TESSERA_CHECK(cols_of(*g.weight) == cols_of(*g.inp) &&
                        g.out->numel() == rows_of(*g.inp) * rows_of(*g.weight),
                    "grouped matmul shapes");
      expect_dtype(*g.weight, g.inp->dtype(), "grouped matmul weight");
      expect_dtype(*g.out, g.inp->dtype(), "grouped matmul output");
    }
    cuda_ops::grouped_matmul_forward(groups, blas_->get(), ws_, stream_);
  }
  void grouped_matmul_backward(const std::vector<GroupedGemm>& groups) override {
    for (const GroupedGemm& g : groups) {
      TESSERA_CHECK(cols_of(*g.weight) == cols_of(*g.inp) &&
                        g.dout->numel() == rows_of(*g.inp) * rows_of(*g.weight) &&
                        (!g.dweight || g.dweight->numel() == g.weight->numel()) &&
                        (!g.out || g.out->numel() == g.inp->numel()),
                    "grouped matmul backward shapes");
      if (g.dweight) expect_dtype(*g.dweight, DType::F32, "grouped matmul weight gradient");
    }
    cuda_ops::grouped_matmul_backward(groups, blas_->get(), ws_, stream_);
  }
  void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads,
                         const AttentionDropout* drop, int64_t kv_heads,
                         const AttentionAlibi* alibi, const AttentionDocuments* docs) override {
    const int64_t G = check_attention_shape(qkv, heads, kv_heads);
    check_alibi_heads(alibi, heads);
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (heads + 2 * G);
    const int32_t* kb = document_keys(docs, B * T);
    TESSERA_CHECK(out.numel() == B * T * heads * hd && lse.numel() == B * heads * T,
                  "attention output shapes");
    expect_dtype(lse, DType::F32, "attention lse");
    expect_dtype(out, qkv.dtype(), "attention output");
    const cuda_ops::CudnnAttentionShape sh{qkv.dtype(), B, T, heads, G, hd};
    const AttnKernels k = kb ? document_kernels(sh, {out.raw(), qkv.raw()})
                             : attention_kernels(sh, drop && drop->spec.active(), alibi != nullptr,
                                                 {out.raw(), qkv.raw()});
    if (k == AttnKernels::Cudnn)
      cudnn_->forward(out.raw(), lse.f32(), qkv.raw(), sh, ws_);
    else
      cuda_ops::attention_forward(out, lse, qkv, heads, G, drop, alibi, ws_, stream_,
                                  k == AttnKernels::Flash, kb);
  }
  void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int64_t heads, const AttentionDropout* drop,
                          int64_t kv_heads, const AttentionAlibi* alibi,
                          const AttentionDocuments* docs) override {
    const int64_t G = check_attention_shape(qkv, heads, kv_heads);
    check_alibi_heads(alibi, heads);
    const int32_t* kb = document_keys(docs, qkv.dim(0) * qkv.dim(1));
    TESSERA_CHECK(
        dqkv.numel() == qkv.numel() && dout.numel() == out.numel() &&
            out.numel() == qkv.dim(0) * qkv.dim(1) * heads * (qkv.dim(2) / (heads + 2 * G)),
        "attention backward shapes");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&dqkv, &dout, &out})
      expect_dtype(*t, qkv.dtype(), "attention backward operand");
    expect_dtype(lse, DType::F32, "attention lse");
    const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (heads + 2 * G);
    const cuda_ops::CudnnAttentionShape sh{qkv.dtype(), B, T, heads, G, hd};
    const AttnKernels k = kb ? document_kernels(sh, {dqkv.raw(), dout.raw(), qkv.raw(), out.raw()})
                             : attention_kernels(sh, drop && drop->spec.active(), alibi != nullptr,
                                                 {dqkv.raw(), dout.raw(), qkv.raw(), out.raw()});
    if (k == AttnKernels::Cudnn)
      cudnn_->backward(dqkv.raw(), dout.raw(), qkv.raw(), out.raw(), lse.f32(), sh, deterministic_,
                       ws_);
    else
      cuda_ops::attention_backward(dqkv, dout, qkv, out, lse, heads, G, drop, alibi, ws_, stream_,
                                   k == AttnKernels::Flash, kb);
  }
  void set_attention_backend(AttentionBackend b, bool deterministic) override {
    attention_ = b;
    deterministic_ = deterministic;
    kernels_.clear();
  }
  std::string attention_plan(const AttentionCall& c) override {
    const int64_t G = c.kv_heads > 0 ? c.kv_heads : c.heads;
    std::string why;
    const cuda_ops::CudnnAttentionShape sh{c.dtype, c.batch, c.seq, c.heads, G, c.head_dim};
    AttnKernels k;
    if (c.documents) {  // the one-line refusal at start-up where no kernel masks them
      k = document_kernels(sh, {});
      why = "documents inside the samples: only the tensor-core flash kernels mask them";
    } else {
      k = attention_kernels(sh, c.dropout, c.alibi, {}, &why);
    }
    const char* what = k == AttnKernels::Cudnn   ? "cuDNN fused attention"
                       : k == AttnKernels::Flash ? "Tessera's tensor-core flash kernels"
                                                 : "Tessera's generic kernels";
    std::string line = std::string(what) + " (--attention-backend " +
                       attention_backend_name(attention_) + ": " + why + ")";
    if (k == AttnKernels::Cudnn)
      line += std::string("; cuDNN ") + cuda_ops::cudnn_version() +
              (deterministic_ ? ", deterministic backward" : ", backward with atomics");
    return line;
  }
  void ring_block_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv,
                          const RingBlock& blk) override {
    cuda_ops::ring_block_forward(out, lse, qkv, kv, blk, ws_, stream_);
  }
  void ring_block_backward(Tensor& dqkv, Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                           const Tensor& kv, const Tensor& out, const Tensor& lse,
                           const RingBlock& blk) override {
    cuda_ops::ring_block_backward(dqkv, dkv, dout, qkv, kv, out, lse, blk, ws_, stream_);
  }
  void attention_merge(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse,
                       int64_t q0) override {
    cuda_ops::attention_merge(out, lse, part_out, part_lse, q0, stream_);
  }
  void copy_columns(Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                    int64_t cols) override {
    cuda_ops::copy_columns(dst, dst_col, src, src_col, cols, stream_);
  }
  void copy_column_blocks(Tensor& dst, int64_t dst_col, int64_t dst_stride, const Tensor& src,
                          int64_t src_col, int64_t src_stride, int64_t cols,
                          int64_t blocks) override {
    cuda_ops::copy_column_blocks(dst, dst_col, dst_stride, src, src_col, src_stride, cols, blocks,
                                 stream_);
  }
  void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                    const std::vector<KvSegment>& segments, int64_t heads, int64_t kv_heads,
                    const AttentionAlibi* alibi) override {
    check_alibi_heads(alibi, heads);
    const int64_t G = check_kv_attention(out, qkv, k_cache, v_cache, segments, heads, kv_heads);
    for (const Tensor* t : std::initializer_list<const Tensor*>{&out, &k_cache, &v_cache})
      expect_dtype(*t, qkv.dtype(), "generation (KV attention): out and caches in qkv's dtype");
    cuda_ops::kv_attention(out, qkv, k_cache, v_cache, segments, heads, G, alibi, ws_, stream_);
  }
  void kv_decode(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                 const Tensor& rows, int64_t max_context, int64_t heads, int64_t kv_heads,
                 const AttentionAlibi* alibi) override {
    check_alibi_heads(alibi, heads);
    const int64_t G = check_kv_attention(out, qkv, k_cache, v_cache, {}, heads, kv_heads);
    TESSERA_CHECK(rows.dtype() == DType::I32 && rows.ndim() == 2 && rows.dim(1) == 3 &&
                      rows.dim(0) == qkv.numel() / qkv.shape().back(),
                  "kv_decode: the row table must be (n, 3) int32 for the n rows of qkv");
    TESSERA_CHECK(max_context > 0 && max_context <= k_cache.dim(2), "kv_decode: max_context ",
                  max_context, " outside the cache's ", k_cache.dim(2), " positions");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&out, &k_cache, &v_cache})
      expect_dtype(*t, qkv.dtype(), "generation (KV attention): out and caches in qkv's dtype");
    expect_device(rows, "kv_decode row table");
    cuda_ops::kv_decode(out, qkv, k_cache, v_cache, rows, max_context, heads, G, alibi, ws_,
                        stream_);
  }

  // Stream capture in thread-local mode: a call of this thread that a graph cannot hold (a
  // synchronization, a pageable copy, cudaMalloc) fails the capture instead of running.
  bool graph_begin() override {
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    return true;
  }
  int64_t graph_end() override {
    cudaGraph_t g = nullptr;
    const cudaError_t e = cudaStreamEndCapture(stream_, &g);
    cudaGraphExec_t x = nullptr;
    const cudaError_t ei = e == cudaSuccess && g ? cudaGraphInstantiateWithFlags(&x, g, 0) : e;
    if (g) cudaGraphDestroy(g);
    if (ei != cudaSuccess || !x) {
      (void)cudaGetLastError();  // not sticky: clear it for the eager run that follows
      return -1;
    }
    // A released handle's place is reused (servers make an engine per batch).
    const auto free = std::find(graphs_.begin(), graphs_.end(), nullptr);
    if (free != graphs_.end()) {
      *free = x;
      return free - graphs_.begin();
    }
    graphs_.push_back(x);
    return static_cast<int64_t>(graphs_.size()) - 1;
  }
  void graph_abort() override {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(stream_, &g);
      if (g) cudaGraphDestroy(g);
    }
    (void)cudaGetLastError();
  }
  void graph_launch(int64_t graph) override {
    TESSERA_CHECK(graph >= 0 && graph < static_cast<int64_t>(graphs_.size()) && graphs_[graph],
                  "graph_launch: no graph ", graph);
    CUDA_CHECK(cudaGraphLaunch(graphs_[graph], stream_));
  }
  void graph_release(int64_t graph) override {
    if (graph < 0 || graph >= static_cast<int64_t>(graphs_.size()) || !graphs_[graph]) return;
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // a launch of it may still run
    cudaGraphExecDestroy(graphs_[graph]);
    graphs_[graph] = nullptr;
  }

  std::vector<int32_t> sample_tokens(const Tensor& logits, int64_t pieces, int64_t rows,
                                     int64_t vocab,
                                     const std::vector<TokenSampling>& how) override {
    check_sample_tokens(logits, pieces, rows, vocab, how);
    expect_device(logits, "sample_tokens logits");
    return cuda_ops::sample_tokens(logits, pieces, rows, vocab, how, ws_, stream_);
  }
  void rope(Tensor& qkv, const RopeSpec& r, const Tensor* positions, bool inverse) override {
    const int64_t N = rows_of(qkv);
    TESSERA_CHECK(r.heads > 0 && r.kv_heads > 0 &&
                      cols_of(qkv) == (r.heads + 2 * r.kv_heads) * r.head_dim &&
                      r.rot_dim % 2 == 0 && r.rot_dim >= 0 && r.rot_dim <= r.head_dim &&
                      (positions || r.seq_len > 0) && (!positions || positions->numel() == N),
                  "rope shapes: qkv ", shape_str(qkv.shape()), " for ", r.heads, " heads, ",
                  r.kv_heads, " key/value heads of ", r.head_dim, ", rot_dim ", r.rot_dim);
    expect_device(qkv, "rope qkv");
    if (positions) {
      expect_device(*positions, "rope positions");
      expect_dtype(*positions, DType::I32, "rope positions");
    }
    cuda_ops::rope(qkv, r, positions, inverse, stream_);
  }
  void gelu_forward(Tensor& out, const Tensor& inp) override {
    expect_dtype(out, inp.dtype(), "gelu output");
    cuda_ops::gelu_forward(out, inp, stream_);
  }
  void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    cuda_ops::gelu_backward(dinp, inp, dout, stream_);
  }
  void matmul_gelu_forward(Tensor& out, Tensor& pre, const Tensor& inp, const Tensor& weight,
                           const Tensor* bias) override {
    TESSERA_CHECK(cols_of(weight) == cols_of(inp) &&
                      out.numel() == rows_of(inp) * rows_of(weight) && pre.numel() == out.numel(),
                  "matmul_gelu_forward shapes");
    expect_dtype(weight, inp.dtype(), "matmul + GELU weight");
    expect_dtype(out, inp.dtype(), "matmul + GELU output");
    expect_dtype(pre, inp.dtype(), "matmul + GELU scratch");
    if (bias) expect_dtype(*bias, inp.dtype(), "matmul + GELU bias");
    if (lt_.gelu_forward(out, inp, weight, bias, ws_, stream_)) return;
    Backend::matmul_gelu_forward(out, pre, inp, weight, bias);
  }
  void matmul_gelu_backward(Tensor& dpre, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                            const Tensor& inp, const Tensor& weight, const Tensor& pre) override {
    TESSERA_CHECK(dpre.numel() == pre.numel() && pre.numel() == inp.numel() &&
                      dpre.dtype() == pre.dtype() && dout.dtype() == dpre.dtype() &&
                      weight.dtype() == dpre.dtype(),
                  "matmul_gelu_backward: dpre, pre and the layer's input must agree");
    if (lt_.dgelu_backward(dpre, dout, weight, pre, ws_, stream_)) {
      if (dweight.defined()) matmul_backward(nullptr, dweight, dbias, dout, inp, weight);
      return;
    }
    Backend::matmul_gelu_backward(dpre, dweight, dbias, dout, inp, weight, pre);
  }

  void squared_relu_forward(Tensor& out, const Tensor& inp) override {
    TESSERA_CHECK(out.numel() == inp.numel(), "squared relu shapes");
    expect_device(out, "squared relu output");
    expect_device(inp, "squared relu input");
    expect_dtype(out, inp.dtype(), "squared relu output");
    cuda_ops::squared_relu_forward(out, inp, stream_);
  }
  void squared_relu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    TESSERA_CHECK(dinp.numel() == inp.numel() && dout.numel() == inp.numel(),
                  "squared relu shapes");
    expect_device(dinp, "squared relu input gradient");
    expect_device(inp, "squared relu input");
    expect_device(dout, "squared relu output gradient");
    expect_dtype(dinp, inp.dtype(), "squared relu input gradient");
    expect_dtype(dout, inp.dtype(), "squared relu output gradient");
    cuda_ops::squared_relu_backward(dinp, inp, dout, stream_);
  }
  void swiglu_forward(Tensor& out, const Tensor& inp) override {
    TESSERA_CHECK(cols_of(inp) % 2 == 0 && out.numel() == rows_of(inp) * (cols_of(inp) / 2),
                  "swiglu shapes: inp ", shape_str(inp.shape()), ", out ", shape_str(out.shape()));
    expect_dtype(out, inp.dtype(), "swiglu output");
    cuda_ops::swiglu_forward(out, inp, stream_);
  }
  void swiglu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    TESSERA_CHECK(cols_of(inp) % 2 == 0 && dinp.numel() == inp.numel() &&
                      dout.numel() == rows_of(inp) * (cols_of(inp) / 2),
                  "swiglu backward shapes: inp ", shape_str(inp.shape()));
    expect_dtype(dinp, inp.dtype(), "swiglu input gradient");
    expect_dtype(dout, inp.dtype(), "swiglu output gradient");
    cuda_ops::swiglu_backward(dinp, inp, dout, stream_);
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override {
    expect_dtype(out, a.dtype(), "add output");
    expect_dtype(b, a.dtype(), "add input");
    cuda_ops::add(out, a, b, stream_);
  }
  void dropout(Tensor& out, const Tensor& in, const DropoutSpec& d, int64_t row_begin,
               int64_t seq_len) override {
    expect_dtype(out, in.dtype(), "dropout output");
    TESSERA_CHECK(out.numel() == in.numel() && seq_len > 0, "dropout shapes");
    cuda_ops::dropout(out, in, d, row_begin, seq_len, stream_);
  }
  void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid) override {
    cuda_ops::xent_row_max(rowmax, logits, valid, stream_);
  }
  void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits,
                     const Tensor& rowmax, const Tensor& targets, int64_t valid,
                     int64_t col_begin) override {
    cuda_ops::xent_row_sums(sumexp, target_logit, logits, rowmax, targets, valid, col_begin,
                            stream_);
  }
  void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax,
                          const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets,
                          int64_t valid, int64_t col_begin, float grad_scale) override {
    cuda_ops::xent_loss_and_grad(losses, logits, rowmax, sumexp, target_logit, targets, valid,
                                 col_begin, grad_scale, stream_);
  }
  int64_t moe_route(Tensor& expert, Tensor& weight, Tensor& row, const Tensor& logits,
                    const MoERouting& r, int64_t group_rows, std::vector<int64_t>& routed,
                    std::vector<int64_t>& kept) override {
    return cuda_ops::moe_route(expert, weight, row, logits, r, group_rows, routed, kept, ws_,
                               stream_);
  }
  void moe_router_stats(const Tensor& logits, const MoERouting& r, int64_t group_rows,
                        std::vector<double>& score_sums, double& lse_sq_sum) override {
    cuda_ops::moe_router_stats(logits, r, group_rows, score_sums, lse_sq_sum, ws_, stream_);
  }
  void moe_router_backward(Tensor& dlogits, const Tensor& logits, const Tensor& expert,
                           const Tensor& weight, const Tensor& dweight, const MoERouting& r,
                           int64_t group_rows, const std::vector<double>& aux_grad,
                           double z_grad) override {
    cuda_ops::moe_router_backward(dlogits, logits, expert, weight, dweight, r, group_rows, aux_grad,
                                  z_grad, ws_, stream_);
  }
  void moe_permute(Tensor& x_perm, const Tensor& x, const Tensor& row) override {
    cuda_ops::moe_permute(x_perm, x, row, stream_);
  }
  void moe_unpermute(Tensor& y, const Tensor& out, const Tensor& row,
                     const Tensor& weight) override {
    cuda_ops::moe_unpermute(y, out, row, &weight, stream_);
  }
  void moe_unpermute_backward(Tensor& dout, Tensor& dweight, const Tensor& dy, const Tensor& out,
                              const Tensor& row, const Tensor& weight) override {
    cuda_ops::moe_unpermute_backward(dout, dweight, dy, out, row, weight, stream_);
  }
  void moe_permute_backward(Tensor& dx, const Tensor& dx_perm, const Tensor& row) override {
    cuda_ops::moe_unpermute(dx, dx_perm, row, nullptr, stream_);
  }
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                  double weight_decay, int64_t step) override {
    for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v})
      expect_dtype(*t, DType::F32, "AdamW operand (f32 master weights, gradients, moments)");
    cuda_ops::adamw_step(param, grad, m, v, h, weight_decay, step, stream_);
  }
  void adamw_step_flat(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                       const std::vector<AdamWSegment>& segments, const AdamWHyper& h, int64_t step,
                       Tensor* compute) override {
    for (const Tensor* t : std::initializer_list<const Tensor*>{&params, &grads, &m, &v})
      expect_dtype(*t, DType::F32, "AdamW operand (f32 master weights, gradients, moments)");
    if (compute) {
      expect_device(*compute, "AdamW compute copy");
      TESSERA_CHECK(compute->numel() == params.numel() && compute->dtype() != DType::F32,
                    "AdamW compute copy: a bf16/f16 buffer of the parameters' size");
    }
    cuda_ops::adamw_step_flat(params, grads, m, v, segments, h, step, compute, ws_, stream_);
  }
  double sum_squares(const Tensor& x) override { return sum_squares_all({x}); }
  MemoryStats memory_stats() override {
    MemoryStats m;
    m.allocated = static_cast<double>(cuda::allocated_bytes());
    m.max_allocated = static_cast<double>(cuda::peak_allocated_bytes());
    size_t free_bytes = 0, total_bytes = 0;
    cuda::memory_info(&free_bytes, &total_bytes);
    m.reserved = static_cast<double>(total_bytes - free_bytes);
    m.reserved_what = "device memory in use (cudaMemGetInfo)";
    return m;
  }
  double sum_squares_all(const std::vector<Tensor>& xs) override {
    for (const Tensor& x : xs) {
      expect_device(x, "sum_squares input");
      expect_dtype(x, DType::F32, "sum_squares input (gradients)");
    }
    return cuda_ops::sum_squares_all(xs, ws_, stream_);
  }
  void collect_sum_squares(const Tensor& x, bool restart) override {
    expect_device(x, "collect_sum_squares input");
    expect_dtype(x, DType::F32, "collect_sum_squares input (gradients)");
    cuda_ops::collect_sum_squares(x, restart, ws_, stream_);
  }
  double collected_sum_squares() override { return cuda_ops::collected_sum_squares(ws_, stream_); }
  int device_index() const override {
    int d = -1;
    CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
  void scale(Tensor& x, float s) override {
    expect_dtype(x, DType::F32, "scale operand (gradients)");
    cuda_ops::scale(x, s, stream_);
  }
  void gemm(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha,
            float beta) override {
    cuda_ops::gemm_2d(c, a, ta, b, tb, alpha, beta, blas_->get());
  }

 private:
  static constexpr int kStages = 8;
  static constexpr size_t kStageBytes = size_t(4) << 20;
  struct Stage {
    void* host = nullptr;  // pinned
    cudaEvent_t done = nullptr;
  };
  Stage stages_[kStages];
  int next_stage_ = 0;

  // The attention kernels of a call: by --attention-backend, the shape, dropout and ALiBi (and
  // cuDNN's verdict on the shape), decided at a shape's first call and kept.
  enum class AttnKernels { Cudnn, Flash, Generic };
  // Documents (a first visible key per row): the tensor-core flash kernels mask them, so `auto`
  // and `flash` run those; cuDNN's graph here and the generic kernels take no such mask.
  AttnKernels document_kernels(const cuda_ops::CudnnAttentionShape& s,
                               std::initializer_list<const void*> ptrs) const {
    if (attention_ != AttentionBackend::Auto && attention_ != AttentionBackend::Flash)
      throw ConfigError(detail::concat(
          "--attention-backend ", attention_backend_name(attention_),
          " with documents inside the samples (--reset-attention-mask / --sft): only Tessera's "
          "tensor-core flash kernels mask them on the GPU (give --attention-backend auto or "
          "flash)"));
    if (!tc::flash_supported(s.dtype, s.hd, s.B * s.H, ptrs))
      throw ConfigError(detail::concat(
          "documents inside the samples (--reset-attention-mask / --sft) on --device cuda need the "
          "tensor-core flash kernels: bf16 or fp16 at head dim 64 or 128 (this run: ",
          dtype_name(s.dtype), ", head dim ", s.hd, "; give --bf16, or --device cpu)"));
    return AttnKernels::Flash;
  }
  AttnKernels attention_kernels(const cuda_ops::CudnnAttentionShape& s, bool dropout, bool alibi,
                                std::initializer_list<const void*> ptrs,
                                std::string* why = nullptr) {
    bool aligned = true;
    for (const void* p : ptrs) aligned = aligned && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    const auto key = std::tuple_cat(s.key(), std::make_tuple(dropout, alibi, aligned));
    auto it = kernels_.find(key);
    if (it != kernels_.end() && !why) return it->second;
    std::string reason;
    const AttnKernels k = choose_attention(s, dropout, alibi, aligned, reason);
    kernels_[key] = k;
    if (why) *why = reason;
    return k;
  }
  AttnKernels choose_attention(const cuda_ops::CudnnAttentionShape& s, bool dropout, bool alibi,
                               bool aligned, std::string& why) {
    const bool tc = tc::flash_supported(s.dtype, s.hd, s.B * s.H, {});
    const std::string shape =
        std::string(dtype_name(s.dtype)) + ", head dim " + std::to_string(s.hd);
    switch (attention_) {
      case AttentionBackend::Unfused:
      case AttentionBackend::Local:
        why = "no tensor cores, as asked";
        return AttnKernels::Generic;
      case AttentionBackend::Flash:
        why = tc ? shape
                 : "the tensor-core kernels take bf16/f16 at head dim 64 or 128, not " + shape;
        return tc ? AttnKernels::Flash : AttnKernels::Generic;
      case AttentionBackend::Fused:
      case AttentionBackend::Auto:
        break;
    }
    std::string refused;
    if (dropout)
      refused =
          "attention dropout is on: cuDNN would draw its own mask, where Tessera's is keyed "
          "by position so that every layout drops the same elements";
    else if (alibi)
      refused = "ALiBi is on: cuDNN's slopes are for all heads of one rank, not a rank's slice";
    else if (!aligned)
      refused = "an operand is not 16-byte aligned";
    else {
      if (!cudnn_) cudnn_ = std::make_unique<cuda_ops::CudnnAttention>(stream_);
      refused = cudnn_->refusal(s, deterministic_);
    }
    if (refused.empty()) {
      why = "cuDNN runs " + shape + (attention_ == AttentionBackend::Auto ? ", causal" : "");
      return AttnKernels::Cudnn;
    }
    if (attention_ == AttentionBackend::Fused)
      throw ConfigError("--attention-backend fused: " + refused +
                        " (give --attention-backend auto or flash)");
    why = "not cuDNN: " + refused;
    return tc ? AttnKernels::Flash : AttnKernels::Generic;
  }
  AttentionBackend attention_ = AttentionBackend::Auto;
  bool deterministic_ = false;
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool>,
           AttnKernels>
      kernels_;
  std::unique_ptr<cuda_ops::CudnnAttention> cudnn_;

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CublasHandle> blas_;
  Workspace ws_{cuda::device_allocator()};
  cuda_ops::LtMatmul lt_;
  cuda_ops::Fp8Lt fp8_lt_;
  std::vector<cudaGraphExec_t> graphs_;  // by handle; null once released
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  return std::make_unique<CudaBackend>();
}

}  // namespace tessera
