// cudnn_attention.cpp: the graphs of cudnn_attention.hpp on cuDNN's backend API. Each graph is a
// list of operations on tensor descriptors (uids below); cuDNN's heuristics (mode A) rank the
// engines that fuse it, and the first engine configuration that finalizes into an execution plan
// is kept. Built without cuDNN (TESSERA_HAVE_CUDNN unset) every shape is refused with that reason.
#include "backend/cuda/cudnn_attention.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "core/error.hpp"

#if TESSERA_HAVE_CUDNN
#include <cudnn.h>
#endif

namespace tessera::cuda_ops {

#if !TESSERA_HAVE_CUDNN

struct CudnnAttention::Plan {};
bool cudnn_built_in() {
  return false;
}
std::string cudnn_version() {
  return "";
}
CudnnAttention::CudnnAttention(cudaStream_t stream) : stream_(stream) {}
CudnnAttention::~CudnnAttention() = default;
std::string CudnnAttention::refusal(const CudnnAttentionShape&, bool) {
  return "this build has no cuDNN (libcudnn was not found when it was configured)";
}
void CudnnAttention::forward(void*, float*, const void*, const CudnnAttentionShape&, Workspace&) {
  throw Error("cuDNN attention: this build has no cuDNN");
}
void CudnnAttention::backward(void*, const void*, const void*, const void*, const float*,
                              const CudnnAttentionShape&, bool, Workspace&) {
  throw Error("cuDNN attention: this build has no cuDNN");
}

#else

// CUDNN_ATTR_OPERATIONGRAPH_HANDLE and CUDNN_ATTR_EXECUTION_PLAN_HANDLE are deprecated in newer
// cuDNN 9 headers but are what every cuDNN 9 release reads (the GPU machine's may be older).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace {

// A failed cuDNN call while building a graph or plan: the refusal's text.
struct CudnnFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string status_text(cudnnStatus_t st) {
  std::string s = cudnnGetErrorString(st);
  char last[512] = {0};
  cudnnGetLastErrorString(last, sizeof last);
  if (last[0]) s += std::string(": ") + last;
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

void check(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) throw CudnnFailure(std::string(what) + ": " + status_text(st));
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor");
  }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }
  template <typename V>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const V* v,
           int64_t n = 1) {
    check(cudnnBackendSetAttribute(d_, name, type, n, v), "cudnnBackendSetAttribute");
  }
  void set_desc(cudnnBackendAttributeName_t name, const Desc& other) {
    cudnnBackendDescriptor_t o = other.get();
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &o);
  }
  void finalize(const char* what) { check(cudnnBackendFinalize(d_), what); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::vector<int64_t>;

// The uids of the graphs' real (non-virtual) tensors; virtual tensors count up from kVirtual.
enum Uid : int64_t {
  kQ = 1,
  kKt,
  kV,  // V in the forward, Vᵀ in the backward
  kO,
  kStats,
  kdO,
  kdQ,
  kdK,
  kdV,
  kScale,
  kNegInf,
  kOne,
  kRowSum,  // the backward's dO·O per row (f32, in the workspace)
  kdQAcc,   // the backward's f32 dQ accumulator (in the workspace)
  kVirtual = 100,
};

// A graph under construction: its tensors and operations.
class Graph {
 public:
  explicit Graph(cudnnHandle_t h) : h_(h) {}

  // A tensor; `uid` 0 makes a virtual one with the next virtual uid.
  const Desc& tensor(Dims dims, Dims strides, cudnnDataType_t dt, int64_t uid = 0,
                     bool by_value = false) {
    const bool virt = uid == 0;
    if (virt) uid = next_virtual_++;
    auto d = std::make_unique<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    d->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &dt);
    d->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(),
           static_cast<int64_t>(dims.size()));
    d->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(),
           static_cast<int64_t>(strides.size()));
    d->set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid);
    d->set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &align);
    d->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &virt);
    if (by_value) d->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
    d->finalize("tensor descriptor");
    tensors_.push_back(std::move(d));
    return *tensors_.back();
  }
  const Desc& scalar(int64_t uid) {
    return tensor({1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, uid, true);
  }

  // y = mode(x[, b[, t]]) elementwise (b and t broadcast), computed in `prec`.
  void pointwise(cudnnPointwiseMode_t mode, const Desc& x, const Desc* b, const Desc& y,
                 const Desc* t = nullptr, cudnnDataType_t prec = CUDNN_DATA_FLOAT,
                 int64_t axis = -1) {
    auto pw = std::make_unique<Desc>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode);
    pw->set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &prec);
    if (axis >= 0) pw->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
    pw->finalize("pointwise descriptor");
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    if (t) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op->finalize("pointwise operation");
    keep_.push_back(std::move(pw));
    ops_.push_back(std::move(op));
  }
  // c = a @ b over the last two dimensions, batched over the first two (b's heads broadcast
  // over a's groups of heads), f32 accumulation.
  void matmul(const Desc& a, const Desc& b, const Desc& c) {
    auto mm = std::make_unique<Desc>(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    mm->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
    mm->finalize("matmul descriptor");
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm);
    op->finalize("matmul operation");
    keep_.push_back(std::move(mm));
    ops_.push_back(std::move(op));
  }
  // y = op over the dimensions where y has extent 1.
  void reduction(cudnnReduceTensorOp_t mode, const Desc& x, const Desc& y) {
    auto red = std::make_unique<Desc>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    red->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode);
    red->set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
    red->finalize("reduction descriptor");
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *red);
    op->finalize("reduction operation");
    keep_.push_back(std::move(red));
    ops_.push_back(std::move(op));
  }
  // y = x read with y's dimensions and strides (a transpose of the last two).
  void reshape(const Desc& x, const Desc& y) {
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    op->finalize("reshape operation");
    ops_.push_back(std::move(op));
  }

  // The operation graph, finalized.
  std::unique_ptr<Desc> finalize() {
    auto g = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    g->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &h_);
    std::vector<cudnnBackendDescriptor_t> ops;
    for (const auto& o : ops_) ops.push_back(o->get());
    g->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(),
           static_cast<int64_t>(ops.size()));
    g->finalize("operation graph (cuDNN does not support this attention graph)");
    return g;
  }

 private:
  cudnnHandle_t h_;
  int64_t next_virtual_ = kVirtual;
  std::vector<std::unique_ptr<Desc> > tensors_, keep_, ops_;
};

