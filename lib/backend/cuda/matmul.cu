// matmul.cu: the linear layer y = x W^T + b (W stored [out, in]) on cuBLAS. With a bias, one
// cuBLASLt matmul with the bias epilogue where cuBLASLt has an algorithm for the case (every
// aligned training shape); otherwise the bias is written first and cublasGemmEx accumulates onto
// it. The bias gradient is a column sum of dout in two deterministic stages (common.cuh). The CPU
// reference is backend/cpu/matmul.hpp.
#include <cublasLt.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include <map>
#include <tuple>

#include "backend/cuda/common.cuh"
#include "backend/cuda/lt_plan.hpp"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::cuda_ops {

namespace {

// ---- matmul helpers -----------------------------------------------------------------------------

template <typename T>
__global__ void fill_bias_kernel(T* out, const T* bias, int64_t N, int64_t OC) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < N * OC) out[i] = bias[i % OC];
}

// The first stage of the bias gradient: per (column, chunk of rows) sums of dout (rowwise.cuh).
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads)
    bias_partials_kernel(float* part, const T* x, int64_t N, int64_t C) {
  rowwise::column_partials<1>(
      part, N, C, [&](int64_t r, int64_t c, float* acc) { acc[0] += ld(x[r * C + c]); });
}
__global__ void __launch_bounds__(rowwise::kThreads)
    sum_partials_kernel(float* out, const float* part, int64_t R, int64_t C) {
  __shared__ float sh[rowwise::kSumPartialsShared];
  rowwise::sum_partials(out, part, R, C, sh);
}

}  // namespace

// Tells compute-sanitizer's initcheck (run with --nvtx yes) that a cuBLAS output was written: the
// Hopper kernels cuBLAS picks for bf16 store through paths initcheck does not track, so a later
// read of the output is reported as uninitialised (docs/testing.md). Costs nothing without a tool.
void mark_initialized(void* p, size_t bytes, cudaStream_t s) {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("tessera");
  nvtxMemVirtualRangeDesc_t range{};
  range.ptr = p;
  range.size = bytes;
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof batch;
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof range;
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(domain, s, 0, &batch);
}

