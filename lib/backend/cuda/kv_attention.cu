// kv_attention.cu: causal attention for generation with a KV cache (f32). New tokens of several
// sequences (segments of rows) append their keys and values to the cache at their positions, and
// each new query attends to every cached position of its sequence up to its own, with an online
// softmax. With ALiBi, slope_h (j - i) joins the scaled score of cached position j for the query at
// position i. The CPU reference is backend/cpu/kv_attention.hpp.
#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

struct DevSegment {
  int64_t slot, pos0, count, row0;
};
// qkv rows (H + 2G) hd wide: H query heads, then G key heads, then G value heads; the caches
// (slots, G, Tmax, hd). One thread per (row, key/value head, feature).
__global__ void kv_store_kernel(float* kc, float* vc, const float* qkv, const DevSegment* segs,
                                int nseg, int64_t H, int64_t G, int64_t hd, int64_t Tmax,
                                int64_t rows) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (row, g, d)
  if (i >= rows * G * hd) return;
  const int64_t d = i % hd, g = (i / hd) % G, row = i / (G * hd);
  const int64_t C = H * hd, C3 = C + 2 * G * hd;
  for (int k = 0; k < nseg; ++k) {
    const DevSegment s = segs[k];
    if (row < s.row0 || row >= s.row0 + s.count) continue;
    const int64_t pos = s.pos0 + row - s.row0;
    kc[((s.slot * G + g) * Tmax + pos) * hd + d] = qkv[row * C3 + C + g * hd + d];
    vc[((s.slot * G + g) * Tmax + pos) * hd + d] = qkv[row * C3 + C + (G + g) * hd + d];
  }
}
// One thread per (row, query head h), reading the cache of key/value head h / (H/G). ALiBi with
// kAlibi (the kernel without it is the kernel of before).
template <bool kAlibi>
__global__ void kv_attend_kernel(float* out, const float* qkv, const float* kc, const float* vc,
                                 const DevSegment* segs, int nseg, int64_t H, int64_t G, int64_t hd,
                                 int64_t Tmax, int64_t rows, AttentionAlibi alibi) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (row, h)
  if (i >= rows * H) return;
  const int64_t h = i % H, row = i / H, g = h / (H / G), C = H * hd, C3 = C + 2 * G * hd;
  for (int k = 0; k < nseg; ++k) {
    const DevSegment s = segs[k];
    if (row < s.row0 || row >= s.row0 + s.count) continue;
    const int64_t last = s.pos0 + row - s.row0;
    const float* q = qkv + row * C3 + h * hd;
    const float* K = kc + ((s.slot * G + g) * Tmax) * hd;
    const float* V = vc + ((s.slot * G + g) * Tmax) * hd;
    const float scale = rsqrtf(static_cast<float>(hd));
    const float slope = kAlibi ? alibi.slope(h) : 0.f;
    float m = -INFINITY, l = 0.f;
    float* o = out + row * C + h * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
    for (int64_t j = 0; j <= last; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < hd; ++d) dot += q[d] * K[j * hd + d];
      dot *= scale;
      if constexpr (kAlibi) dot += slope * static_cast<float>(j - last);
      const float mn = fmaxf(m, dot), corr = expf(m - mn), p = expf(dot - mn);
      l = l * corr + p;
      for (int64_t d = 0; d < hd; ++d) o[d] = o[d] * corr + p * V[j * hd + d];
      m = mn;
    }
    for (int64_t d = 0; d < hd; ++d) o[d] /= l;
  }
}

}  // namespace

void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                  const std::vector<Backend::KvSegment>& segments, int64_t heads, int64_t kv_heads,
                  const AttentionAlibi* alibi, Workspace& ws, cudaStream_t s) {
  const int64_t hd = k_cache.dim(3), Tmax = k_cache.dim(2), rows = rows_of(qkv);
  std::vector<DevSegment> h(segments.size());
  for (size_t i = 0; i < segments.size(); ++i)
    h[i] = {segments[i].slot, segments[i].pos0, segments[i].count, segments[i].row0};
  const auto* segs = static_cast<const DevSegment*>(
      ws.upload(Scratch::kKvSegments, h.data(), sizeof(DevSegment) * h.size(), s));
  const int n = static_cast<int>(h.size());
  kv_store_kernel<<<blocks_for(rows * kv_heads * hd), kThreads, 0, s>>>(
      k_cache.f32(), v_cache.f32(), qkv.f32(), segs, n, heads, kv_heads, hd, Tmax, rows);
  LAUNCH_CHECK();
  if (alibi)
    kv_attend_kernel<true><<<blocks_for(rows * heads), kThreads, 0, s>>>(
        out.f32(), qkv.f32(), k_cache.f32(), v_cache.f32(), segs, n, heads, kv_heads, hd, Tmax,
        rows, *alibi);
  else
    kv_attend_kernel<false><<<blocks_for(rows * heads), kThreads, 0, s>>>(
        out.f32(), qkv.f32(), k_cache.f32(), v_cache.f32(), segs, n, heads, kv_heads, hd, Tmax,
        rows, AttentionAlibi{});
  LAUNCH_CHECK();
  // The op returns with its results complete, as it always has (the wait once kept `h` alive for
  // the copy; upload() now keeps its own copy of the table).
  CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace tessera::cuda_ops
