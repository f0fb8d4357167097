// moe.cu: the Mixture-of-Experts ops of the CUDA backend (Backend::moe_*; kernel bodies in
// moe.cuh, checked on the host warp emulator by test_moe_emu). The router's choice of experts and
// weights runs on the device; the counts, the dropping over capacity and the row of each kept slot
// are assigned on the host (moe_assign_rows_host), which needs the counts anyway for the
// dispatch's sizes; the load-balancing scores are summed on the host in token order, as on the CPU.
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace mk = moe_kernels;

namespace {

using rowwise::warp_blocks;

mk::Route route_of(const MoERouting& r) {
  TESSERA_CHECK(r.experts >= 1 && r.experts <= mk::kMaxExperts && r.topk >= 1 && r.topk <= 64 &&
                    r.topk <= r.experts,
                "MoE on CUDA: ", r.topk, " of ", r.experts, " experts (at most 64 of ",
                mk::kMaxExperts, ")");
  TESSERA_CHECK(r.groups <= mk::kMaxGroups, "MoE on CUDA: ", r.groups,
                " expert groups (--moe-router-num-groups at most ", mk::kMaxGroups, ")");
  return mk::make_route(r);
}

__global__ void __launch_bounds__(mk::kThreads)
    router_topk_kernel(int32_t* expert, float* weight, const float* logits, int64_t N,
                       mk::Route r) {
  mk::router_topk(expert, weight, logits, N, r);
}
__global__ void __launch_bounds__(mk::kThreads)
    router_scores_kernel(float* scores, float* lse_sq, const float* logits, int64_t N,
                         mk::Route r) {
  mk::router_scores(scores, lse_sq, logits, N, r);
}
__global__ void __launch_bounds__(mk::kThreads)
    router_backward_kernel(float* dlogits, const float* logits, const int32_t* expert,
                           const float* weight, const float* dweight, const float* aux_grad,
                           float z_grad, int64_t N, int64_t group_rows, mk::Route r) {
  mk::router_backward(dlogits, logits, expert, weight, dweight, aux_grad, z_grad, N, group_rows, r);
}
template <typename T>
__global__ void __launch_bounds__(mk::kThreads)
    permute_kernel(T* x_perm, const T* x, const int32_t* row, int64_t N, int K, int64_t C,
                   bool vec) {
  mk::permute(x_perm, x, row, N, K, C, vec);
}
template <typename T>
__global__ void __launch_bounds__(mk::kThreads)
    gather_rows_kernel(T* y, const T* out, const int32_t* row, const float* weight, int64_t N,
                       int K, int64_t C, bool vec) {
  mk::gather_rows(y, out, row, weight, N, K, C, vec);
}
template <typename T>
__global__ void __launch_bounds__(mk::kThreads)
    unpermute_backward_kernel(T* dout, float* dweight, const T* dy, const T* out,
                              const int32_t* row, const float* weight, int64_t N, int K, int64_t C,
                              bool vec) {
  mk::unpermute_backward(dout, dweight, dy, out, row, weight, N, K, C, vec);
}

// A tensor's first row for the alignment check (null for an empty one, which is ignored).
const void* base(const Tensor& t) {
  return t.numel() > 0 ? t.raw() : nullptr;
}

void check_f32(const Tensor& t, const char* what) {
  TESSERA_CHECK(t.dtype() == DType::F32, "MoE on CUDA: ", what, " must be f32, not ",
                dtype_name(t.dtype()));
}
void check_i32(const Tensor& t, const char* what) {
  TESSERA_CHECK(t.dtype() == DType::I32, "MoE on CUDA: ", what, " must be int32, not ",
                dtype_name(t.dtype()));
}

}  // namespace