namespace {

// Row-major Y (N,OC) = X (N,IC) W^T is, in cuBLAS's column-major terms, Y^T = W X^T with W read
// transposed: (OC,IC)row = (IC,OC)col. All GEMMs accumulate in f32 (CUBLAS_COMPUTE_32F; bf16 and
// f16 inputs run on tensor cores).
void gemm(cublasHandle_t blas, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
          int64_t k, const Tensor& A, int64_t lda, const Tensor& B, int64_t ldb, float beta,
          Tensor& Cm, int64_t ldc) {
  const float alpha = 1.f;
  CUBLAS_CHECK(cublasGemmEx(blas, ta, tb, (int)m, (int)n, (int)k, &alpha, A.raw(),
                            cuda_type(A.dtype()), (int)lda, B.raw(), cuda_type(B.dtype()), (int)ldb,
                            &beta, Cm.raw(), cuda_type(Cm.dtype()), (int)ldc, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
  if (beta == 0.f) {
    cudaStream_t s = nullptr;
    CUBLAS_CHECK(cublasGetStream(blas, &s));
    mark_initialized(Cm.raw(), Cm.nbytes(), s);
  }
}

}  // namespace

void gemm_2d(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta,
             cublasHandle_t blas) {
  const int nd = c.ndim();
  const bool batch =
      nd == 3 && a.ndim() == 3 && b.ndim() == 3 && a.dim(0) == c.dim(0) && b.dim(0) == c.dim(0);
  TESSERA_CHECK((batch || (nd == 2 && a.ndim() == 2 && b.ndim() == 2)) && c.dtype() == DType::F32 &&
                    a.dtype() == b.dtype() && (a.dtype() == DType::F32 || a.dtype() == DType::BF16),
                "gemm: 2-D tensors (or a batch of 3-D), f32 or bf16 inputs and an f32 output, got ",
                shape_str(a.shape()), " ", dtype_name(a.dtype()), " x ", shape_str(b.shape()), " ",
                dtype_name(b.dtype()), " -> ", shape_str(c.shape()), " ", dtype_name(c.dtype()));
  const int o = batch ? 1 : 0;  // the matrices' first axis
  const int64_t L = batch ? c.dim(0) : 1;
  const int64_t M = c.dim(o), N = c.dim(o + 1), K = ta ? a.dim(o) : a.dim(o + 1);
  TESSERA_CHECK((ta ? a.dim(o + 1) : a.dim(o)) == M && (tb ? b.dim(o) : b.dim(o + 1)) == N &&
                    (tb ? b.dim(o + 1) : b.dim(o)) == K,
                "gemm: shapes ", shape_str(a.shape()), " x ", shape_str(b.shape()), " -> ",
                shape_str(c.shape()));
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS computes the
  // (N x M) product of B and A with the same transposes; a batch's matrices one after another.
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K,
      &alpha, b.raw(), cuda_type(b.dtype()), (int)b.dim(o + 1), (long long)(K * N), a.raw(),
      cuda_type(a.dtype()), (int)a.dim(o + 1), (long long)(M * K), &beta, c.raw(), CUDA_R_32F,
      (int)N, (long long)(M * N), (int)L, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

namespace {

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;
// GEMMs over at most this many rows (tokens) keep away from split-K's separate reduce kernel.
constexpr int64_t kFewRows = 16;

}  // namespace

// A cached cuBLASLt plan's descriptor and layouts, destroyed (LtMatmul's plans and Fp8Lt's in
// fp8.cu).
void destroy_lt_plan(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                     cublasLtMatrixLayout_t d) {
  for (cublasLtMatrixLayout_t layout : {a, b, d})
    if (layout) cublasLtMatrixLayoutDestroy(layout);
  if (desc) cublasLtMatmulDescDestroy(desc);
}

// One cached cuBLASLt problem, column-major as in gemm() above: D (m x n) = op(A) op(B) with an
// epilogue (the bias; GELU's gradient from an auxiliary matrix).
struct LtMatmul::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;
};

// One call: the epilogue, the operations, the sizes and the operands.
struct LtMatmul::Problem {
  cublasLtEpilogue_t epi;
  cublasOperation_t ta, tb;
  int64_t m, n, k, lda, ldb, ldd;
  const void* A;
  const void* B;
  void* D;
  const void* bias = nullptr;  // with the BIAS epilogues
  const void* aux = nullptr;   // with DGELU: the GELU's input, ld = ldd
  DType dtype;
};

struct LtMatmul::Impl {
  cublasLtHandle_t handle = nullptr;
  // (epilogue, ops, m, n, k, dtype, alignments of A, B, D, aux) -> plan
  std::map<std::tuple<int, int, int, int64_t, int64_t, int64_t, int, uint32_t, uint32_t, uint32_t,
                      uint32_t>,
           Plan>
      plans;
  ~Impl() {
    for (auto& kv : plans) destroy_lt_plan(kv.second.desc, kv.second.a, kv.second.b, kv.second.d);
    if (handle) cublasLtDestroy(handle);
  }
};

LtMatmul::LtMatmul() : impl_(std::make_unique<Impl>()) {}
LtMatmul::~LtMatmul() = default;

bool LtMatmul::run(const Problem& q, Workspace& ws, cudaStream_t s) {
  for (const void* p : {q.A, q.B, static_cast<const void*>(q.D), q.bias, q.aux})
    if (p && lt_alignment(p) < 16) return false;
  if (!impl_->handle) CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  const auto key =
      std::make_tuple(static_cast<int>(q.epi), static_cast<int>(q.ta), static_cast<int>(q.tb), q.m,
                      q.n, q.k, static_cast<int>(q.dtype), lt_alignment(q.A), lt_alignment(q.B),
                      lt_alignment(q.D), q.aux ? lt_alignment(q.aux) : 0u);
  auto [it, fresh] = impl_->plans.try_emplace(key);
  Plan& p = it->second;
  if (fresh) {
    const cudaDataType_t t = cuda_type(q.dtype);
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &q.ta, sizeof q.ta));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &q.tb, sizeof q.tb));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &q.epi,
                                                sizeof q.epi));
    const bool ta = q.ta == CUBLAS_OP_T, tb = q.tb == CUBLAS_OP_T;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, t, ta ? q.k : q.m, ta ? q.m : q.k, q.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, t, tb ? q.n : q.k, tb ? q.k : q.n, q.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, t, q.m, q.n, q.ldd));
    if (q.bias)
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &q.bias, sizeof q.bias));
    if (q.aux) {
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                  &q.aux, sizeof q.aux));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                  &q.ldd, sizeof q.ldd));
    }
    const uint32_t al_a = std::get<7>(key), al_b = std::get<8>(key), al_d = std::get<9>(key);
    // A few rows (generation's decode step): no split-K with a separate reduce kernel, which the
    // heuristic picks for one row of 768 x 768 and which cost a launch of its own per GEMM
    // (docs/performance.md); the in-place reduction (counters in the workspace, the same order
    // every run) and unsplit algorithms stay. Where the mask leaves none, the unmasked choice.
    for (const bool few_rows : {q.n <= kFewRows, false}) {
      cublasLtMatmulPreference_t pref = lt_preference(kLtWorkspaceBytes, al_a, al_b, al_d);
      if (few_rows) {
        const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_INPLACE;
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof mask));
      }
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(impl_->handle, p.desc, p.a, p.b, p.d,
                                                               p.d, pref, 1, &result, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      p.usable = st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
      if (p.usable) {
        p.algo = result.algo;
        break;
      }
      if (!few_rows) break;
    }
  }
  if (!p.usable) return false;
  if (q.bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &q.bias,
                                                sizeof q.bias));
  if (q.aux)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                &q.aux, sizeof q.aux));
  void* work = ws.get(Scratch::kCublasLt, kLtWorkspaceBytes);
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st = cublasLtMatmul(impl_->handle, p.desc, &alpha, q.A, p.a, q.B, p.b, &beta,
                                           q.D, p.d, q.D, p.d, &p.algo, work, kLtWorkspaceBytes, s);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // never again for this case: the GEMM path
    p.usable = false;
    return false;
  }
  CUBLAS_CHECK(st);
  mark_initialized(q.D, static_cast<size_t>(q.ldd * q.n) * dtype_size(q.dtype), s);
  return true;
}

