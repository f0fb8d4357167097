// elementwise.cu: the residual add and dtype casts, one thread per element (CPU: add in
// backend/cpu/optim.hpp, cast in cpu_backend.cpp).
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/rowwise.cuh"

namespace tessera::cuda_ops {

namespace {

template <typename T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = to<T>(ld(a[i]) + ld(b[i]));
}
// The same sum, 16 bytes per operand per thread (`packs` packs of kVec<T> elements).
template <typename T>
__global__ void add_vec_kernel(T* out, const T* a, const T* b, int64_t packs) {
  const int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (p >= packs) return;
  using rowwise::kVec;
  rowwise::Pack<T> x = rowwise::load16(a + p * kVec<T>);
  const rowwise::Pack<T> y = rowwise::load16(b + p * kVec<T>);
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) x.e[e] = to<T>(ld(x.e[e]) + ld(y.e[e]));
  rowwise::store16(out + p * kVec<T>, x);
}
// One thread per 4 consecutive elements of a row (one Philox call gives their 4 mask words when
// they start at a multiple of 4 in the sample; otherwise the group straddles two calls).
template <typename T>
__global__ void dropout_kernel(T* out, const T* in, DropoutSpec d, int64_t rows, int64_t C,
                               int64_t row_begin, int64_t seq_len) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t per_row = (C + 3) / 4;
  if (i >= rows * per_row) return;
  const int64_t r = i / per_row, c0 = (i % per_row) * 4;
  const int64_t g = row_begin + r, sample = d.sample_begin + g / seq_len, t = g % seq_len;
  const uint64_t e0 = static_cast<uint64_t>(t) * static_cast<uint64_t>(C);
  DropoutStream mask(d, sample);  // one Philox call, two where the 4 straddle a group
  for (int64_t c = c0; c < c0 + 4 && c < C; ++c)
    out[r * C + c] = to<T>(ld(in[r * C + c]) * mask(e0 + c));
}
template <typename TO, typename TI>
__global__ void cast_kernel(TO* out, const TI* in, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = to<TO>(ld(in[i]));
}

}  // namespace

void cast(Tensor& dst, const Tensor& src, cudaStream_t s) {
  dispatch(dst.dtype(), "cast", [&](auto to_tag) {
    using TO = decltype(to_tag);
    dispatch(src.dtype(), "cast", [&](auto from_tag) {
      using TI = decltype(from_tag);
      cast_kernel<TO, TI><<<blocks_for(src.numel()), kThreads, 0, s>>>(dst.data<TO>(),
                                                                       src.data<TI>(), src.numel());
    });
  });
  LAUNCH_CHECK();
}

void add(Tensor& out, const Tensor& a, const Tensor& b, cudaStream_t s) {
  dispatch(a.dtype(), "add", [&](auto tag) {
    using T = decltype(tag);
    constexpr int64_t v = rowwise::kVec<T>;
    const int64_t n = a.numel();
    if (n == 0) return;
    bool packed = n % v == 0;
    for (const void* p : {out.raw(), a.raw(), b.raw()})
      packed = packed && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    if (packed)  // the residual adds: 16-byte accesses (docs/performance.md), the same sums
      add_vec_kernel<T>
          <<<blocks_for(n / v), kThreads, 0, s>>>(out.data<T>(), a.data<T>(), b.data<T>(), n / v);
    else
      add_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(out.data<T>(), a.data<T>(), b.data<T>(), n);
  });
  LAUNCH_CHECK();
}

void dropout(Tensor& out, const Tensor& in, const DropoutSpec& d, int64_t row_begin,
             int64_t seq_len, cudaStream_t s) {
  const int64_t C = in.dim(in.ndim() - 1), rows = in.numel() / C;
  const int64_t n = rows * ((C + 3) / 4);
  dispatch(in.dtype(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    dropout_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(out.data<T>(), in.data<T>(), d, rows, C,
                                                         row_begin, seq_len);
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
