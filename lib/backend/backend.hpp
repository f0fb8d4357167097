// backend.hpp: the one op interface the model and the trainer call. Every op exists on the CPU
// (backend/cpu, the readable reference) and later on CUDA (backend/cuda), and is tested against the
// CPU one. Conventions: activation gradients are overwritten, except where a comment says
// "accumulated" (the residual stream); parameter gradients are always accumulated. Shapes are in
// comments: N is the number of tokens (B*T), C the hidden size, V a vocabulary shard.
//
// Precision (docs/model.md, mixed precision): activations and the weights an op reads are in the
// compute dtype (f32, bf16 or f16); parameter gradients, LayerNorm statistics, the attention
// log-sum-exp, the cross-entropy row statistics and losses, and everything AdamW touches are f32.
// Ops compute in f32 whatever the storage and round once on store.
#pragma once

#include <sys/mman.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backend/attention_backend.hpp"
#include "backend/cpu/kv_attention.hpp"
#include "backend/cpu/moe.hpp"
#include "backend/cpu/sampling.hpp"
#include "core/alibi.hpp"
#include "core/context_parallel.hpp"
#include "core/documents.hpp"
#include "core/dropout.hpp"
#include "core/error.hpp"
#include "core/fp8.hpp"
#include "core/rope.hpp"
#include "core/tensor.hpp"

namespace tessera {

struct AdamWHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  // Multiplies each gradient as it is read, in f32 (gradient clipping's coefficient: the same bits
  // as a scale pass before the step, without the pass).
  double grad_scale = 1;
};
// A range [begin, end) of the flat parameter buffer with one weight decay.
struct AdamWSegment {
  int64_t begin = 0, end = 0;
  double weight_decay = 0;
};

