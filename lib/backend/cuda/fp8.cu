// fp8.cu: the CUDA backend's FP8 ops (backend.hpp, "FP8 GEMMs"; docs/training.md, "FP8"): the
// amax and the scales on the device (nothing comes back to the host), the quantize-and-transpose
// kernels of fp8.cuh, and cuBLASLt's FP8 GEMMs. Hopper's FP8 GEMMs take A transposed and B not
// ("TN"), so each GEMM gets its operands in that layout:
//   forward  out (N,OC)  = Xq (N,IC)   . Wq (OC,IC)^T   A = Wq,  B = Xq    fast accumulation
//   dgrad    dX  (N,IC)  = dYq (N,OC)  . Wt (IC,OC)^T   A = Wt,  B = dYq   split accumulation
//   wgrad    dW  (OC,IC) += dYt (OC,N) . Xt (IC,N)^T    A = Xt,  B = dYt   split, f32 out, beta 1
// (row-major shapes; Wt, Xt, dYt the transposed quantized copies). The GEMM multiplies the FP8
// values and applies both operands' 1/scale to the f32 sum; biases are added in the epilogue.
#include <cublasLt.h>

#include <map>
#include <tuple>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/lt_plan.hpp"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

template <typename T>
__global__ void __launch_bounds__(fp8k::kThreads)
    amax_partial_kernel(float* partial, const T* x, int64_t n, int64_t chunk) {
  __shared__ float sh[fp8k::kThreads / 32];
  fp8k::amax_partial(partial, x, n, chunk, sh);
}
__global__ void __launch_bounds__(fp8k::kThreads)
    amax_final_kernel(float* amax, const float* partial, int64_t blocks, bool accumulate) {
  __shared__ float sh[fp8k::kThreads / 32];
  fp8k::amax_final(amax, partial, blocks, accumulate, sh);
}
__global__ void current_scale_kernel(float* scale, const float* amax, float fmax) {
  scale[0] = fp8_scale_for(amax[0], fmax, 0, 1.0f);
}
__global__ void delayed_update_kernel(float* history, float* scale, float* amax, const float* fmax,
                                      int64_t H, int64_t n, bool most_recent, int margin) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  fp8_delayed_update_one(history + i, H, n, scale[i], amax[i], fmax[i], most_recent, margin);
  amax[i] = 0;
}
template <typename T>
__global__ void __launch_bounds__(fp8k::kThreads)
    quantize_kernel(const T* x, int64_t rows, int64_t cols, const float* scale, Fp8Format f,
                    uint8_t* q, uint8_t* qt, int64_t ldt, float* scale_inv, int64_t step) {
  __shared__ uint8_t sh[fp8k::kTileBytes];
  fp8k::quantize_tiles(x, rows, cols, scale, f, q, qt, ldt, scale_inv, int64_t(blockIdx.y), step,
                       sh);
}

cudaDataType_t fp8_type(Fp8Format f) {
  return f == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

constexpr size_t kFp8LtWorkspaceBytes = size_t(32) << 20;

// Byte offsets of the quantized copies and scale inverses in the kFp8 scratch buffer.
size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

}  // namespace

void fp8_amax(Tensor& amax, const Tensor& x, bool accumulate, Workspace& ws, cudaStream_t s) {
  expect_dtype(amax, DType::F32, "fp8 amax");
  const int64_t n = x.numel(), blocks = fp8k::amax_blocks(n);
  float* partial = ws.get<float>(Scratch::kPartials, blocks);
  dispatch(x.dtype(), "fp8 amax", [&](auto tag) {
    using T = decltype(tag);
    amax_partial_kernel<T><<<static_cast<unsigned>(blocks), fp8k::kThreads, 0, s>>>(
        partial, x.data<T>(), n, fp8k::amax_chunk(n));
  });
  LAUNCH_CHECK();
  amax_final_kernel<<<1, fp8k::kThreads, 0, s>>>(amax.f32(), partial, n > 0 ? blocks : 0,
                                                 accumulate);
  LAUNCH_CHECK();
}

void fp8_current_scale(Tensor& scale, const Tensor& amax, Fp8Format f, cudaStream_t s) {
  current_scale_kernel<<<1, 1, 0, s>>>(scale.f32(), amax.f32(), fp8_max(f));
  LAUNCH_CHECK();
}

