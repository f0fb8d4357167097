// ops.hpp: the host launchers of the CUDA kernels, one group per op file, each file named like its
// CPU reference (backend/cpu/attention.hpp <-> backend/cuda/attention.cu, ...). CudaBackend
// (cuda_backend.cu) checks an op's arguments and calls its launcher; the launcher picks the kernel
// for the dtype and shape and enqueues it on stream `s`. Scratch memory comes from the backend's
// Workspace, so no launcher allocates after the first step. Shapes are as in backend.hpp.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "core/tensor.hpp"

namespace tessera::cuda_ops {

// The backend's device scratch buffers, one per use.
enum class Scratch {
  kPartials,          // f32 column partials of two-stage reductions (layernorm.cu, matmul.cu)
  kAttentionRowdot,   // attention backward: dout . out per (b, h, t) (attention.cu)
  kEmbeddingSort,     // embedding backward: sorted tokens, their runs, CUB's temporary storage
  kSumSquares,        // per-block partial sums of squares (optim.cu)
  kCollectedSquares,  // the gradient buckets' sums of squares collected over a step (optim.cu)
  kAdamSegments,      // the AdamW segment table (optim.cu)
  kKvSegments,        // the KV-attention row table (kv_attention.cu)
  kDecodePartials,    // flash-decoding's per-split outputs, maxima and sums (kv_attention.cu)
  kDecodeCounters,    // flash-decoding's splits done per (row, head); zero between launches
  kPrefillLse,        // the prefill attention's log-sum-exp, not kept (kv_attention.cu)
  kSampling,          // the per-row sampling rules (sampling.cu)
  kSamplingSort,      // dense and sorted logits, indices, CUB's storage (sampling.cu)
  kCublasLt,          // cuBLASLt's workspace for the GEMMs with epilogues (matmul.cu)
  kMoeScores,         // the router's per-token load-balancing scores and lse^2 (moe.cu)
  kMoeAuxGrad,        // the load-balancing loss's gradient per (group, expert) (moe.cu)
  kMoeBias,           // the router's aux-loss-free expert bias (moe.cu)
  kGroupedPointers,   // the A, B and C pointer arrays of a grouped GEMM (matmul.cu)
  kCudnn,     // cuDNN attention's plan workspace, row sums, dQ accumulator (cudnn_attention.cpp)
  kFp8,       // FP8 GEMMs' quantized operands and their 1/scale (fp8.cu)
  kRingDocs,  // a ring block's first visible key per query row, documents (ring.cu)
  kCount
};

// Grow-only device scratch owned by the backend (defined in cuda_backend.cu). A buffer outgrown
// (in the first step) is kept, not freed: cudaFree waits for the whole device, which can stall
// against NCCL work in flight on other streams. Allocations go through the backend's allocator
// under a label naming the buffer, so an out-of-memory error says which one did not fit.
class Workspace {
 public:
  explicit Workspace(Allocator& alloc) : alloc_(alloc) {}
  // At least `bytes` bytes of buffer `which` (aligned as cudaMalloc aligns; contents undefined).
  void* get(Scratch which, size_t bytes);
  // get(), zeroed on stream `s` whenever the buffer is (re)allocated: for counters that the
  // kernels using them return to zero themselves.
  void* get_zeroed(Scratch which, size_t bytes, cudaStream_t s);
  template <typename T>
  T* get(Scratch which, int64_t n) {
    return static_cast<T*>(get(which, sizeof(T) * static_cast<size_t>(n)));
  }
  // Copies `bytes` bytes from `host` into buffer `which` on stream `s` and returns the buffer. The
  // host bytes are copied here first and kept until the next upload to the same buffer, so the
  // caller's memory is free at once.
  void* upload(Scratch which, const void* host, size_t bytes, cudaStream_t s);