// sample_tokens' shapes; returns the columns per piece.
inline int64_t check_sample_tokens(const Tensor& logits, int64_t pieces, int64_t rows,
                                   int64_t vocab, const std::vector<TokenSampling>& how) {
  TESSERA_CHECK(pieces > 0 && rows > 0 && logits.numel() % (pieces * rows) == 0,
                "sample_tokens: logits ", shape_str(logits.shape()), " for ", pieces, " x ", rows,
                " rows");
  const int64_t Vl = logits.numel() / (pieces * rows);
  TESSERA_CHECK(logits.dtype() == DType::F32 && pieces * Vl >= vocab && vocab > 0 &&
                    static_cast<int64_t>(how.size()) == rows,
                "sample_tokens: logits ", shape_str(logits.shape()), " for ", pieces, " x ", rows,
                " rows of a vocabulary of ", vocab);
  return Vl;
}

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  // The device this rank runs on (CUDA's index; -1 for the CPU): with the host name, the
  // hardware identity of result validation's reruns.
  virtual int device_index() const { return -1; }
  virtual const char* name() const = 0;
  virtual Allocator& allocator() = 0;
  // False for the backend of shapes only (backend/shape_backend.hpp): host work that only feeds
  // its arithmetic (drawing the initial weights) is skipped.
  virtual bool computes() const { return true; }

  virtual void zero(Tensor& t) = 0;

  // Transfers between this backend's tensors and host memory of t.nbytes() bytes. They are
  // ordered with the backend's work: copy_to_host returns when the data has arrived; the host
  // buffer of copy_from_host may be reused as soon as the call returns.
  virtual void copy_from_host(Tensor& dst, const void* src) = 0;
  virtual void copy_to_host(void* dst, const Tensor& src) = 0;
  // Host memory that copy_to_host fills fastest (page-locked on CUDA, so the copy is one DMA at
  // full bandwidth; plain memory elsewhere). For staging buffers that live long (asynchronous
  // checkpoints); free with free_host. Throws Error when the memory is not there.
  // Here: 2 MiB-aligned and advised as transparent huge pages, so filling a large buffer the first
  // time takes 512 times fewer page faults. (Inline: Backend has no key function, so its type
  // information is emitted wherever a backend is defined.)
  virtual void* alloc_host(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    void* p = nullptr;
    if (posix_memalign(&p, kHuge, bytes > 0 ? bytes : 1) != 0 || !p)
      throw Error("host allocation of " + std::to_string(bytes) + " bytes failed");
    if (bytes >= kHuge) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: ignored where unsupported
    return p;
  }
  virtual void free_host(void* p) { std::free(p); }
  // dst = src converted to dst's dtype (f32 <-> bf16 / f16, round to nearest even).
  virtual void cast(Tensor& dst, const Tensor& src) = 0;
  // Waits until the work queued so far has finished (timers, profiling).
  virtual void synchronize() {}
  // The stream the backend's work runs on (a cudaStream_t), for communicators to order against;
  // null on the CPU.
  virtual void* stream() { return nullptr; }
  // Brackets the steps a profiler should capture (cudaProfilerStart/Stop on CUDA).
  virtual void profiler_start() {}
  virtual void profiler_stop() {}

  // out (N,C) = table[ids - row_begin], zero rows for ids outside this shard of the vocabulary.
  virtual void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                                 int64_t row_begin) = 0;
  // dtable (V,C) accumulated from dout (N,C); deterministic.
  virtual void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                  int64_t row_begin) = 0;
  // out (B,T,C) += wpe[0:T]; dwpe accumulated with the batch sum of dout.
  virtual void position_embedding_forward(Tensor& out, const Tensor& wpe) = 0;
  virtual void position_embedding_backward(Tensor& dwpe, const Tensor& dout) = 0;

  // out (N,C), mean and rstd (N) saved for the backward; dinp is accumulated.
  virtual void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                 const Tensor& weight, const Tensor& bias, double eps) = 0;
  // sum = a + b (the residual stream) and out = LayerNorm(sum): one pass on CUDA. The default is
  // add then layernorm_forward.
  virtual void add_layernorm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd,
                                     const Tensor& a, const Tensor& b, const Tensor& weight,
                                     const Tensor& bias, double eps) {
    add(sum, a, b);
    layernorm_forward(out, mean, rstd, sum, weight, bias, eps);
  }
  virtual void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout,
                                  const Tensor& inp, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd) = 0;

  // RMSNorm: out (N,C) = inp * rstd * weight, rstd (N) = 1/sqrt(mean(inp^2) + eps) saved for the
  // backward; dinp and dweight are accumulated.
  virtual void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                               double eps) = 0;
  virtual void add_rmsnorm_forward(Tensor& sum, Tensor& out, Tensor& rstd, const Tensor& a,
                                   const Tensor& b, const Tensor& weight, double eps) {
    add(sum, a, b);
    rmsnorm_forward(out, rstd, sum, weight, eps);
  }
  virtual void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                const Tensor& inp, const Tensor& weight, const Tensor& rstd) = 0;

  // out (N,OC) = inp (N,IC) * weight (OC,IC)^T + bias (OC, optional).
  virtual void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                              const Tensor* bias) = 0;
  // dinp (N,IC) overwritten when given; dweight and dbias (when given) accumulated. An undefined
  // dweight asks for the input gradient alone (bias skipped too): zero-bubble's B pass, whose W
  // pass later calls with dinp null. Apart or together, the results are the same bits.
  virtual void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                               const Tensor& inp, const Tensor& weight) = 0;

  // A group of GEMMs without bias, one per expert (each on its own rows): for each g,
  // out_g = inp_g weight_g^T (forward); dinp_g overwritten (when given) and dweight_g accumulated
  // (backward). The default runs matmul_forward / matmul_backward one group at a time; the CUDA
  // backend issues one grouped GEMM per call.
  struct GroupedGemm {
    Tensor* out;      // forward: out; backward: dinp (may be null)
    Tensor* dweight;  // backward only (null: the input gradients alone, as matmul_backward's)
    const Tensor* inp;
    const Tensor* dout;  // backward only
    const Tensor* weight;
  };
  virtual void grouped_matmul_forward(const std::vector<GroupedGemm>& groups) {
    for (const GroupedGemm& g : groups) matmul_forward(*g.out, *g.inp, *g.weight, nullptr);
  }
  virtual void grouped_matmul_backward(const std::vector<GroupedGemm>& groups) {
    Tensor none;
    for (const GroupedGemm& g : groups)
      matmul_backward(g.out, g.dweight ? *g.dweight : none, nullptr, *g.dout, *g.inp, *g.weight);
  }

  // FP8 GEMMs (docs/training.md, "FP8"; model/fp8.hpp keeps the scaling state). An operand is
  // quantized as fp8(x * scale) in its format (core/fp8.hpp: round to nearest even, saturating),
  // `scale` being element 0 of a 1-element f32 tensor of this backend; the GEMM multiplies the
  // quantized operands and applies 1/scale of each to the f32 sum. Biases are added in the
  // output's precision; dbias is the sum of the unquantized output gradient. The base class has
  // none of them: a backend without FP8 says so (the CPU backend emulates them exactly).
  struct Fp8Operand {
    const Tensor* scale = nullptr;
    Fp8Format format = Fp8Format::E4M3;
  };
  // amax (1) f32 = max |x| (NaN counted as +inf); with `accumulate`, the maximum of that and amax.
  virtual void fp8_amax(Tensor& amax, const Tensor& x, bool accumulate) {
    (void)amax, (void)x, (void)accumulate;
    throw Error(std::string("FP8 is not available on the ") + name() + " backend");
  }
  // Current (tensorwise) scaling: scale (1) = fp8_max(format) / amax (1) in f32 (1 where amax is
  // 0, inf or NaN; the largest float where the quotient overflows).
  virtual void fp8_current_scale(Tensor& scale, const Tensor& amax, Fp8Format format) {
    (void)scale, (void)amax, (void)format;
    throw Error(std::string("FP8 is not available on the ") + name() + " backend");
  }
  // Delayed scaling at the end of a step, for n tensors: history (H,n) f32, scale (n), the step's
  // amax (n, cleared), fp8_max (n) of each tensor's format: Transformer Engine's update
  // (backend/cpu/fp8.hpp, fp8_delayed_update).
  virtual void fp8_delayed_update(Tensor& history, Tensor& scale, Tensor& amax,
                                  const Tensor& fp8_max, bool most_recent, int margin) {
    (void)history, (void)scale, (void)amax, (void)fp8_max, (void)most_recent, (void)margin;
    throw Error(std::string("FP8 is not available on the ") + name() + " backend");
  }
  // matmul_forward with inp and weight quantized.
  virtual void fp8_matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                                  const Tensor* bias, const Fp8Operand& x, const Fp8Operand& w) {
    (void)out, (void)inp, (void)weight, (void)bias, (void)x, (void)w;
    throw Error(std::string("FP8 is not available on the ") + name() + " backend");
  }
  // matmul_backward with dout (g), inp (x) and weight (w) quantized: dinp from g and w, dweight
  // from g and x.
  virtual void fp8_matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                                   const Tensor& inp, const Tensor& weight, const Fp8Operand& g,
                                   const Fp8Operand& x, const Fp8Operand& w) {
    (void)dinp, (void)dweight, (void)dbias, (void)dout, (void)inp, (void)weight, (void)g, (void)x,
        (void)w;
    throw Error(std::string("FP8 is not available on the ") + name() + " backend");
  }

  // Causal attention. qkv (B,T,(H+2G)*hd): per token the H query heads, then the G key heads,
  // then the G value heads (G = kv_heads; 0 means H, and then this is [3,H,hd]). Query head h
  // attends with key/value head h / (H/G) (grouped-query attention; G = 1 is multi-query); K and
  // V are read in place, never repeated. out (B,T,H*hd), lse (B,H,T) saved. With `dropout`,
  // attention dropout on the probabilities (core/dropout.hpp); the backward must get the
  // forward's. dqkv has qkv's layout; each key/value head's gradient sums its group's heads.
  // With `alibi`, ALiBi's bias slope_h * (j - i) (core/alibi.hpp) is added to every scaled score
  // before the softmax (lse includes it); the backward must get the forward's. With `docs`
  // (core/documents.hpp), row t sees only keys key_begin[t] .. t, and ALiBi's distance is
  // taken between the rows' position ids.
  virtual void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads,
                                 const AttentionDropout* dropout = nullptr, int64_t kv_heads = 0,
                                 const AttentionAlibi* alibi = nullptr,
                                 const AttentionDocuments* docs = nullptr) = 0;
  virtual void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                                  const Tensor& out, const Tensor& lse, int64_t heads,
                                  const AttentionDropout* dropout = nullptr, int64_t kv_heads = 0,
                                  const AttentionAlibi* alibi = nullptr,
                                  const AttentionDocuments* docs = nullptr) = 0;
  // Which attention kernels attention_forward/backward run (Megatron's --attention-backend,
  // backend/attention_backend.hpp); `deterministic` (--deterministic-mode) asks for a backward
  // that gives the same bits on every run. Throws ConfigError for a choice this backend does not
  // have. The CPU backend's one attention is its reference (deterministic).
  virtual void set_attention_backend(AttentionBackend b, bool /*deterministic*/) {
    if (b == AttentionBackend::Fused || b == AttentionBackend::Flash)
      throw ConfigError(std::string("--attention-backend ") + attention_backend_name(b) +
                        " needs --device cuda (the CPU backend's one attention is its reference: "
                        "give auto, unfused or local)");
  }
  // Which kernels run an attention call of this shape, and why: one line for the start-up log.
  // Throws ConfigError where the chosen backend cannot run it (fused: cuDNN's reason).
  virtual std::string attention_plan(const AttentionCall& /*c*/) { return "the CPU reference"; }

  // Context parallelism's ring attention (model/context_parallel.cpp, docs/parallelism.md). One
  // block: query rows [q0, q0 + nq) of each sample of qkv (B,T,(H+2G)*hd; the layout above)
  // attend to key/value rows [k0, k0 + nk) of kv (B,T,2G*hd: the G key heads, then the G value
  // heads of CP rank k_rank, the block's owner). Positions are global: local row t of CP rank r
  // is at cp_position(r, cp, T/2, t) (core/context_parallel.hpp) of a sequence of cp*T tokens;
  // with `causal` a query sees the keys at or before its position. Attention dropout and ALiBi
  // (null when off) are keyed by those global positions, as attention_forward keys them for the
  // whole sequence.
  using RingBlock = RingBlockSpec;
  // out (B,nq,H*hd) and lse (B,H,nq) f32: the block's normalized partial output and log-sum-exp
  // (a row that sees no key: 0 and -inf).
  virtual void ring_block_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv,
                                  const RingBlock& blk) = 0;
  // The block's backward, given the rows' final out (B,T,H*hd) and lse (B,H,T) (after every
  // merge): adds the block's dQ to the query columns of dqkv (B,T,(H+2G)*hd) rows [q0, q0 + nq)
  // and its dK, dV to dkv (B,T,2G*hd) rows [k0, k0 + nk).
  virtual void ring_block_backward(Tensor& dqkv, Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                                   const Tensor& kv, const Tensor& out, const Tensor& lse,
                                   const RingBlock& blk) = 0;
  // Merges a block's partial (part_out (B,nq,H*hd), part_lse (B,H,nq) f32) into the running out
  // (B,T,H*hd) and lse (B,H,T) at rows [q0, q0 + nq): L = log(e^L + e^Li),
  // O = O e^(L_old − L) + Oi e^(Li − L); a part row with lse -inf changes nothing.
  virtual void attention_merge(Tensor& out, Tensor& lse, const Tensor& part_out,
                               const Tensor& part_lse, int64_t q0) = 0;
  // Column copy between row-major tensors of the same dtype and number of rows:
  // dst[r, dst_col + i] = src[r, src_col + i] for i < cols (widths: the last dimensions).
  virtual void copy_columns(Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                            int64_t cols) = 0;
  // `blocks` column copies of `cols` columns each: block b from src column src_col + b *
  // src_stride to dst column dst_col + b * dst_stride (src_stride 0 broadcasts one block; MLA's
  // per-head assembly). This default calls copy_columns per block.
  virtual void copy_column_blocks(Tensor& dst, int64_t dst_col, int64_t dst_stride,
                                  const Tensor& src, int64_t src_col, int64_t src_stride,
                                  int64_t cols, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b)
      copy_columns(dst, dst_col + b * dst_stride, src, src_col + b * src_stride, cols);
  }

  // Generation: appends the new tokens' keys and values (from qkv (N, (H+2G)*hd), the layout
  // above) to the caches (slots, G, Tmax, hd) and attends each new query to its sequence's
  // cached positions.
  using KvSegment = cpu::KvSegment;
  // With `alibi`, the bias slope_h * (j - i) for cached position j and the query's position i.
  virtual void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                            const std::vector<KvSegment>& segments, int64_t heads,
                            int64_t kv_heads = 0, const AttentionAlibi* alibi = nullptr) = 0;

  // A decode step (one new token per sequence) with its row table already on the device: rows
  // (n, 3) int32, row i = (cache slot, position, row of qkv and out), for the n rows of qkv. Same
  // result as kv_attention with n one-token segments; the work is planned for contexts up to
  // `max_context` instead of the step's own, so nothing about the launch depends on the step and a
  // CUDA graph can replay it. This default reads the table back and calls kv_attention.
  virtual void kv_decode(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                         const Tensor& rows, int64_t max_context, int64_t heads,
                         int64_t kv_heads = 0, const AttentionAlibi* alibi = nullptr) {
    (void)max_context;
    TESSERA_CHECK(rows.dtype() == DType::I32 && rows.ndim() == 2 && rows.dim(1) == 3,
                  "kv_decode: the row table must be (n, 3) int32");
    std::vector<int32_t> t(static_cast<size_t>(rows.numel()));
    copy_to_host(t.data(), rows);
    std::vector<KvSegment> segments;
    for (int64_t i = 0; i < rows.dim(0); ++i)
      segments.push_back({t[3 * i], t[3 * i + 1], 1, t[3 * i + 2]});
    kv_attention(out, qkv, k_cache, v_cache, segments, heads, kv_heads, alibi);
  }

  // CUDA graphs. Between graph_begin() (true: capturing) and graph_end(), the ops called on this
  // backend are recorded on its stream instead of run; graph_end() returns a handle for
  // graph_launch(), which runs them again as recorded (same tensors, same kernel arguments: the
  // inputs that change must be in tensors written before the launch), or -1 when the capture
  // failed (an op did something a graph cannot hold; nothing ran). An op that throws during the
  // capture must be followed by graph_abort(). Backends without graphs (this default) return false
  // from graph_begin and the caller runs the ops itself.
  virtual bool graph_begin() { return false; }
  virtual int64_t graph_end() { return -1; }
  virtual void graph_abort() {}
  virtual void graph_launch(int64_t graph) {
    TESSERA_CHECK(false, "graph_launch(", graph, ") on a backend without graphs");
  }
  // Frees a captured graph (its handle becomes invalid).
  virtual void graph_release(int64_t graph) { (void)graph; }

  // Generation: the next token of each of `rows` rows of f32 logits, chosen as cpu::sample_token
  // chooses (how[i] for row i), with only the ids coming back to the host. `logits` holds
  // `pieces` tensor-parallel shards of the vocabulary as all_gather leaves them, (pieces, rows,
  // Vl): column c of row i is element ((c / Vl) * rows + i) * Vl + c % Vl; the true vocabulary is
  // the first `vocab` columns. This default runs on the host (the logits copied back); the CUDA
  // backend samples on the device.
  virtual std::vector<int32_t> sample_tokens(const Tensor& logits, int64_t pieces, int64_t rows,
                                             int64_t vocab, const std::vector<TokenSampling>& how) {
    const int64_t Vl = check_sample_tokens(logits, pieces, rows, vocab, how);
    std::vector<float> host(static_cast<size_t>(logits.numel())), row(static_cast<size_t>(vocab));
    copy_to_host(host.data(), logits);
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c = 0; c < vocab; ++c) row[c] = host[((c / Vl) * rows + i) * Vl + c % Vl];
      ids[i] = cpu::sample_token(row.data(), vocab, how[i]);
    }
    return ids;
  }

  // Rotary position embedding (RoPE), in place on the query and key heads of qkv (N rows in the
  // layout above; values untouched): in each head the first rot_dim features rotate in pairs
  // (i, i + rot_dim/2) by angle pos * base^(-2i/rot_dim) (the "rotate half" convention of
  // Megatron-LM and Hugging Face Llama), or pairs (2i, 2i+1) with spec.interleaved; features
  // past rot_dim pass. Row r has position
  // positions[r] (int32, N) when given, else r % seq_len. `inverse` rotates by minus the angle:
  // the backward, applied to the gradient.
  virtual void rope(Tensor& qkv, const RopeSpec& spec, const Tensor* positions, bool inverse) = 0;

  virtual void gelu_forward(Tensor& out, const Tensor& inp) = 0;
  // dinp = dout * gelu'(inp); dinp may be dout.
  virtual void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) = 0;
  // The MLP's first linear layer with its GELU (generation's forward): out = gelu(inp weight^T +
  // bias), bias optional; `pre` (like out) is scratch for the product before the GELU, its
  // contents afterwards unspecified. This default composes matmul_forward and gelu_forward; the
  // CUDA backend in bf16/f16 applies the GELU in cuBLASLt's GELU_BIAS epilogue (one kernel, the
  // product rounded once, `pre` not written).
  virtual void matmul_gelu_forward(Tensor& out, Tensor& pre, const Tensor& inp,
                                   const Tensor& weight, const Tensor* bias) {
    matmul_forward(pre, inp, weight, bias);
    gelu_forward(out, pre);
  }
  // The MLP's second linear layer's backward through the GELU before it: dweight and dbias (when
  // given; an undefined dweight skips them, as matmul_backward's) accumulated as matmul_backward's,
  // and dpre = (dout weight) * gelu'(pre) (the gradient at the GELU's input, overwritten). This
  // default composes matmul_backward and gelu_backward; the CUDA backend in bf16/f16 takes GELU's
  // derivative in cuBLASLt's DGELU epilogue (the product rounded once, not twice).
  virtual void matmul_gelu_backward(Tensor& dpre, Tensor& dweight, Tensor* dbias,
                                    const Tensor& dout, const Tensor& inp, const Tensor& weight,
                                    const Tensor& pre) {
    matmul_backward(&dpre, dweight, dbias, dout, inp, weight);
    gelu_backward(dpre, pre, dpre);
  }
  // Squared ReLU (--squared-relu): out = max(inp, 0)^2; the backward dinp = dout * 2 max(inp, 0)
  // (dinp may be dout).
  virtual void squared_relu_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void squared_relu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) = 0;
  // SwiGLU: inp (N,2F) holds [gate | up] per row; out (N,F) = silu(gate) * up. The backward
  // overwrites dinp (N,2F) from dout (N,F).
  virtual void swiglu_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void swiglu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) = 0;
  virtual void add(Tensor& out, const Tensor& a, const Tensor& b) = 0;
  // Hidden dropout: out = in times the mask of `d` (0 or 1/(1-p)); in place allowed. The tensors
  // are rows of the hidden width C (the last dimension); local row r is row row_begin + r of the
  // micro-batch's B*T rows (sequence parallelism holds a slice of them), so element (r, c) is
  // element t*C + c of sample d.sample_begin + (row_begin + r) / seq_len, t its position. The
  // backward is the same call on the gradient.
  virtual void dropout(Tensor& out, const Tensor& in, const DropoutSpec& d, int64_t row_begin,
                       int64_t seq_len) = 0;

  // Vocab-parallel softmax cross-entropy in three passes (see backend/cpu/cross_entropy.hpp):
  // logits (N,V) hold columns [col_begin, col_begin+V) of the padded vocabulary, of which the
  // first valid_cols are real tokens. targets (N) int32, < 0 means "no loss here".
  virtual void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid_cols) = 0;
  virtual void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits,
                             const Tensor& rowmax, const Tensor& targets, int64_t valid_cols,
                             int64_t col_begin) = 0;
  // losses (N); logits overwritten with dloss/dlogits * grad_scale.
  virtual void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax,
                                  const Tensor& sumexp, const Tensor& target_logit,
                                  const Tensor& targets, int64_t valid_cols, int64_t col_begin,
                                  float grad_scale) = 0;

  // AdamW on one parameter range; step counts from 1.
  virtual void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                          const AdamWHyper& h, double weight_decay, int64_t step) = 0;
  // AdamW over all the flat buffers at once, each segment with its weight decay (one launch on
  // CUDA). With `compute` (a bf16/f16 buffer of params' size: mixed precision's compute copy),
  // each updated parameter is also written there, rounded as cast() rounds it: the copy's refresh
  // without a pass of its own. The default applies adamw_step segment by segment, then casts the
  // segments: the same arithmetic.
  virtual void adamw_step_flat(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                               const std::vector<AdamWSegment>& segments, const AdamWHyper& h,
                               int64_t step, Tensor* compute = nullptr) {
    for (const AdamWSegment& s : segments) {
      const Shape n{s.end - s.begin};
      Tensor p = params.view(s.begin, n), mm = m.view(s.begin, n), vv = v.view(s.begin, n);
      adamw_step(p, grads.view(s.begin, n), mm, vv, h, s.weight_decay, step);
      if (compute) {
        Tensor c = compute->view(s.begin, n);
        cast(c, p);
      }
    }
  }
  virtual double sum_squares(const Tensor& x) = 0;
  // Sum of squares over several tensors with one result (one device round trip on CUDA).
  virtual double sum_squares_all(const std::vector<Tensor>& xs) {
    double s = 0;
    for (const Tensor& x : xs) s += sum_squares(x);
    return s;
  }
  // A sum of squares gathered over several calls and read once (result validation's check of
  // each gradient bucket before its reduction: no device round trip a bucket). restart: the
  // first tensor of a new sum.
  virtual void collect_sum_squares(const Tensor& x, bool restart) {
    collected_squares_ = (restart ? 0.0 : collected_squares_) + sum_squares(x);
  }
  virtual double collected_sum_squares() { return collected_squares_; }
  virtual void scale(Tensor& x, float s) = 0;
  // A plain GEMM on 2-D row-major tensors: c (M,N) = alpha op(a) op(b) + beta c, op(x) = x^T
  // when asked; or a batch of them, all three 3-D with the same leading size (c (L,M,N): one
  // strided batched GEMM on CUDA). c is f32; a and b f32, or bf16 both on CUDA (cuBLAS, f32
  // accumulation). Muon's Newton-Schulz iterations (step/muon.hpp).
  virtual void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    float alpha, float beta) = 0;
  // Mixture of Experts (backend/cpu/moe.hpp has the semantics, on host arrays). logits and
  // dlogits (N,E), weight and dweight (N,K) are f32; expert and row (N,K) int32; x, dx (N,C) and
  // the permuted x_perm, out, dout, dx_perm (R,C) rows are in the compute dtype. These defaults
  // run the host reference (staging through the host off the CPU); a backend may replace them.
  virtual int64_t moe_route(Tensor& expert, Tensor& weight, Tensor& row, const Tensor& logits,
                            const MoERouting& r, int64_t group_rows, std::vector<int64_t>& routed,
                            std::vector<int64_t>& kept);
  virtual void moe_router_stats(const Tensor& logits, const MoERouting& r, int64_t group_rows,
                                std::vector<double>& score_sums, double& lse_sq_sum);
  virtual void moe_router_backward(Tensor& dlogits, const Tensor& logits, const Tensor& expert,
                                   const Tensor& weight, const Tensor& dweight, const MoERouting& r,
                                   int64_t group_rows, const std::vector<double>& aux_grad,
                                   double z_grad);
  virtual void moe_permute(Tensor& x_perm, const Tensor& x, const Tensor& row);
  virtual void moe_unpermute(Tensor& y, const Tensor& out, const Tensor& row, const Tensor& weight);
  virtual void moe_unpermute_backward(Tensor& dout, Tensor& dweight, const Tensor& dy,
                                      const Tensor& out, const Tensor& row, const Tensor& weight);
  virtual void moe_permute_backward(Tensor& dx, const Tensor& dx_perm, const Tensor& row);

  // Memory this rank holds, in bytes: tensor storage now and at most since start-up (allocated,
  // max allocated), and what the process holds of the device (CUDA: cudaMemGetInfo's used
  // memory) or of the host (its resident set). `reserved_what` names the latter.
  struct MemoryStats {
    double allocated = 0, max_allocated = 0, reserved = 0;
    const char* reserved_what = "";
  };
  // The default: host storage (the CPU backend's).
  virtual MemoryStats memory_stats() {
    MemoryStats m;
    m.allocated = static_cast<double>(host_allocated_bytes());
    m.max_allocated = static_cast<double>(host_peak_allocated_bytes());
    m.reserved = static_cast<double>(resident_set_bytes());
    m.reserved_what = "host resident set";
    return m;
  }
  // Elements equal to zero (an f32 tensor; --log-num-zeros-in-grad at log intervals). This
  // default reads the tensor back to the host.
  virtual double count_zeros(const Tensor& x) {
    TESSERA_CHECK(x.dtype() == DType::F32, "count_zeros takes f32");
    std::vector<float> host(static_cast<size_t>(x.numel()));
    copy_to_host(host.data(), x);
    double zeros = 0;
    for (float v : host) zeros += v == 0.0f;
    return zeros;
  }

 private:
  double collected_squares_ = 0;  // collect_sum_squares's default
};