void fp8_delayed_update(Tensor& history, Tensor& scale, Tensor& amax, const Tensor& fmax,
                        bool most_recent, int margin, cudaStream_t s) {
  const int64_t n = scale.numel();
  TESSERA_CHECK(n > 0 && amax.numel() == n && fmax.numel() == n && history.numel() % n == 0,
                "fp8_delayed_update shapes");
  delayed_update_kernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, s>>>(
      history.f32(), scale.f32(), amax.f32(), fmax.f32(), history.numel() / n, n, most_recent,
      margin);
  LAUNCH_CHECK();
}

void fp8_quantize(const Tensor& x, int64_t rows, int64_t cols, const float* scale, Fp8Format f,
                  uint8_t* q, uint8_t* qt, float* scale_inv, cudaStream_t s) {
  const int64_t row_tiles = (rows + fp8k::kTile - 1) / fp8k::kTile;
  const int64_t col_tiles = (cols + fp8k::kTile - 1) / fp8k::kTile;
  if (rows == 0 || cols == 0) return;
  TESSERA_CHECK(col_tiles <= 0x7FFFFFFF, "fp8 quantize: ", cols, " columns");
  const int64_t gy = row_tiles < 65535 ? row_tiles : 65535;
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(gy));
  dispatch(x.dtype(), "fp8 quantize", [&](auto tag) {
    using T = decltype(tag);
    quantize_kernel<T><<<grid, fp8k::kThreads, 0, s>>>(x.data<T>(), rows, cols, scale, f, q, qt,
                                                       fp8_padded(rows), scale_inv, gy);
  });
  LAUNCH_CHECK();
}

// matmul.cu: a cached cuBLASLt plan's descriptor and layouts, destroyed.
void destroy_lt_plan(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                     cublasLtMatrixLayout_t d);

// One cached cuBLASLt FP8 problem, column-major: D (m x n) = scale_a scale_b op(A)^T B (+ beta D)
// with A stored k x m and B stored k x n. The heuristic sees the descriptor as every call sets it
// (the scale pointers and the bias given, the pointers' alignments as preferences: an algorithm
// chosen without them can refuse the call with CUBLAS_STATUS_NOT_SUPPORTED), and keeps a few
// candidates: one cuBLASLt refuses at its first call is dropped for the next.
struct Fp8Lt::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  std::vector<cublasLtMatmulAlgo_t> algos;
};

namespace {
constexpr int kFp8LtCandidates = 8;
}  // namespace

struct Fp8Lt::Impl {
  cublasLtHandle_t handle = nullptr;
  // (m, n, k, A format, B format, D type, fast accumulation, bias, accumulate, alignments of A,
  // B and D: the heuristic's preferences; the bias needs 16 bytes like every pointer)
  std::map<std::tuple<int64_t, int64_t, int64_t, int, int, int, bool, bool, bool, uint32_t,
                      uint32_t, uint32_t>,
           Plan>
      plans;
  ~Impl() {
    for (auto& kv : plans) destroy_lt_plan(kv.second.desc, kv.second.a, kv.second.b, kv.second.d);
    if (handle) cublasLtDestroy(handle);
  }
};

Fp8Lt::Fp8Lt() : impl_(std::make_unique<Impl>()) {}
Fp8Lt::~Fp8Lt() = default;

namespace {

// The pointers a call changes: the scales' inverses and the bias.
void set_fp8_pointers(cublasLtMatmulDesc_t desc, const Fp8Lt::Call& c) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                              &c.a_scale_inv, sizeof c.a_scale_inv));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                              &c.b_scale_inv, sizeof c.b_scale_inv));
  if (c.bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &c.bias,
                                                sizeof c.bias));
}

const char* fp8_name(Fp8Format f) {
  return f == Fp8Format::E4M3 ? "e4m3" : "e5m2";
}

}  // namespace