 private:
  static constexpr int kBuffers = static_cast<int>(Scratch::kCount);
  Allocator& alloc_;
  Tensor buffers_[kBuffers];
  std::vector<char> host_[kBuffers];
  std::vector<Tensor> retired_;
};

// ---- elementwise.cu -----------------------------------------------------------------------------

// dst = src converted to dst's dtype (f32, bf16, f16 in any combination); same numel.
void cast(Tensor& dst, const Tensor& src, cudaStream_t s);
void add(Tensor& out, const Tensor& a, const Tensor& b, cudaStream_t s);
// Hidden dropout (Backend::dropout); in place allowed.
void dropout(Tensor& out, const Tensor& in, const DropoutSpec& d, int64_t row_begin,
             int64_t seq_len, cudaStream_t s);

// ---- embedding.cu -------------------------------------------------------------------------------

void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, int64_t row_begin,
                       cudaStream_t s);
void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t row_begin,
                        Workspace& ws, cudaStream_t s);
void position_embedding_forward(Tensor& out, const Tensor& wpe, cudaStream_t s);
void position_embedding_backward(Tensor& dwpe, const Tensor& dout, cudaStream_t s);

// ---- gelu.cu ------------------------------------------------------------------------------------

void gelu_forward(Tensor& out, const Tensor& inp, cudaStream_t s);
void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout, cudaStream_t s);
// Squared ReLU: out = max(inp, 0)^2; dinp = dout * 2 max(inp, 0) (dinp may be dout).
void squared_relu_forward(Tensor& out, const Tensor& inp, cudaStream_t s);
void squared_relu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout, cudaStream_t s);

// ---- swiglu.cu ----------------------------------------------------------------------------------

// out (N,F) = silu(gate) * up from inp (N,2F) = [gate | up] per row.
void swiglu_forward(Tensor& out, const Tensor& inp, cudaStream_t s);
// dinp (N,2F) overwritten from dout (N,F).
void swiglu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout, cudaStream_t s);

// ---- layernorm.cu -------------------------------------------------------------------------------

void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp, const Tensor& w,
                       const Tensor& b, float eps, cudaStream_t s);
void layernorm_backward(Tensor& dinp, Tensor& dw, Tensor& db, const Tensor& dout, const Tensor& inp,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd, Workspace& ws,
                        cudaStream_t s);
void add_layernorm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                           const Tensor& b, const Tensor& w, const Tensor& bias, float eps,
                           cudaStream_t s);

// ---- rmsnorm.cu ---------------------------------------------------------------------------------

// out (N,C) = inp * rstd * w, rstd (N) f32 saved.
void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& w, float eps,
                     cudaStream_t s);
// sum = a + b (rounded as stored), out = RMSNorm(sum): one pass.
void add_rmsnorm_forward(Tensor& sum, Tensor& out, Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor& w, float eps, cudaStream_t s);
// dinp (N,C) and dw (C, f32) accumulated; dw's column sums in two deterministic stages.
void rmsnorm_backward(Tensor& dinp, Tensor& dw, const Tensor& dout, const Tensor& inp,
                      const Tensor& w, const Tensor& rstd, Workspace& ws, cudaStream_t s);

// Tells compute-sanitizer's initcheck that a cuBLAS output of `bytes` bytes at p was written
// (matmul.cu).
void mark_initialized(void* p, size_t bytes, cudaStream_t s);

// ---- fp8.cu -------------------------------------------------------------------------------------

// Backend::fp8_amax / fp8_current_scale / fp8_delayed_update on the device (fp8.cuh, core/fp8.hpp).
void fp8_amax(Tensor& amax, const Tensor& x, bool accumulate, Workspace& ws, cudaStream_t s);
void fp8_current_scale(Tensor& scale, const Tensor& amax, Fp8Format f, cudaStream_t s);
void fp8_delayed_update(Tensor& history, Tensor& scale, Tensor& amax, const Tensor& fmax,
                        bool most_recent, int margin, cudaStream_t s);
// q (rows, cols) and / or qt (cols, fp8_padded(rows)) = fp8(x * scale[0]) of a row-major x
// (either null; qt's padding columns zeros); scale_inv[0] = 1 / scale[0] (null: not written).
// Device pointers.
void fp8_quantize(const Tensor& x, int64_t rows, int64_t cols, const float* scale, Fp8Format f,
                  uint8_t* q, uint8_t* qt, float* scale_inv, cudaStream_t s);