cudnnDataType_t cudnn_dtype(DType d) {
  return d == DType::BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

// The masked value of the causal mask: -inf from cuDNN 9.10 on, the lowest float before (as
// cuDNN's frontend chooses).
float masked_value() {
  return cudnnGetVersion() >= 91000 ? -std::numeric_limits<float>::infinity()
                                    : std::numeric_limits<float>::lowest();
}

// S (B,H,T,T) with the causal mask applied: row (query) >= column (key) keeps the score.
const Desc& causal_mask(Graph& g, const Desc& s, const Dims& sdims, const Dims& sstrides) {
  const Desc& row = g.tensor(sdims, sstrides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, row, nullptr, CUDNN_DATA_INT32, 2);
  const Desc& col = g.tensor(sdims, sstrides, CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, col, nullptr, CUDNN_DATA_INT32, 3);
  const Desc& keep = g.tensor(sdims, sstrides, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, keep, nullptr, CUDNN_DATA_BOOLEAN);
  const Desc& neg = g.scalar(kNegInf);
  const Desc& out = g.tensor(sdims, sstrides, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &neg, out, &keep);
  return out;
}

// The layouts in the packed qkv (B,T,(H+2G)*hd): W = (H+2G)*hd elements per token.
struct Layout {
  int64_t B, T, H, G, D, W;
  explicit Layout(const CudnnAttentionShape& s)
      : B(s.B), T(s.T), H(s.H), G(s.G), D(s.hd), W((s.H + 2 * s.G) * s.hd) {}
  Dims heads(int64_t n) const { return {B, n, T, D}; }
  Dims in_qkv() const { return {T * W, D, W, 1}; }        // (b, head, t, d) in qkv
  Dims heads_t(int64_t n) const { return {B, n, D, T}; }  // (b, head, d, t): transposed
  Dims in_qkv_t() const { return {T * W, D, 1, W}; }
  Dims in_out() const { return {T * H * D, D, H * D, 1}; }  // (b, h, t, d) in out (B,T,H*hd)
  Dims scores() const { return {B, H, T, T}; }
  Dims scores_s() const { return {H * T * T, T * T, T, 1}; }
  Dims scores_ts() const { return {H * T * T, T * T, 1, T}; }  // the scores read transposed
  Dims rows() const { return {B, H, T, 1}; }
  Dims rows_s() const { return {H * T, T, 1, 1}; }
  Dims packed_s(int64_t n) const { return {n * T * D, T * D, D, 1}; }
};

// The forward: S = scale * Q Kᵀ, causal mask, softmax with its statistics (max + log sum exp,
// the lse), O = P V with P in the input dtype.
void build_forward(Graph& g, const CudnnAttentionShape& sh) {
  const Layout l(sh);
  const cudnnDataType_t io = cudnn_dtype(sh.dtype), f32 = CUDNN_DATA_FLOAT;
  const Desc& q = g.tensor(l.heads(l.H), l.in_qkv(), io, kQ);
  const Desc& kt = g.tensor(l.heads_t(l.G), l.in_qkv_t(), io, kKt);
  const Desc& v = g.tensor(l.heads(l.G), l.in_qkv(), io, kV);
  const Desc& o = g.tensor(l.heads(l.H), l.in_out(), io, kO);
  const Desc& stats = g.tensor(l.rows(), l.rows_s(), f32, kStats);
  const Desc& scale = g.scalar(kScale);
  const Desc& s0 = g.tensor(l.scores(), l.scores_s(), f32);
  g.matmul(q, kt, s0);
  const Desc& s1 = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_MUL, s0, &scale, s1);
  const Desc& s2 = causal_mask(g, s1, l.scores(), l.scores_s());
  const Desc& mx = g.tensor(l.rows(), l.rows_s(), f32);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s2, mx);
  const Desc& sub = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_SUB, s2, &mx, sub);
  const Desc& e = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_EXP, sub, nullptr, e);
  const Desc& sum = g.tensor(l.rows(), l.rows_s(), f32);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const Desc& lg = g.tensor(l.rows(), l.rows_s(), f32);
  g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, lg);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, &lg, stats);
  const Desc& p = g.tensor(l.scores(), l.scores_s(), io);
  g.pointwise(CUDNN_POINTWISE_DIV, e, &sum, p);
  g.matmul(p, v, o);
}

