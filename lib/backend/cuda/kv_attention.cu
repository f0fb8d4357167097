// kv_attention.cu: causal attention for generation with a KV cache in the compute dtype (f32,
// bf16 or f16). New tokens of several sequences (segments of rows) append their keys and values to
// the cache at their positions; then each new query attends to every cached position of its
// sequence up to its own: flash-decoding (flash_decode.cuh), many blocks per (row, head) each over
// a chunk of the positions, merged by log-sum-exp. With ALiBi, slope_h (j - i) joins the scaled
// score of cached position j for the query at position i. The CPU reference is
// backend/cpu/kv_attention.hpp.
//
// Prefill: a segment that starts its sequence (position 0) with at least kPrefillRows rows is
// plain causal self-attention over its own rows, so it goes through the tensor-core training
// kernel (flash_attention_tc.cuh) reading keys and values from qkv, as training does; its keys and
// values still go to the cache. Every other row (decode steps, short prompts, f32, head dims the
// tensor-core kernel lacks) takes the flash-decoding kernels.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/flash_attention_tc.hpp"
#include "backend/cuda/flash_decode.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

// A prefill segment needs at least this many rows (one query tile of the tensor-core kernel) to
// leave the decode kernels: below it, they fill the GPU better.
constexpr int64_t kPrefillRows = 64;

// One thread per (row, key/value head, feature): the row's key and value into its slot and
// position. rows: (nrows, 3) = (slot, position, row in qkv), one entry per row of qkv.
template <typename T>
__global__ void kv_store_kernel(T* kc, T* vc, const T* qkv, const int32_t* rows, int64_t H,
                                int64_t G, int64_t hd, int64_t Tmax, int64_t nrows) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // (entry, g, d)
  if (i >= nrows * G * hd) return;
  const int64_t d = i % hd, g = (i / hd) % G, e = i / (G * hd);
  const int64_t C = H * hd, C3 = C + 2 * G * hd;
  const int64_t slot = rows[3 * e], pos = rows[3 * e + 1], row = rows[3 * e + 2];
  const int64_t at = ((slot * G + g) * Tmax + pos) * hd + d;
  kc[at] = qkv[row * C3 + C + g * hd + d];
  vc[at] = qkv[row * C3 + C + (G + g) * hd + d];
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(decode::kThreads) decode_partial_kernel(decode::Params p) {
  extern __shared__ float4 smem[];
  decode::partial_body<T, kVec>(p, reinterpret_cast<char*>(smem));
}

int target_blocks() {  // about two blocks per SM of the current device
  static thread_local int device = -1, sms = 0;
  int d = 0;
  CUDA_CHECK(cudaGetDevice(&d));
  if (d != device) {
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
    device = d;
  }
  return 2 * sms;
}

// The decode kernels for `ndec` rows listed in the device table `rows` ((slot, position, row)
// each), planned for contexts up to `max_len`.
template <typename T>
void launch_decode(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                   const int32_t* rows, int64_t ndec, int64_t max_len, int64_t heads,
                   int64_t kv_heads, bool store, const AttentionAlibi* alibi, Workspace& ws,
                   cudaStream_t s) {
  const int64_t hd = k_cache.dim(3), Tmax = k_cache.dim(2);
  const decode::LaneSplit split = decode::lane_split(static_cast<int>(hd), sizeof(T));
  TESSERA_CHECK(split.F > 0, "kv attention: head dimension ", hd,
                " is not supported by the decode kernel (it needs hd = L * F with L a power of "
                "two <= 32 and F <= ",
                decode::kMaxF, ")");
  decode::Params p{};
  p.qkv = qkv.raw();
  p.k_cache = k_cache.raw();
  p.v_cache = v_cache.raw();
  p.out = out.raw();
  p.rows = rows;
  p.H = static_cast<int>(heads);
  p.G = static_cast<int>(kv_heads);
  p.hd = static_cast<int>(hd);
  p.Tmax = static_cast<int>(Tmax);
  p.nrows = static_cast<int>(ndec);
  p.L = split.L;
  p.F = split.F;
  p.scale_log2 = 1.4426950408889634f / std::sqrt(static_cast<float>(hd));
  p.store = store;
  p.alibi = alibi != nullptr;
  if (alibi) p.slopes = *alibi;
  decode::plan_splits(p, static_cast<int>(max_len), target_blocks());
  const int64_t rh = ndec * heads;
  if (p.splits > 1) {
    float* part = ws.get<float>(Scratch::kDecodePartials, p.splits * rh * (hd + 2));
    p.part_o = part;
    p.part_ml = part + p.splits * rh * hd;
    p.counters = static_cast<unsigned*>(
        ws.get_zeroed(Scratch::kDecodeCounters, sizeof(unsigned) * static_cast<size_t>(rh), s));
  }
  const dim3 grid(static_cast<unsigned>(rh), static_cast<unsigned>(p.splits));
  const int smem = decode::smem_bytes(p);
  // The 16-byte loads need 16-byte aligned rows (views at odd offsets take the element path).
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (split.vec && aligned(p.qkv) && aligned(p.k_cache) && aligned(p.v_cache))
    decode_partial_kernel<T, true><<<grid, decode::kThreads, smem, s>>>(p);
  else
    decode_partial_kernel<T, false><<<grid, decode::kThreads, smem, s>>>(p);
  LAUNCH_CHECK();
}

}  // namespace