// Rows rounded up to a multiple of 16: cuBLASLt's FP8 GEMMs take leading dimensions (and the
// reduction's length) in multiples of 16, and wgrad reduces over the rows (an expert's block of
// tokens has any number of them; the zero padding adds nothing).
inline int64_t fp8_padded(int64_t rows) {
  return (rows + 15) / 16 * 16;
}

// cuBLASLt's FP8 GEMMs, TN: D (m x n, column-major) = (A^T B) * a_scale_inv * b_scale_inv
// (+ bias; + D with accumulate), A stored k x m and B k x n in FP8. Plans cached per shape,
// formats and output type. Throws Error where cuBLASLt has no algorithm (pre-Hopper GPUs,
// dimensions not multiples of 16).
class Fp8Lt {
 public:
  struct Call {
    int64_t m = 0, n = 0, k = 0;
    const void* A = nullptr;
    const void* B = nullptr;
    void* D = nullptr;
    Fp8Format a_format = Fp8Format::E4M3, b_format = Fp8Format::E4M3;
    const float* a_scale_inv = nullptr;
    const float* b_scale_inv = nullptr;
    DType d_type = DType::BF16;
    const void* bias = nullptr;  // (m) in d_type
    bool fast_accum = false, accumulate = false;
  };
  Fp8Lt();
  ~Fp8Lt();
  Fp8Lt(const Fp8Lt&) = delete;
  Fp8Lt& operator=(const Fp8Lt&) = delete;
  void gemm(const Call& c, Workspace& ws, cudaStream_t s);

 private:
  struct Plan;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Backend::fp8_matmul_forward / fp8_matmul_backward (the operands' scales are device tensors).
void fp8_matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                        const Backend::Fp8Operand& x, const Backend::Fp8Operand& w, Fp8Lt& lt,
                        Workspace& ws, cudaStream_t s);
void fp8_matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                         const Tensor& inp, const Tensor& weight, const Backend::Fp8Operand& g,
                         const Backend::Fp8Operand& x, const Backend::Fp8Operand& w, Fp8Lt& lt,
                         Workspace& ws, cudaStream_t s);

// ---- matmul.cu ----------------------------------------------------------------------------------

// The bias epilogue of cuBLASLt: y = x W^T + b in one kernel (no bias fill, no read of y).
// Plans (descriptors, layouts and the heuristic's algorithm) are cached per shape, dtype and
// pointer alignment. Cases cuBLASLt has no algorithm for, or pointers not 16-byte aligned, return
// false and the caller takes the fill + cublasGemmEx path. Defined in matmul.cu.
class LtMatmul {
 public:
  LtMatmul();
  ~LtMatmul();
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;
  // out = inp weight^T + bias in one cuBLASLt call (the BIAS epilogue); false where cuBLASLt has
  // no algorithm for the case (f32 too: it keeps the reference GEMM path).
  bool bias_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                    Workspace& ws, cudaStream_t s);
  // dinp = (dout weight) * gelu'(pre) in one cuBLASLt call (the DGELU epilogue: the product in
  // f32 times GELU's derivative at `pre`, rounded once); false where not taken (f32, shapes).
  bool dgelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& weight, const Tensor& pre,
                      Workspace& ws, cudaStream_t s);
  // out = gelu(inp weight^T + bias) in one cuBLASLt call (the GELU_BIAS epilogue, GELU when
  // `bias` is null: the product in f32, plus the bias, through GELU's tanh form, rounded once);
  // false where not taken (f32, widths not multiples of 8, no algorithm).
  bool gelu_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                    Workspace& ws, cudaStream_t s);

 private:
  struct Plan;
  struct Problem;
  struct Impl;
  bool run(const Problem& q, Workspace& ws, cudaStream_t s);
  std::unique_ptr<Impl> impl_;
};

// `blas` is bound to stream `s`; `lt` may be null (no cuBLASLt path).
void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                    cublasHandle_t blas, LtMatmul* lt, Workspace& ws, cudaStream_t s);
// Backend::gemm: c (M,N) f32 = alpha op(a) op(b) + beta c, row-major; a and b f32 or bf16;
// or a batch of them (3-D, c (L,M,N)), one strided batched call.
void gemm_2d(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta,
             cublasHandle_t blas);
void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, cublasHandle_t blas, Workspace& ws,
                     cudaStream_t s);