// The backward: the row sums dO·O; P = exp(scale * Q Kᵀ - lse) under the causal mask; dV = Pᵀ dO;
// dS = P (dO Vᵀ - rowsum) * scale; dK = dSᵀ Q; dQ = dS K (through an f32 accumulator unless
// deterministic). Grouped heads: dK and dV per query head, summed over each group.
void build_backward(Graph& g, const CudnnAttentionShape& sh, bool deterministic) {
  const Layout l(sh);
  const cudnnDataType_t io = cudnn_dtype(sh.dtype), f32 = CUDNN_DATA_FLOAT;
  const Desc& q = g.tensor(l.heads(l.H), l.in_qkv(), io, kQ);
  const Desc& kt = g.tensor(l.heads_t(l.G), l.in_qkv_t(), io, kKt);
  const Desc& vt = g.tensor(l.heads_t(l.G), l.in_qkv_t(), io, kV);
  const Desc& o = g.tensor(l.heads(l.H), l.in_out(), io, kO);
  const Desc& stats = g.tensor(l.rows(), l.rows_s(), f32, kStats);
  const Desc& dout = g.tensor(l.heads(l.H), l.in_out(), io, kdO);
  const Desc& dq = g.tensor(l.heads(l.H), l.in_qkv(), io, kdQ);
  const Desc& dk = g.tensor(l.heads(l.G), l.in_qkv(), io, kdK);
  const Desc& dv = g.tensor(l.heads(l.G), l.in_qkv(), io, kdV);
  const Desc& scale = g.scalar(kScale);
  const Desc& one = g.scalar(kOne);
  // Row sums of dO·O (the frontend's layout of the virtual product).
  const Desc& prod = g.tensor(l.heads(l.H), {l.H * l.T * l.D, l.T * l.D, l.H * l.D, 1}, f32);
  g.pointwise(CUDNN_POINTWISE_MUL, dout, &o, prod);
  const Desc& rs = g.tensor(l.rows(), l.rows_s(), f32);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, rs);
  const Desc& rowsum = g.tensor(l.rows(), l.rows_s(), f32, kRowSum);
  g.pointwise(CUDNN_POINTWISE_MUL, rs, &one, rowsum);
  // P again from the statistics.
  const Desc& s0 = g.tensor(l.scores(), l.scores_s(), f32);
  g.matmul(q, kt, s0);
  const Desc& s1 = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_MUL, s0, &scale, s1);
  const Desc& s2 = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_SUB, s1, &stats, s2);
  const Desc& s3 = causal_mask(g, s2, l.scores(), l.scores_s());
  const Desc& p = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_EXP, s3, nullptr, p);
  // dV = Pᵀ dO.
  const Desc& pt = g.tensor(l.scores(), l.scores_ts(), io);
  g.reshape(p, pt);
  if (l.H == l.G) {
    g.matmul(pt, dout, dv);
  } else {
    const Desc& dvf = g.tensor(l.heads(l.H), l.packed_s(l.H), io);
    g.matmul(pt, dout, dvf);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dvf, dv);
  }
  // dS = P (dO Vᵀ - rowsum) * scale.
  const Desc& dp = g.tensor(l.scores(), l.scores_s(), f32);
  g.matmul(dout, vt, dp);
  const Desc& d1 = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, &rowsum, d1);
  const Desc& d2 = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_MUL, d1, &p, d2);
  const Desc& ds = g.tensor(l.scores(), l.scores_s(), f32);
  g.pointwise(CUDNN_POINTWISE_MUL, d2, &scale, ds);
  // dK = dSᵀ Q.
  const Desc& dst = g.tensor(l.scores(), l.scores_ts(), io);
  g.reshape(ds, dst);
  if (l.H == l.G) {
    g.matmul(dst, q, dk);
  } else {
    const Desc& dkf = g.tensor(l.heads(l.H), l.packed_s(l.H), io);
    g.matmul(dst, q, dkf);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dkf, dk);
  }
  // dQ = dS K.
  const Desc& k = g.tensor(l.heads(l.G), l.in_qkv(), io);
  g.reshape(kt, k);
  if (deterministic) {
    g.matmul(ds, k, dq);
  } else {
    const Desc& acc = g.tensor(l.heads(l.H), l.packed_s(l.H), f32, kdQAcc);
    g.matmul(ds, k, acc);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, acc, nullptr, dq);
  }
}