// y^T (OC x N) = W (OC x IC, read transposed from IC x OC) x^T (IC x N) + bias (OC).
bool LtMatmul::bias_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                            const Tensor& bias, Workspace& ws, cudaStream_t s) {
  if (out.dtype() == DType::F32) return false;  // f32 keeps the reference GEMM path
  const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
  if (IC % 8 != 0 || OC % 8 != 0) return false;
  Problem q{CUBLASLT_EPILOGUE_BIAS, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, IC, IC, OC,
            weight.raw(),           inp.raw(),   out.raw()};
  q.bias = bias.raw();
  q.dtype = out.dtype();
  return run(q, ws, s);
}

// dinp^T (IC x N) = W^T (IC x OC, W read as stored) dout^T (OC x N), times gelu'(pre) (IC x N).
bool LtMatmul::dgelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& weight,
                              const Tensor& pre, Workspace& ws, cudaStream_t s) {
  if (dinp.dtype() == DType::F32) return false;
  const int64_t N = rows_of(dout), OC = cols_of(dout), IC = cols_of(weight);
  if (IC % 8 != 0 || OC % 8 != 0 || pre.numel() != N * IC) return false;
  Problem q{CUBLASLT_EPILOGUE_DGELU,
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            IC,
            N,
            OC,
            IC,
            OC,
            IC,
            weight.raw(),
            dout.raw(),
            dinp.raw()};
  q.aux = pre.raw();
  q.dtype = dinp.dtype();
  return run(q, ws, s);
}

// y^T (OC x N) = gelu(W x^T + bias): bias_forward's problem with GELU in the epilogue.
bool LtMatmul::gelu_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                            const Tensor* bias, Workspace& ws, cudaStream_t s) {
  if (out.dtype() == DType::F32) return false;
  const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
  if (IC % 8 != 0 || OC % 8 != 0) return false;
  Problem q{bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU,
            CUBLAS_OP_T,
            CUBLAS_OP_N,
            OC,
            N,
            IC,
            IC,
            IC,
            OC,
            weight.raw(),
            inp.raw(),
            out.raw()};
  if (bias) q.bias = bias->raw();
  q.dtype = out.dtype();
  return run(q, ws, s);
}

void sum_column_partials(float* out, const float* part, int64_t R, int64_t C, cudaStream_t s) {
  if (C == 0) return;
  sum_partials_kernel<<<static_cast<unsigned>((C + 31) / 32), rowwise::kThreads, 0, s>>>(out, part,
                                                                                         R, C);
  LAUNCH_CHECK();
}

void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor* bias,
                    cublasHandle_t blas, LtMatmul* lt, Workspace& ws, cudaStream_t s) {
  const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
  if (bias && lt && lt->bias_forward(out, inp, weight, *bias, ws, s)) return;
  if (bias) {
    dispatch(out.dtype(), "bias", [&](auto tag) {
      using T = decltype(tag);
      fill_bias_kernel<T>
          <<<blocks_for(N * OC), kThreads, 0, s>>>(out.data<T>(), bias->data<T>(), N, OC);
    });
    LAUNCH_CHECK();
  }
  gemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, weight, IC, inp, IC, bias ? 1.f : 0.f, out, OC);
}