// dbias (OC, f32) += the column sums of dout (N, OC), in a fixed order (matmul_backward's).
void bias_backward(Tensor& dbias, const Tensor& dout, Workspace& ws, cudaStream_t s);
// Backend::grouped_matmul_*: one cublasGemmGroupedBatchedEx per call (each GEMM its own group),
// or one GEMM at a time where cuBLAS does not take the dtypes.
void grouped_matmul_forward(const std::vector<Backend::GroupedGemm>& groups, cublasHandle_t blas,
                            Workspace& ws, cudaStream_t s);
void grouped_matmul_backward(const std::vector<Backend::GroupedGemm>& groups, cublasHandle_t blas,
                             Workspace& ws, cudaStream_t s);

// ---- attention.cu -------------------------------------------------------------------------------

// Causal self-attention over qkv (B, T, (heads + 2*kv_heads)*hd) (query heads, then key heads,
// then value heads; kv_heads >= 1 divides heads, query head h reads key/value head
// h / (heads/kv_heads)): out (B, T, heads*hd) and the log-sum-exp of every score row,
// lse (B, heads, T), f32. `ws` is for kernels that need scratch (none today). With `drop` (null:
// none), attention dropout on the probabilities: the tensor-core kernels where they apply, else
// the one-thread-per-row kernels. With `alibi` (null: none), ALiBi's bias slope_h (j - i) on every
// scaled score (core/alibi.hpp), in every kernel (those without it run no code of it).
// `tensor_cores` false keeps to the generic kernels (--attention-backend unfused/local).
// `key_begin` (null: none): documents inside the samples ((B,T) int32, core/documents.hpp), on
// the tensor-core kernels only (the caller checks flash_supported first).
void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads, int64_t kv_heads,
                       const AttentionDropout* drop, const AttentionAlibi* alibi, Workspace& ws,
                       cudaStream_t s, bool tensor_cores = true,
                       const int32_t* key_begin = nullptr);
// dqkv (qkv's layout) from dout, the forward's inputs and outputs (out, lse), its dropout and its
// ALiBi; each key/value head's gradient sums its group's query heads (no atomics).
void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, int64_t heads, int64_t kv_heads,
                        const AttentionDropout* drop, const AttentionAlibi* alibi, Workspace& ws,
                        cudaStream_t s, bool tensor_cores = true,
                        const int32_t* key_begin = nullptr);

// ---- rope.cu ------------------------------------------------------------------------------------

// Rotary position embedding in place on the query and key heads of qkv (N, (H+2G)*hd) (values
// untouched); positions (N, int32) or null (row r at r % seq_len); inverse: rotate by -angle.
void rope(Tensor& qkv, const RopeSpec& spec, const Tensor* positions, bool inverse, cudaStream_t s);

// ---- kv_attention.cu ----------------------------------------------------------------------------

// qkv (N, (heads + 2*kv_heads)*hd), caches (slots, kv_heads, Tmax, hd), out (N, heads*hd), all of
// one dtype (f32, bf16 or f16). With `alibi` (null: none), ALiBi's bias slope_h (j - i) for cached
// position j and the query's position i. Split-K over the cached positions (flash_decode.cuh);
// asynchronous on `s` like the other ops.
void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                  const std::vector<Backend::KvSegment>& segments, int64_t heads, int64_t kv_heads,
                  const AttentionAlibi* alibi, Workspace& ws, cudaStream_t s);
// A decode step from a row table on the device ((n, 3) int32: slot, position, row), planned for
// positions below max_context: no host work that depends on the step (Backend::kv_decode). The
// rows' slots are distinct (one new token per sequence), and the decode kernel itself stores each
// row's key and value in the caches (no store kernel).
void kv_decode(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache, const Tensor& rows,
               int64_t max_context, int64_t heads, int64_t kv_heads, const AttentionAlibi* alibi,
               Workspace& ws, cudaStream_t s);

// ---- sampling.cu --------------------------------------------------------------------------------

// Backend::sample_tokens on the device: returns the ids (synchronizes the stream).
std::vector<int32_t> sample_tokens(const Tensor& logits, int64_t pieces, int64_t rows, int64_t V,
                                   const std::vector<TokenSampling>& how, Workspace& ws,
                                   cudaStream_t s);