bool nondeterministic(cudnnBackendDescriptor_t cfg) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t n = 0;
  check(cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                 &n, &e),
        "engine of a configuration");
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  check(cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                 CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes),
        "numerical notes of an engine");
  for (int64_t i = 0; i < n; ++i)
    if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return true;
  return false;
}

}  // namespace

bool cudnn_built_in() {
  return true;
}

std::string cudnn_version() {
  const size_t v = cudnnGetVersion();  // 91900 = 9.19.0
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

struct CudnnAttention::Plan {
  std::string refused;  // why cuDNN cannot run the shape; empty when `plan` is built
  std::unique_ptr<Desc> graph, plan;
  int64_t workspace = 0;  // the plan's own workspace, bytes
};

CudnnAttention::CudnnAttention(cudaStream_t stream) : stream_(stream) {}

CudnnAttention::~CudnnAttention() {
  plans_.clear();
  if (handle_) cudnnDestroy(static_cast<cudnnHandle_t>(handle_));
}

CudnnAttention::Plan& CudnnAttention::plan(const CudnnAttentionShape& s, bool backward,
                                           bool deterministic) {
  const auto key = std::tuple_cat(s.key(), std::make_tuple(backward, backward && deterministic));
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  const std::string what = std::string(backward ? "backward" : "forward") + " of B" +
                           std::to_string(s.B) + " H" + std::to_string(s.H) + " G" +
                           std::to_string(s.G) + " T" + std::to_string(s.T) + " D" +
                           std::to_string(s.hd) + " " + dtype_name(s.dtype);
  try {
    if (!handle_) {
      cudnnHandle_t h = nullptr;
      check(cudnnCreate(&h), "cudnnCreate");
      handle_ = h;
      check(cudnnSetStream(h, stream_), "cudnnSetStream");
    }
    cudnnHandle_t h = static_cast<cudnnHandle_t>(handle_);
    Graph g(h);
    if (backward)
      build_backward(g, s, deterministic);
    else
      build_forward(g, s);
    p->graph = g.finalize();
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *p->graph);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
    heur.finalize("engine heuristics");
    int64_t n = 0;
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr),
          "engine heuristics' result count");
    std::vector<std::unique_ptr<Desc> > cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < n; ++i) {
      cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(cfgs.back()->get());
    }
    int64_t got = 0;
    if (n > 0)
      check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, raw.data()),
            "engine heuristics' results");
    std::string last_error = "heuristics returned no engine configuration";
    for (int64_t i = 0; i < got && !p->plan; ++i) {
      if (backward && deterministic && nondeterministic(raw[i])) {
        last_error = "every engine it offered is non-deterministic";
        continue;
      }
      auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &h);
      plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[i]);
      const cudnnStatus_t st = cudnnBackendFinalize(plan->get());
      if (st != CUDNN_STATUS_SUCCESS) {
        last_error = status_text(st);
        continue;
      }
      int64_t ws = 0, cnt = 0;
      check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                     CUDNN_TYPE_INT64, 1, &cnt, &ws),
            "plan workspace size");
      p->workspace = ws;
      p->plan = std::move(plan);
    }
    if (!p->plan)
      p->refused =
          "cuDNN " + cudnn_version() + " has no engine for the " + what + " (" + last_error + ")";
  } catch (const CudnnFailure& e) {
    p->plan.reset();
    p->refused = "cuDNN " + cudnn_version() + " refused the " + what + ": " + e.what();
  }
  return *plans_.emplace(key, std::move(p)).first->second;
}