void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, cublasHandle_t blas, Workspace& ws,
                     cudaStream_t s) {
  const int64_t N = rows_of(inp), IC = cols_of(inp), OC = rows_of(weight);
  if (dinp) gemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, weight, IC, dout, OC, 0.f, *dinp, IC);
  if (!dweight.defined()) return;  // the input gradient alone (zero-bubble's B pass)
  gemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, inp, IC, dout, OC, 1.f, dweight, IC);
  if (dbias) bias_backward(*dbias, dout, ws, s);
}

void bias_backward(Tensor& dbias, const Tensor& dout, Workspace& ws, cudaStream_t s) {
  const int64_t OC = dbias.numel(), N = OC > 0 ? dout.numel() / OC : 0;
  if (N > 0) {
    const int64_t R = rowwise::num_chunks(N);
    float* part = ws.get<float>(Scratch::kPartials, R * OC);
    dispatch(dout.dtype(), "bias gradient", [&](auto tag) {
      using T = decltype(tag);
      const dim3 grid(static_cast<unsigned>((OC + rowwise::kThreads - 1) / rowwise::kThreads),
                      static_cast<unsigned>(R));
      bias_partials_kernel<T><<<grid, rowwise::kThreads, 0, s>>>(part, dout.data<T>(), N, OC);
    });
    LAUNCH_CHECK();
    sum_column_partials(dbias.f32(), part, R, OC, s);
  }
}

namespace {

// One GEMM of a grouped call: C (m x n, column-major) = op(A) op(B) (+ beta C).
struct GemmProblem {
  int m, n, k;
  const void* A;
  int lda;
  const void* B;
  int ldb;
  void* C;
  int ldc;
  size_t c_bytes;
};

// All problems in one cublasGemmGroupedBatchedEx, each its own group (sizes differ per expert),
// sharing the operations, beta and the dtypes. False when cuBLAS does not take the call (the
// caller then runs the GEMMs one by one).
bool grouped_gemm(cublasHandle_t blas, Workspace& ws, cudaStream_t s, cublasOperation_t ta,
                  cublasOperation_t tb, const std::vector<GemmProblem>& ps, DType at, DType ct,
                  float beta) {
  const int G = static_cast<int>(ps.size());
  if (G == 0) return true;
  std::vector<cublasOperation_t> tas(ps.size(), ta), tbs(ps.size(), tb);
  std::vector<int> m, n, k, lda, ldb, ldc, size(ps.size(), 1);
  std::vector<float> alpha(ps.size(), 1.f), betas(ps.size(), beta);
  std::vector<const void*> ptrs(3 * ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    m.push_back(ps[i].m);
    n.push_back(ps[i].n);
    k.push_back(ps[i].k);
    lda.push_back(ps[i].lda);
    ldb.push_back(ps[i].ldb);
    ldc.push_back(ps[i].ldc);
    ptrs[i] = ps[i].A;
    ptrs[ps.size() + i] = ps[i].B;
    ptrs[2 * ps.size() + i] = ps[i].C;
  }
  // The pointer arrays live on the device (cuBLAS reads them there); the rest is host memory.
  void** dev = static_cast<void**>(
      ws.upload(Scratch::kGroupedPointers, ptrs.data(), sizeof(void*) * ptrs.size(), s));
  const void* const* a_arr = dev;
  const void* const* b_arr = dev + ps.size();
  void* const* c_arr = dev + 2 * ps.size();
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(
      blas, tas.data(), tbs.data(), m.data(), n.data(), k.data(), alpha.data(), a_arr,
      cuda_type(at), lda.data(), b_arr, cuda_type(at), ldb.data(), betas.data(), c_arr,
      cuda_type(ct), ldc.data(), G, size.data(), CUBLAS_COMPUTE_32F);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  CUBLAS_CHECK(st);
  if (beta == 0.f)
    for (const GemmProblem& p : ps) mark_initialized(p.C, p.c_bytes, s);
  return true;
}

bool same_dtypes(const std::vector<Backend::GroupedGemm>& groups, bool backward) {
  for (const Backend::GroupedGemm& g : groups) {
    const DType d = g.inp->dtype();
    if (g.weight->dtype() != d || (g.out && g.out->dtype() != d) ||
        (backward && g.dout->dtype() != d))
      return false;
  }
  return true;
}

}  // namespace