void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                  const std::vector<Backend::KvSegment>& segments, int64_t heads, int64_t kv_heads,
                  const AttentionAlibi* alibi, Workspace& ws, cudaStream_t s) {
  const int64_t hd = k_cache.dim(3), Tmax = k_cache.dim(2), nrows = rows_of(qkv);
  const int64_t C3 = qkv.dim(1), C = heads * hd,
                esize = static_cast<int64_t>(dtype_size(qkv.dtype()));
  auto row_of = [&](const Tensor& t, int64_t width, int64_t row) {
    return static_cast<const char*>(t.raw()) + row * width * esize;
  };
  // Which segments are prefills for the tensor-core kernel.
  std::vector<char> fresh(segments.size(), 0);
  int64_t prefill_rows = 0, longest_prefill = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    const Backend::KvSegment& g = segments[k];
    if (g.pos0 == 0 && g.count >= kPrefillRows &&
        tc::flash_supported(qkv.dtype(), hd, heads,
                            {row_of(qkv, C3, g.row0), row_of(out, C, g.row0)})) {
      fresh[k] = 1;
      prefill_rows += g.count;
      longest_prefill = std::max(longest_prefill, g.count);
    }
  }
  // (slot, position, row) of every row, for the cache; then of the decode kernels' rows.
  const int64_t ndec = nrows - prefill_rows;
  std::vector<int32_t> table(3 * static_cast<size_t>(nrows + std::max<int64_t>(ndec, 0)), -1);
  int64_t max_len = 0, covered = 0, d = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    const Backend::KvSegment& g = segments[k];
    for (int64_t t = 0; t < g.count && g.row0 + t < nrows; ++t) {
      int32_t* e = &table[3 * (g.row0 + t)];
      e[0] = static_cast<int32_t>(g.slot);
      e[1] = static_cast<int32_t>(g.pos0 + t);
      e[2] = static_cast<int32_t>(g.row0 + t);
      if (!fresh[k] && d < ndec) std::copy(e, e + 3, &table[3 * (nrows + d++)]);
    }
    if (!fresh[k]) max_len = std::max(max_len, g.pos0 + g.count);
    covered += g.count;
  }
  TESSERA_CHECK(
      covered == nrows && d == ndec && std::find(table.begin(), table.end(), -1) == table.end(),
      "kv attention: the segments must cover each of the ", nrows, " rows once");
  if (nrows == 0) return;
  const auto* rows = static_cast<const int32_t*>(
      ws.upload(Scratch::kKvSegments, table.data(), sizeof(int32_t) * table.size(), s));
  dispatch(qkv.dtype(), "kv attention", [&](auto tag) {
    using T = decltype(tag);
    kv_store_kernel<T><<<blocks_for(nrows * kv_heads * hd), kThreads, 0, s>>>(
        k_cache.data<T>(), v_cache.data<T>(), qkv.data<T>(), rows, heads, kv_heads, hd, Tmax,
        nrows);
    LAUNCH_CHECK();
    if (prefill_rows > 0) {
      // Each prefill segment as one sequence of the training kernel; its log-sum-exp is not kept.
      float* lse = ws.get<float>(Scratch::kPrefillLse, heads * longest_prefill);
      for (size_t k = 0; k < segments.size(); ++k) {
        if (!fresh[k]) continue;
        const Backend::KvSegment& g = segments[k];
        tc::flash_forward(qkv.dtype(), const_cast<char*>(row_of(out, C, g.row0)), lse,
                          row_of(qkv, C3, g.row0), 1, g.count, heads, kv_heads, hd,
                          AttentionDropout{}, alibi, s);
      }
    }
    if (ndec > 0)
      launch_decode<T>(out, qkv, k_cache, v_cache, rows + 3 * nrows, ndec, max_len, heads, kv_heads,
                       false, alibi, ws, s);
  });
}

void kv_decode(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache, const Tensor& rows,
               int64_t max_context, int64_t heads, int64_t kv_heads, const AttentionAlibi* alibi,
               Workspace& ws, cudaStream_t s) {
  const int64_t n = rows.dim(0);
  if (n == 0) return;
  dispatch(qkv.dtype(), "kv decode", [&](auto tag) {
    using T = decltype(tag);
    // The cache's store is inside the decode kernel (one new token per sequence).
    launch_decode<T>(out, qkv, k_cache, v_cache, rows.data<int32_t>(), n, max_context, heads,
                     kv_heads, true, alibi, ws, s);
  });
}

}  // namespace tessera::cuda_ops