std::string CudnnAttention::refusal(const CudnnAttentionShape& s, bool deterministic) {
  if (s.dtype != DType::BF16 && s.dtype != DType::F16)
    return std::string("cuDNN's fused attention takes bf16 or f16, not ") + dtype_name(s.dtype);
  if (s.hd % 8 != 0 || s.hd > 256)
    return "head dim " + std::to_string(s.hd) + " is not a multiple of 8 up to 256";
  if (cudnnGetVersion() < 90000) return "cuDNN " + cudnn_version() + " is older than 9.0";
  int dev = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 8) return "the device is older than sm_80";
  for (bool bwd : {false, true}) {
    const Plan& p = plan(s, bwd, deterministic);
    if (!p.refused.empty()) return p.refused;
  }
  return "";
}

namespace {

// Executes `p` with the variant pack's (uid, pointer) pairs; by-value scalars point to host floats.
void execute(cudnnHandle_t h, const Desc& plan, std::vector<int64_t> uids, std::vector<void*> ptrs,
             void* workspace) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(),
           static_cast<int64_t>(uids.size()));
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(),
           static_cast<int64_t>(ptrs.size()));
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace);
  pack.finalize("variant pack");
  check(cudnnBackendExecute(h, plan.get(), pack.get()), "cudnnBackendExecute");
}