void grouped_matmul_forward(const std::vector<Backend::GroupedGemm>& groups, cublasHandle_t blas,
                            Workspace& ws, cudaStream_t s) {
  if (groups.empty()) return;
  std::vector<GemmProblem> ps;
  for (const Backend::GroupedGemm& g : groups) {
    const int64_t N = rows_of(*g.inp), IC = cols_of(*g.inp), OC = rows_of(*g.weight);
    if (N == 0) continue;
    // As matmul_forward: out^T (OC x N) = W^T-read (OC x IC) x^T (IC x N).
    ps.push_back({(int)OC, (int)N, (int)IC, g.weight->raw(), (int)IC, g.inp->raw(), (int)IC,
                  g.out->raw(), (int)OC, g.out->nbytes()});
  }
  const DType d = groups.front().inp->dtype();
  if (same_dtypes(groups, false) &&
      grouped_gemm(blas, ws, s, CUBLAS_OP_T, CUBLAS_OP_N, ps, d, d, 0.f))
    return;
  for (const Backend::GroupedGemm& g : groups)
    matmul_forward(*g.out, *g.inp, *g.weight, nullptr, blas, nullptr, ws, s);
}

void grouped_matmul_backward(const std::vector<Backend::GroupedGemm>& groups, cublasHandle_t blas,
                             Workspace& ws, cudaStream_t s) {
  if (groups.empty()) return;
  std::vector<GemmProblem> dx;
  // The weight gradients in waves where each dweight appears once: a grouped call runs its
  // problems concurrently, and with expert parallelism an expert has one block of rows per
  // sending rank, all accumulating into its one gradient (beta 1). Wave k holds each expert's
  // k-th block, so the sum keeps the per-expert loop's order (sender 0, 1, ...).
  std::vector<std::vector<GemmProblem>> waves;
  std::vector<std::vector<const Backend::GroupedGemm*>> wave_groups;
  std::map<const void*, size_t> seen;
  for (const Backend::GroupedGemm& g : groups) {
    const int64_t N = rows_of(*g.inp), IC = cols_of(*g.inp), OC = rows_of(*g.weight);
    if (N == 0) continue;
    // As matmul_backward: dinp (IC x N) = W (IC x OC, column-major) dout^T (OC x N), and
    // dW (IC x OC) += x^T (IC x N) dout (N x OC).
    if (g.out)
      dx.push_back({(int)IC, (int)N, (int)OC, g.weight->raw(), (int)IC, g.dout->raw(), (int)OC,
                    g.out->raw(), (int)IC, g.out->nbytes()});
    if (!g.dweight) continue;  // input gradients alone (zero-bubble's B pass)
    const size_t k = seen[g.dweight->raw()]++;
    if (k == waves.size()) {
      waves.emplace_back();
      wave_groups.emplace_back();
    }
    waves[k].push_back({(int)IC, (int)OC, (int)N, g.inp->raw(), (int)IC, g.dout->raw(), (int)OC,
                        g.dweight->raw(), (int)IC, g.dweight->nbytes()});
    wave_groups[k].push_back(&g);
  }
  const DType d = groups.front().inp->dtype();
  const bool ok = same_dtypes(groups, true);
  if (!(ok && grouped_gemm(blas, ws, s, CUBLAS_OP_N, CUBLAS_OP_N, dx, d, d, 0.f)))
    for (const Backend::GroupedGemm& g : groups)
      if (g.out && rows_of(*g.inp) > 0)
        gemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, cols_of(*g.inp), rows_of(*g.inp), rows_of(*g.weight),
             *g.weight, cols_of(*g.inp), *g.dout, rows_of(*g.weight), 0.f, *g.out, cols_of(*g.inp));
  // cuBLAS's grouped GEMM lists matching input and output types only: bf16/f16 activations with
  // f32 weight gradients (mixed precision) go one GEMM at a time, as matmul_backward does.
  for (size_t k = 0; k < waves.size(); ++k) {
    if (ok && d == DType::F32 &&
        grouped_gemm(blas, ws, s, CUBLAS_OP_N, CUBLAS_OP_T, waves[k], d, DType::F32, 1.f))
      continue;
    for (const Backend::GroupedGemm* g : wave_groups[k])
      gemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, cols_of(*g->inp), rows_of(*g->weight), rows_of(*g->inp),
           *g->inp, cols_of(*g->inp), *g->dout, rows_of(*g->weight), 1.f, *g->dweight,
           cols_of(*g->inp));
  }
}

}  // namespace tessera::cuda_ops