// ---- cross_entropy.cu ---------------------------------------------------------------------------

void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid, cudaStream_t s);
void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits, const Tensor& rowmax,
                   const Tensor& targets, int64_t valid, int64_t col_begin, cudaStream_t s);
void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax, const Tensor& sumexp,
                        const Tensor& target_logit, const Tensor& targets, int64_t valid,
                        int64_t col_begin, float grad_scale, cudaStream_t s);

// ---- optim.cu -----------------------------------------------------------------------------------

// All operands f32.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                double weight_decay, int64_t step, cudaStream_t s);
// With `compute` (bf16/f16), each updated parameter is also written there, rounded as cast().
void adamw_step_flat(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                     const std::vector<AdamWSegment>& segments, const AdamWHyper& h, int64_t step,
                     Tensor* compute, Workspace& ws, cudaStream_t s);
// The sum of squares of every element of xs (f32), in a fixed order; waits for the stream.
double sum_squares_all(const std::vector<Tensor>& xs, Workspace& ws, cudaStream_t s);
// Result validation's gradient check: x's sum of squares added to per-block partials on the
// device (restart: they start from zero), without a round trip; collected_sum_squares reads them.
void collect_sum_squares(const Tensor& x, bool restart, Workspace& ws, cudaStream_t s);
double collected_sum_squares(Workspace& ws, cudaStream_t s);
void scale(Tensor& x, float factor, cudaStream_t s);

// ---- moe.cu ------------------------------------------------------------------------------------

// Backend::moe_* on the device (semantics: backend/cpu/moe.hpp). moe_route and moe_router_stats
// synchronize the stream (their results are host vectors). moe_unpermute without weight sums the
// slots (the permute's backward).
int64_t moe_route(Tensor& expert, Tensor& weight, Tensor& row, const Tensor& logits,
                  const MoERouting& r, int64_t group_rows, std::vector<int64_t>& routed,
                  std::vector<int64_t>& kept, Workspace& ws, cudaStream_t s);
void moe_router_stats(const Tensor& logits, const MoERouting& r, int64_t group_rows,
                      std::vector<double>& score_sums, double& lse_sq_sum, Workspace& ws,
                      cudaStream_t s);
void moe_router_backward(Tensor& dlogits, const Tensor& logits, const Tensor& expert,
                         const Tensor& weight, const Tensor& dweight, const MoERouting& r,
                         int64_t group_rows, const std::vector<double>& aux_grad, double z_grad,
                         Workspace& ws, cudaStream_t s);
void moe_permute(Tensor& x_perm, const Tensor& x, const Tensor& row, cudaStream_t s);
void moe_unpermute(Tensor& y, const Tensor& out, const Tensor& row, const Tensor* weight,
                   cudaStream_t s);
void moe_unpermute_backward(Tensor& dout, Tensor& dweight, const Tensor& dy, const Tensor& out,
                            const Tensor& row, const Tensor& weight, cudaStream_t s);

// ---- ring.cu -----------------------------------------------------------------------------------

// Context parallelism (Backend::ring_block_*, attention_merge, copy_columns; semantics in
// backend.hpp). The block ops run on the tensor-core attention kernels (bf16/f16, head dims 64
// and 128, no dropout or ALiBi); other blocks run the host reference on f32 copies (they
// synchronize the stream).
void attention_merge(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse,
                     int64_t q0, cudaStream_t s);
// Backend::copy_column_blocks in one launch.
void copy_column_blocks(Tensor& dst, int64_t dst_col, int64_t dst_stride, const Tensor& src,
                        int64_t src_col, int64_t src_stride, int64_t cols, int64_t blocks,
                        cudaStream_t s);
void copy_columns(Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t cols,
                  cudaStream_t s);
void ring_block_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv,
                        const RingBlockSpec& b, Workspace& ws, cudaStream_t s);
void ring_block_backward(Tensor& dqkv, Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                         const Tensor& kv, const Tensor& out, const Tensor& lse,
                         const RingBlockSpec& b, Workspace& ws, cudaStream_t s);

}  // namespace tessera::cuda_ops