size_t round_up(size_t n) {
  return (n + 255) / 256 * 256;
}

}  // namespace

void CudnnAttention::forward(void* out, float* lse, const void* qkv, const CudnnAttentionShape& s,
                             Workspace& ws) {
  Plan& p = plan(s, false, false);
  TESSERA_CHECK(p.refused.empty(), "cuDNN attention: ", p.refused);
  const size_t es = 2;  // bf16/f16
  char* base = static_cast<char*>(const_cast<void*>(qkv));
  void* k = base + s.H * s.hd * es;
  void* v = base + (s.H + s.G) * s.hd * es;
  float scale = 1.0f / std::sqrt(static_cast<float>(s.hd)), neg = masked_value();
  void* w = ws.get(Scratch::kCudnn, static_cast<size_t>(std::max<int64_t>(p.workspace, 1)));
  try {
    execute(static_cast<cudnnHandle_t>(handle_), *p.plan,
            {kQ, kKt, kV, kO, kStats, kScale, kNegInf}, {base, k, v, out, lse, &scale, &neg}, w);
  } catch (const CudnnFailure& e) {
    throw Error(std::string("cuDNN attention forward: ") + e.what());
  }
}

void CudnnAttention::backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                              const float* lse, const CudnnAttentionShape& s, bool deterministic,
                              Workspace& ws) {
  Plan& p = plan(s, true, deterministic);
  TESSERA_CHECK(p.refused.empty(), "cuDNN attention: ", p.refused);
  const size_t es = 2;
  char* base = static_cast<char*>(const_cast<void*>(qkv));
  char* dbase = static_cast<char*>(dqkv);
  const size_t koff = s.H * s.hd * es, voff = (s.H + s.G) * s.hd * es;
  // The workspace: the plan's, the row sums, and (unless deterministic) the f32 dQ accumulator.
  const size_t plan_bytes = round_up(static_cast<size_t>(p.workspace));
  const size_t rows = round_up(sizeof(float) * s.B * s.H * s.T);
  const size_t acc = deterministic ? 0 : sizeof(float) * s.B * s.H * s.T * s.hd;
  char* w = static_cast<char*>(ws.get(Scratch::kCudnn, plan_bytes + rows + acc));
  float scale = 1.0f / std::sqrt(static_cast<float>(s.hd)), neg = masked_value(), one = 1.0f;
  std::vector<int64_t> uids = {kQ,  kKt, kV,     kO,      kStats, kdO,    kdQ,
                               kdK, kdV, kScale, kNegInf, kOne,   kRowSum};
  std::vector<void*> ptrs = {base,
                             base + koff,
                             base + voff,
                             const_cast<void*>(out),
                             const_cast<float*>(lse),
                             const_cast<void*>(dout),
                             dbase,
                             dbase + koff,
                             dbase + voff,
                             &scale,
                             &neg,
                             &one,
                             w + plan_bytes};
  if (!deterministic) {
    CUDA_CHECK(cudaMemsetAsync(w + plan_bytes + rows, 0, acc, stream_));
    uids.push_back(kdQAcc);
    ptrs.push_back(w + plan_bytes + rows);
  }
  try {
    execute(static_cast<cudnnHandle_t>(handle_), *p.plan, uids, ptrs, w);
  } catch (const CudnnFailure& e) {
    throw Error(std::string("cuDNN attention backward: ") + e.what());
  }
}

#endif  // TESSERA_HAVE_CUDNN

}  // namespace tessera::cuda_ops