std::unique_ptr<Backend> make_cpu_backend();

// Argument checks every backend makes (a failure is a caller's bug).
// ALiBi's heads lie within the model's.
inline void check_alibi_heads(const AttentionAlibi* a, int64_t heads) {
  if (!a) return;
  TESSERA_CHECK(a->head_begin >= 0 && a->head_begin + heads <= a->heads_total, "ALiBi heads [",
                a->head_begin, ", ", a->head_begin + heads, ") outside ", a->heads_total, " heads");
}
// ring_block_forward/backward's shapes: returns (B, T, hd) of qkv, checking kv, the block's rows
// and heads.
struct RingShape {
  int64_t B, T, hd, G;
};
inline RingShape check_ring_block(const Tensor& qkv, const Tensor& kv, const RingBlockSpec& b) {
  const int64_t H = b.heads, G = b.kv_heads > 0 ? b.kv_heads : b.heads;
  TESSERA_CHECK(qkv.ndim() == 3 && H > 0 && H % G == 0 && qkv.dim(2) % (H + 2 * G) == 0,
                "ring block: qkv shape ", shape_str(qkv.shape()), " for ", H, " heads and ", G,
                " key/value heads");
  const int64_t B = qkv.dim(0), T = qkv.dim(1), hd = qkv.dim(2) / (H + 2 * G);
  TESSERA_CHECK(kv.numel() == B * T * 2 * G * hd && kv.dtype() == qkv.dtype(),
                "ring block: kv must be (B,T,2G*hd) in qkv's dtype");
  TESSERA_CHECK(T % 2 == 0 && b.cp >= 1 && b.q0 >= 0 && b.nq >= 0 && b.q0 + b.nq <= T &&
                    b.k0 >= 0 && b.nk >= 0 && b.k0 + b.nk <= T,
                "ring block: rows [", b.q0, ", ", b.q0 + b.nq, ") and [", b.k0, ", ", b.k0 + b.nk,
                ") of ", T);
  return {B, T, hd, G};
}

