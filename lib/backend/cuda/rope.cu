// rope.cu: rotary position embedding (RoPE) in place on the query and key heads of the fused qkv
// activation, the "rotate half" convention: in each head, features i and i + rot_dim/2 rotate by
// angle pos * inv_freq[i] (features 2i and 2i+1 with RopeSpec::interleaved). One thread per (row,
// pair i): it takes cos and sin once and rotates that pair in all H + G query and key heads of the
// row (the G value heads are untouched). The CPU reference is backend/cpu/rope.hpp; this kernel
// computes the same f32 inv_freq and f32 angle, and cos/sin of that angle in double rounded once
// (not the fast __sinf), so both agree to rounding.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

// qkv (N, C3), C3 = (H + 2G) hd; `heads` = H + G rotate. positions (N) or null: r % seq_len.
template <typename T>
__global__ void rope_kernel(T* qkv, const int32_t* positions, int64_t N, int64_t heads, int64_t hd,
                            int64_t C3, int64_t rot_dim, double base, int64_t seq_len, bool inverse,
                            RopeScaling scaling, bool interleaved) {
  const int64_t half = rot_dim / 2;
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (r, k)
  if (i >= N * half) return;
  const int64_t r = i / half, k = i % half;
  // inv_freq (core/rope.hpp) and the angle in f32 exactly as cpu::rope computes them.
  const float inv = rope_inv_freq(k, rot_dim, base, scaling);
  const float pos =
      static_cast<float>(positions ? static_cast<int64_t>(positions[r]) : r % seq_len);
  const float angle = __fmul_rn(pos, inv);
  double sd, cd;
  sincos(static_cast<double>(angle), &sd, &cd);
  const float c = static_cast<float>(cd), s = static_cast<float>(inverse ? -sd : sd);
  T* row = qkv + r * C3;
  const int64_t k1 = rope_first(k, rot_dim, interleaved), k2 = rope_second(k, rot_dim, interleaved);
  for (int64_t h = 0; h < heads; ++h) {
    T* x = row + h * hd;
    const float x1 = ld(x[k1]), x2 = ld(x[k2]);
    // No fused multiply-add, as the CPU computes it: f32 products, then the sum.
    x[k1] = to<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    x[k2] = to<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
}

}  // namespace

void rope(Tensor& qkv, const RopeSpec& spec, const Tensor* positions, bool inverse,
          cudaStream_t s) {
  const int64_t N = rows_of(qkv), half = spec.rot_dim / 2;
  if (N * half == 0) return;
  const int32_t* pos = positions ? positions->i32() : nullptr;
  dispatch(qkv.dtype(), "rope", [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<blocks_for(N * half), kThreads, 0, s>>>(
        qkv.data<T>(), pos, N, spec.heads + spec.kv_heads, spec.head_dim, cols_of(qkv),
        spec.rot_dim, spec.base, spec.seq_len, inverse, spec.scaling, spec.interleaved);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