void Fp8Lt::gemm(const Call& c, Workspace& ws, cudaStream_t s) {
  const auto what = [&] {
    return detail::concat(c.m, " x ", c.n, " x ", c.k, " (", fp8_name(c.a_format), " x ",
                          fp8_name(c.b_format), " -> ", dtype_name(c.d_type),
                          c.bias ? ", bias" : "", c.accumulate ? ", accumulated" : "", ")");
  };
  for (const void* ptr :
       {c.A, c.B, static_cast<const void*>(c.D), c.bias, static_cast<const void*>(c.a_scale_inv),
        static_cast<const void*>(c.b_scale_inv)})
    if (ptr && lt_alignment(ptr) < 16)
      throw Error(detail::concat("fp8 GEMM ", what(), ": an operand is only ", lt_alignment(ptr),
                                 "-byte aligned (cuBLASLt's FP8 GEMMs need 16); train without "
                                 "--fp8-format"));
  if (!impl_->handle) CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  const uint32_t al_a = lt_alignment(c.A), al_b = lt_alignment(c.B), al_d = lt_alignment(c.D);
  const auto key = std::make_tuple(c.m, c.n, c.k, static_cast<int>(c.a_format),
                                   static_cast<int>(c.b_format), static_cast<int>(c.d_type),
                                   c.fast_accum, c.bias != nullptr, c.accumulate, al_a, al_b, al_d);
  auto [it, fresh] = impl_->plans.try_emplace(key);
  Plan& p = it->second;
  if (fresh) {
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const int8_t fast = c.fast_accum ? 1 : 0;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                sizeof fast));
    if (c.bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bt = cuda_type(c.d_type);
      CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                                  sizeof bt));
    }
    set_fp8_pointers(p.desc, c);
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, fp8_type(c.a_format), c.k, c.m, c.k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, fp8_type(c.b_format), c.k, c.n, c.k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, cuda_type(c.d_type), c.m, c.n, c.m));
    cublasLtMatmulPreference_t pref = lt_preference(kFp8LtWorkspaceBytes, al_a, al_b, al_d);
    cublasLtMatmulHeuristicResult_t results[kFp8LtCandidates] = {};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
        impl_->handle, p.desc, p.a, p.b, p.d, p.d, pref, kFp8LtCandidates, results, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st == CUBLAS_STATUS_SUCCESS)
      for (int i = 0; i < found; ++i)
        if (results[i].state == CUBLAS_STATUS_SUCCESS) p.algos.push_back(results[i].algo);
  }
  if (p.algos.empty())
    throw Error(detail::concat("cuBLASLt has no FP8 GEMM for ", what(),
                               " on this GPU (FP8 needs sm_89 or newer and dimensions that are "
                               "multiples of 16; CUBLASLT_LOG_LEVEL=1 prints cuBLASLt's reason); "
                               "train without --fp8-format"));
  set_fp8_pointers(p.desc, c);
  void* work = ws.get(Scratch::kCublasLt, kFp8LtWorkspaceBytes);
  const float alpha = 1.f, beta = c.accumulate ? 1.f : 0.f;
  cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
  while (!p.algos.empty()) {
    st = cublasLtMatmul(impl_->handle, p.desc, &alpha, c.A, p.a, c.B, p.b, &beta, c.D, p.d, c.D,
                        p.d, &p.algos.front(), work, kFp8LtWorkspaceBytes, s);
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) break;
    p.algos.erase(p.algos.begin());  // refused: the next candidate, for this call and later ones
  }
  if (st == CUBLAS_STATUS_NOT_SUPPORTED)
    throw Error(detail::concat("cuBLASLt refused every FP8 GEMM algorithm it offered for ", what(),
                               " (CUBLASLT_LOG_LEVEL=1 prints its reason); train without "
                               "--fp8-format"));
  CUBLAS_CHECK(st);
  if (!c.accumulate)
    mark_initialized(c.D, static_cast<size_t>(c.m * c.n) * dtype_size(c.d_type), s);
}