// attention_merge's shapes: out (B,T,H*hd), lse (B,H,T) f32, part_out (B,nq,H*hd), part_lse
// (B,H,nq) f32, rows [q0, q0 + nq) inside T.
struct MergeShape {
  int64_t B, T, H, hd, nq;
};
inline MergeShape check_attention_merge(const Tensor& out, const Tensor& lse,
                                        const Tensor& part_out, const Tensor& part_lse,
                                        int64_t q0) {
  TESSERA_CHECK(out.ndim() == 3 && lse.ndim() == 3 && part_lse.ndim() == 3 &&
                    lse.dtype() == DType::F32 && part_lse.dtype() == DType::F32 &&
                    part_out.dtype() == out.dtype(),
                "attention_merge: out (B,T,H*hd), lse (B,H,T) f32 and the parts alike");
  MergeShape m{out.dim(0), out.dim(1), lse.dim(1), 0, part_lse.dim(2)};
  TESSERA_CHECK(m.H > 0 && out.dim(2) % m.H == 0 && lse.dim(0) == m.B && lse.dim(2) == m.T &&
                    part_lse.dim(0) == m.B && part_lse.dim(1) == m.H && q0 >= 0 &&
                    q0 + m.nq <= m.T && part_out.numel() == m.B * m.nq * out.dim(2),
                "attention_merge: shapes ", shape_str(out.shape()), ", ", shape_str(lse.shape()),
                ", ", shape_str(part_out.shape()), ", ", shape_str(part_lse.shape()), " at row ",
                q0);
  m.hd = out.dim(2) / m.H;
  return m;
}