int64_t moe_route(Tensor& expert, Tensor& weight, Tensor& row, const Tensor& logits,
                  const MoERouting& r, int64_t group_rows, std::vector<int64_t>& routed,
                  std::vector<int64_t>& kept, Workspace& ws, cudaStream_t s) {
  check_f32(logits, "router logits");
  check_f32(weight, "routing weights");
  check_i32(expert, "experts");
  check_i32(row, "rows");
  mk::Route m = route_of(r);
  if (!r.expert_bias.empty()) {  // the bias travels with the call (it changes once a step)
    TESSERA_CHECK(static_cast<int>(r.expert_bias.size()) == r.experts,
                  "moe_route: ", r.expert_bias.size(), " expert biases for ", r.experts,
                  " experts");
    m.bias = static_cast<const float*>(ws.upload(Scratch::kMoeBias, r.expert_bias.data(),
                                                 sizeof(float) * r.expert_bias.size(), s));
  }
  const int64_t N = logits.numel() / r.experts;
  TESSERA_CHECK(
      expert.numel() == N * r.topk && weight.numel() == N * r.topk && row.numel() == N * r.topk,
      "moe_route: shapes");
  std::vector<int32_t> e(static_cast<size_t>(N * r.topk)), rw(e.size());
  std::vector<float> w(e.size());
  if (N > 0) {
    router_topk_kernel<<<warp_blocks(N), mk::kThreads, 0, s>>>(expert.i32(), weight.f32(),
                                                               logits.f32(), N, m);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpyAsync(e.data(), expert.raw(), expert.nbytes(), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(w.data(), weight.raw(), weight.nbytes(), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  const int64_t R =
      moe_assign_rows_host(e.data(), w.data(), N, r, group_rows, rw.data(), routed, kept);
  if (N > 0) {
    // Pageable sources: the copies are staged before the calls return.
    CUDA_CHECK(cudaMemcpyAsync(expert.raw(), e.data(), expert.nbytes(), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(row.raw(), rw.data(), row.nbytes(), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return R;
}

void moe_router_stats(const Tensor& logits, const MoERouting& r, int64_t group_rows,
                      std::vector<double>& score_sums, double& lse_sq_sum, Workspace& ws,
                      cudaStream_t s) {
  check_f32(logits, "router logits");
  const mk::Route m = route_of(r);
  const int64_t N = logits.numel() / r.experts, E = r.experts;
  TESSERA_CHECK(group_rows >= 1 && N % group_rows == 0, "moe_router_stats: ", N,
                " rows in groups of ", group_rows);
  score_sums.assign(static_cast<size_t>(N / group_rows * E), 0.0);
  lse_sq_sum = 0;
  if (N == 0) return;
  float* buf = ws.get<float>(Scratch::kMoeScores, N * (E + 1));
  router_scores_kernel<<<warp_blocks(N), mk::kThreads, 0, s>>>(buf, buf + N * E, logits.f32(), N,
                                                               m);
  LAUNCH_CHECK();
  std::vector<float> h(static_cast<size_t>(N * (E + 1)));
  CUDA_CHECK(cudaMemcpyAsync(h.data(), buf, sizeof(float) * h.size(), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  for (int64_t n = 0; n < N; ++n) {  // in token order, in double, as the host reference
    double* sums = score_sums.data() + (n / group_rows) * E;
    for (int64_t e = 0; e < E; ++e) sums[e] += h[static_cast<size_t>(n * E + e)];
    lse_sq_sum += h[static_cast<size_t>(N * E + n)];
  }
}

void moe_router_backward(Tensor& dlogits, const Tensor& logits, const Tensor& expert,
                         const Tensor& weight, const Tensor& dweight, const MoERouting& r,
                         int64_t group_rows, const std::vector<double>& aux_grad, double z_grad,
                         Workspace& ws, cudaStream_t s) {
  check_f32(dlogits, "router logits' gradient");
  check_f32(logits, "router logits");
  check_f32(weight, "routing weights");
  check_f32(dweight, "routing weights' gradient");
  check_i32(expert, "experts");
  const mk::Route m = route_of(r);
  const int64_t N = logits.numel() / r.experts;
  TESSERA_CHECK(dlogits.shape() == logits.shape() && dweight.numel() == N * r.topk &&
                    expert.numel() == N * r.topk && weight.numel() == N * r.topk,
                "moe_router_backward: shapes");
  if (N == 0) return;
  const float* g = nullptr;
  if (!aux_grad.empty()) {
    TESSERA_CHECK(static_cast<int64_t>(aux_grad.size()) == N / group_rows * r.experts,
                  "moe_router_backward: ", aux_grad.size(), " load-balancing gradients");
    const std::vector<float> gf(aux_grad.begin(), aux_grad.end());
    g = static_cast<const float*>(
        ws.upload(Scratch::kMoeAuxGrad, gf.data(), sizeof(float) * gf.size(), s));
  }
  router_backward_kernel<<<warp_blocks(N), mk::kThreads, 0, s>>>(
      dlogits.f32(), logits.f32(), expert.i32(), weight.f32(), dweight.f32(), g,
      static_cast<float>(z_grad), N, group_rows, m);
  LAUNCH_CHECK();
}

void moe_permute(Tensor& x_perm, const Tensor& x, const Tensor& row, cudaStream_t s) {
  check_i32(row, "rows");
  TESSERA_CHECK(x_perm.dtype() == x.dtype(), "moe_permute: dtypes");
  const int64_t C = cols_of(x), N = rows_of(x), K = row.numel() / (N > 0 ? N : 1);
  if (N == 0) return;
  dispatch(x.dtype(), "moe permute", [&](auto tag) {
    using T = decltype(tag);
    permute_kernel<T><<<warp_blocks(N * K), mk::kThreads, 0, s>>>(
        x_perm.data<T>(), x.data<T>(), row.i32(), N, static_cast<int>(K), C,
        rowwise::norm_vec_ok<T>(C, {base(x_perm), base(x)}));
  });
  LAUNCH_CHECK();
}

void moe_unpermute(Tensor& y, const Tensor& out, const Tensor& row, const Tensor* weight,
                   cudaStream_t s) {
  check_i32(row, "rows");
  if (weight) check_f32(*weight, "routing weights");
  TESSERA_CHECK(y.dtype() == out.dtype(), "moe_unpermute: dtypes");
  const int64_t C = cols_of(y), N = rows_of(y), K = row.numel() / (N > 0 ? N : 1);
  if (N == 0) return;
  dispatch(y.dtype(), "moe unpermute", [&](auto tag) {
    using T = decltype(tag);
    gather_rows_kernel<T><<<warp_blocks(N), mk::kThreads, 0, s>>>(
        y.data<T>(), out.data<T>(), row.i32(), weight ? weight->f32() : nullptr, N,
        static_cast<int>(K), C, rowwise::norm_vec_ok<T>(C, {base(y), base(out)}));
  });
  LAUNCH_CHECK();
}

void moe_unpermute_backward(Tensor& dout, Tensor& dweight, const Tensor& dy, const Tensor& out,
                            const Tensor& row, const Tensor& weight, cudaStream_t s) {
  check_i32(row, "rows");
  check_f32(weight, "routing weights");
  check_f32(dweight, "routing weights' gradient");
  TESSERA_CHECK(dout.dtype() == dy.dtype() && out.dtype() == dy.dtype(),
                "moe_unpermute_backward: dtypes");
  const int64_t C = cols_of(dy), N = rows_of(dy), K = row.numel() / (N > 0 ? N : 1);
  if (N == 0) return;
  dispatch(dy.dtype(), "moe unpermute backward", [&](auto tag) {
    using T = decltype(tag);
    unpermute_backward_kernel<T><<<warp_blocks(N * K), mk::kThreads, 0, s>>>(
        dout.data<T>(), dweight.f32(), dy.data<T>(), out.data<T>(), row.i32(), weight.f32(), N,
        static_cast<int>(K), C, rowwise::norm_vec_ok<T>(C, {base(dout), base(dy), base(out)}));
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