namespace {

// The kFp8 scratch: quantized copies (bytes) and three 1/scale floats, each on a 16-byte boundary
// of its own (cuBLASLt 13.1 refuses every FP8 algorithm, CUBLAS_STATUS_NOT_SUPPORTED, for a scale
// pointer that is only 4-byte aligned; H200, 2026-11-28, docs/performance.md).
struct Fp8Scratch {
  uint8_t* buf[4] = {};
  float* inv[3] = {};
};
Fp8Scratch fp8_scratch(Workspace& ws, std::initializer_list<int64_t> sizes) {
  size_t total = 0;
  for (int64_t n : sizes) total += align256(static_cast<size_t>(n));
  char* base = static_cast<char*>(ws.get(Scratch::kFp8, total + 256));
  Fp8Scratch r;
  size_t off = 0;
  int i = 0;
  for (int64_t n : sizes) {
    r.buf[i++] = reinterpret_cast<uint8_t*>(base + off);
    off += align256(static_cast<size_t>(n));
  }
  for (int k = 0; k < 3; ++k) r.inv[k] = reinterpret_cast<float*>(base + off + 16 * k);
  return r;
}

}  // namespace

void fp8_matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                        const Backend::Fp8Operand& x, const Backend::Fp8Operand& w, Fp8Lt& lt,
                        Workspace& ws, cudaStream_t s) {
  const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
  const Fp8Scratch sc = fp8_scratch(ws, {N * IC, OC * IC});
  fp8_quantize(inp, N, IC, x.scale->f32(), x.format, sc.buf[0], nullptr, sc.inv[0], s);
  fp8_quantize(weight, OC, IC, w.scale->f32(), w.format, sc.buf[1], nullptr, sc.inv[1], s);
  Fp8Lt::Call c;
  c.m = OC, c.n = N, c.k = IC;
  c.A = sc.buf[1], c.a_format = w.format, c.a_scale_inv = sc.inv[1];
  c.B = sc.buf[0], c.b_format = x.format, c.b_scale_inv = sc.inv[0];
  c.D = out.raw(), c.d_type = out.dtype();
  c.bias = bias ? bias->raw() : nullptr;
  c.fast_accum = true;
  lt.gemm(c, ws, s);
}

void fp8_matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                         const Tensor& inp, const Tensor& weight, const Backend::Fp8Operand& g,
                         const Backend::Fp8Operand& x, const Backend::Fp8Operand& w, Fp8Lt& lt,
                         Workspace& ws, cudaStream_t s) {
  const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight), Np = fp8_padded(N);
  // Wt's rows (OC) are padded as every transposed copy's: the widths must need none (the options
  // refuse widths that are not multiples of 16), or Wt would overrun its scratch.
  TESSERA_CHECK(IC % 16 == 0 && OC % 16 == 0, "fp8 matmul backward: widths ", IC, " x ", OC,
                " are not multiples of 16");
  // dYq (N,OC) and dYt (OC,Np) in one pass; Wt (IC,OC); Xt (IC,Np): the transposed copies'
  // rows padded with zeros to a multiple of 16 (wgrad's reduction; OC and IC are multiples).
  const Fp8Scratch sc = fp8_scratch(ws, {N * OC, OC * Np, IC * OC, IC * Np});
  fp8_quantize(dout, N, OC, g.scale->f32(), g.format, dinp ? sc.buf[0] : nullptr, sc.buf[1],
               sc.inv[0], s);
  fp8_quantize(inp, N, IC, x.scale->f32(), x.format, nullptr, sc.buf[3], sc.inv[2], s);
  Fp8Lt::Call c;
  if (dinp) {
    fp8_quantize(weight, OC, IC, w.scale->f32(), w.format, nullptr, sc.buf[2], sc.inv[1], s);
    c.m = IC, c.n = N, c.k = OC;
    c.A = sc.buf[2], c.a_format = w.format, c.a_scale_inv = sc.inv[1];
    c.B = sc.buf[0], c.b_format = g.format, c.b_scale_inv = sc.inv[0];
    c.D = dinp->raw(), c.d_type = dinp->dtype();
    lt.gemm(c, ws, s);
  }
  expect_dtype(dweight, DType::F32, "fp8 weight gradient");
  c = Fp8Lt::Call{};
  c.m = IC, c.n = OC, c.k = Np;
  c.A = sc.buf[3], c.a_format = x.format, c.a_scale_inv = sc.inv[2];
  c.B = sc.buf[1], c.b_format = g.format, c.b_scale_inv = sc.inv[0];
  c.D = dweight.raw(), c.d_type = DType::F32;
  c.accumulate = true;
  lt.gemm(c, ws, s);
  if (dbias) bias_backward(*dbias, dout, ws, s);
}

}  // namespace tessera::cuda_ops