// copy_columns' shapes: rows and widths (the last dimensions) of dst and src.
struct ColumnCopy {
  int64_t rows, dst_width, src_width;
};
inline ColumnCopy check_copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src,
                                     int64_t src_col, int64_t cols) {
  TESSERA_CHECK(dst.ndim() >= 1 && src.ndim() >= 1 && dst.dtype() == src.dtype(),
                "copy_columns: tensors of one dtype");
  ColumnCopy c{0, dst.dim(dst.ndim() - 1), src.dim(src.ndim() - 1)};
  c.rows = c.dst_width > 0 ? dst.numel() / c.dst_width : 0;
  TESSERA_CHECK(c.src_width > 0 && src.numel() / c.src_width == c.rows && cols >= 0 &&
                    dst_col >= 0 && src_col >= 0 && dst_col + cols <= c.dst_width &&
                    src_col + cols <= c.src_width,
                "copy_columns: ", cols, " columns from ", src_col, " of ", shape_str(src.shape()),
                " to ", dst_col, " of ", shape_str(dst.shape()));
  return c;
}

// kv_attention's shapes and segments (dtypes are the backend's business); returns the key/value
// heads G.
inline int64_t check_kv_attention(const Tensor& out, const Tensor& qkv, const Tensor& k_cache,
                                  const Tensor& v_cache,
                                  const std::vector<Backend::KvSegment>& segments, int64_t heads,
                                  int64_t kv_heads) {
  const int64_t G = kv_heads > 0 ? kv_heads : heads;
  TESSERA_CHECK(k_cache.ndim() == 4 && k_cache.dim(1) == G && heads % G == 0 &&
                    v_cache.shape() == k_cache.shape(),
                "kv cache shape ", shape_str(k_cache.shape()), " for ", heads, " heads and ", G,
                " key/value heads");
  const int64_t hd = k_cache.dim(3), Tmax = k_cache.dim(2);
  const int64_t rows = qkv.numel() / qkv.shape().back();
  TESSERA_CHECK(qkv.shape().back() == (heads + 2 * G) * hd && out.shape().back() == heads * hd,
                "kv attention shapes");
  for (const Backend::KvSegment& s : segments)
    TESSERA_CHECK(s.slot >= 0 && s.slot < k_cache.dim(0) && s.pos0 >= 0 && s.count >= 0 &&
                      s.row0 >= 0 && s.pos0 + s.count <= Tmax && s.row0 + s.count <= rows,
                  "kv attention segment outside the cache or the rows");
  return G;
}

}  // namespace tessera
