// sampling.cu: the next token of each row of logits on the device, only the ids copied back
// (Backend::sample_tokens; the reference is backend/cpu/sampling.hpp). The tensor-parallel pieces
// are first laid out as dense rows of the true vocabulary. Greedy rows: the first index of the
// largest logit (two stages: chunks of the row, then the row). Sampled rows: all rows sorted by
// decreasing logit with their indices (CUB's segmented radix sort, stable, so equal logits keep
// increasing index: the CPU's order), then one block per row walks the sorted prefix in chunks with
// block-wide prefix sums in double: the mass of the top-k, the top-p cut, and the first position
// whose cumulative mass passes u times the kept mass. The sums run in a different order than the
// CPU's sequential ones, so an id can differ only when the draw falls within rounding (about 1e-16
// relative) of a boundary.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

constexpr int kSampleThreads = 256;

struct MinOf {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

struct DevRule {
  double temperature, top_p, u;
  int64_t top_k;
  int greedy;
};

// dense (rows, V) from the pieces (P, rows, Vl); vals (rows, V) = column indices.
__global__ void assemble_kernel(float* dense, int32_t* vals, const float* pieces, int64_t rows,
                                int64_t V, int64_t Vl) {
  const int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (e >= rows * V) return;
  const int64_t i = e / V, c = e % V;
  dense[e] = pieces[((c / Vl) * rows + i) * Vl + c % Vl];
  vals[e] = static_cast<int32_t>(c);
}

// Greedy rows: the first index of the largest logit, in two stages so a row of 50k logits is
// read by many blocks at once (one block a row took 78 us under ncu on the H200, 2026-11-28:
// ~200 dependent compares a thread). Stage 1: block (row, chunk) reduces kArgmaxChunk logits to
// one (value, index) pair; stage 2: one warp a row reduces the row's pairs. Both keep the larger
// value, then the smaller index, as the CPU's scan does (a NaN never wins a comparison).
constexpr int64_t kArgmaxChunk = 16 * kSampleThreads;

__device__ __forceinline__ bool better(float v, int64_t j, float best, int64_t at) {
  return v > best || (v == best && j < at);
}

__global__ void __launch_bounds__(kSampleThreads)
    argmax_partial_kernel(float* pv, int32_t* pi, const float* dense, const DevRule* rules,
                          int64_t V, int64_t chunks) {
  const int64_t i = blockIdx.x, chunk = blockIdx.y;
  if (!rules[i].greedy) return;
  const float* row = dense + i * V;
  const int64_t begin = chunk * kArgmaxChunk, end = min(begin + kArgmaxChunk, V);
  float best = -INFINITY;
  int64_t at = V;  // past the end: no candidate yet
  for (int64_t c = begin + threadIdx.x; c < end; c += kSampleThreads)
    if (better(row[c], c, best, at)) best = row[c], at = c;
  __shared__ float sv[kSampleThreads];
  __shared__ int64_t si[kSampleThreads];
  sv[threadIdx.x] = best;
  si[threadIdx.x] = at;
  __syncthreads();
  for (int h = kSampleThreads / 2; h > 0; h /= 2) {
    if (threadIdx.x < h &&
        better(sv[threadIdx.x + h], si[threadIdx.x + h], sv[threadIdx.x], si[threadIdx.x]))
      sv[threadIdx.x] = sv[threadIdx.x + h], si[threadIdx.x] = si[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    pv[i * chunks + chunk] = sv[0];
    pi[i * chunks + chunk] = static_cast<int32_t>(si[0]);
  }
}

__global__ void argmax_final_kernel(int32_t* ids, const float* pv, const int32_t* pi,
                                    const DevRule* rules, int64_t V, int64_t chunks) {
  const int64_t i = blockIdx.x;
  if (!rules[i].greedy) return;
  float best = -INFINITY;
  int64_t at = V;
  for (int64_t c = threadIdx.x; c < chunks; c += 32)
    if (better(pv[i * chunks + c], pi[i * chunks + c], best, at))
      best = pv[i * chunks + c], at = pi[i * chunks + c];
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t j = __shfl_xor_sync(0xffffffffu, at, o);
    if (better(v, j, best, at)) best = v, at = j;
  }
  if (threadIdx.x == 0) ids[i] = static_cast<int32_t>(at < V ? at : 0);
}

// One block per sampled row over its sorted logits (keys) and their indices (vals).
__global__ void __launch_bounds__(kSampleThreads)
    pick_kernel(int32_t* ids, const float* keys, const int32_t* vals, const DevRule* rules,
                int64_t V) {
  using Scan = cub::BlockScan<double, kSampleThreads>;
  using Reduce = cub::BlockReduce<int64_t, kSampleThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t found_at;
  const int64_t i = blockIdx.x;
  const DevRule r = rules[i];
  if (r.greedy) return;
  const float* key = keys + i * V;
  const int32_t* val = vals + i * V;
  const int64_t k = r.top_k > 0 ? min(r.top_k, V) : V;
  const double m = key[0];
  auto p_of = [&](int64_t j) {
    return j < k ? exp((static_cast<double>(key[j]) - m) / r.temperature) : 0.0;
  };
  // The first j < limit whose inclusive cumulative mass satisfies pred(cum), or limit.
  auto first_where = [&](int64_t limit, auto pred) {
    double carry = 0;
    for (int64_t base = 0; base < limit; base += kSampleThreads) {
      const int64_t j = base + threadIdx.x;
      const double p = j < limit ? p_of(j) : 0.0;
      double cum, chunk;
      Scan(tmp.scan).InclusiveSum(p, cum, chunk);
      __syncthreads();
      const int64_t cand = (j < limit && pred(carry + cum)) ? j : INT64_MAX;
      const int64_t first = Reduce(tmp.reduce).Reduce(cand, MinOf());
      if (threadIdx.x == 0) found_at = first;
      __syncthreads();
      if (found_at != INT64_MAX) return found_at;
      carry += chunk;
      __syncthreads();
    }
    return limit;
  };
  // The mass of the first `limit` sorted entries, in the chunk order first_where sums them.
  auto mass = [&](int64_t limit) {
    double sum = 0;
    for (int64_t base = 0; base < limit; base += kSampleThreads) {
      const int64_t j = base + threadIdx.x;
      double cum, chunk;
      Scan(tmp.scan).InclusiveSum(j < limit ? p_of(j) : 0.0, cum, chunk);
      __syncthreads();
      sum += chunk;
    }
    return sum;
  };
  const double total = mass(k);
  // top-p: the smallest prefix whose share reaches top_p, and its mass.
  int64_t keep = k;
  double kept = total;
  if (r.top_p < 1) {
    const double top_p = r.top_p;
    const int64_t j = first_where(k, [&](double cum) { return cum / total >= top_p; });
    keep = j < k ? j + 1 : k;
    kept = mass(keep);
  }
  const double target = r.u * kept;
  const int64_t j = first_where(keep, [&](double cum) { return target < cum; });
  if (threadIdx.x == 0) ids[i] = val[j < keep ? j : keep - 1];
}

}  // namespace

std::vector<int32_t> sample_tokens(const Tensor& logits, int64_t pieces, int64_t rows, int64_t V,
                                   const std::vector<TokenSampling>& how, Workspace& ws,
                                   cudaStream_t s) {
  const int64_t Vl = logits.numel() / (pieces * rows);
  std::vector<DevRule> rules(static_cast<size_t>(rows));
  bool any_sampled = false;
  for (int64_t i = 0; i < rows; ++i) {
    const TokenSampling& h = how[i];
    rules[i] = {h.temperature, h.top_p, h.u, h.top_k, h.greedy() ? 1 : 0};
    any_sampled = any_sampled || !h.greedy();
  }
  const auto* dev_rules = static_cast<const DevRule*>(
      ws.upload(Scratch::kSampling, rules.data(), sizeof(DevRule) * rules.size(), s));
  // Scratch: dense logits and indices, their sorted copies, segment offsets, ids, CUB's storage.
  const int64_t n = rows * V;
  TESSERA_CHECK(n <= INT32_MAX, "sample_tokens: ", rows, " rows of ", V,
                " logits exceed the 2^31 items of one sort; sample fewer rows at a time");
  size_t sort_bytes = 0;
  if (any_sampled)
    CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        nullptr, sort_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n,
        static_cast<int>(rows), static_cast<const int64_t*>(nullptr),
        static_cast<const int64_t*>(nullptr), 0, 32, s));
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t fbytes = align(sizeof(float) * n), ibytes = align(sizeof(int32_t) * n),
               obytes = align(sizeof(int64_t) * (rows + 1)),
               idbytes = align(sizeof(int32_t) * rows);
  const int64_t chunks = (V + kArgmaxChunk - 1) / kArgmaxChunk;
  const size_t pbytes =
      align(sizeof(float) * rows * chunks) + align(sizeof(int32_t) * rows * chunks);
  char* base =
      static_cast<char*>(ws.get(Scratch::kSamplingSort, 2 * fbytes + 2 * ibytes + obytes + idbytes +
                                                            align(sort_bytes) + pbytes));
  float* dense = reinterpret_cast<float*>(base);
  float* sorted = reinterpret_cast<float*>(base + fbytes);
  int32_t* vals = reinterpret_cast<int32_t*>(base + 2 * fbytes);
  int32_t* sorted_vals = reinterpret_cast<int32_t*>(base + 2 * fbytes + ibytes);
  int64_t* offsets = reinterpret_cast<int64_t*>(base + 2 * fbytes + 2 * ibytes);
  int32_t* ids = reinterpret_cast<int32_t*>(base + 2 * fbytes + 2 * ibytes + obytes);
  void* sort_tmp = base + 2 * fbytes + 2 * ibytes + obytes + idbytes;
  float* part_v = reinterpret_cast<float*>(static_cast<char*>(sort_tmp) + align(sort_bytes));
  int32_t* part_i = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(part_v) +
                                               align(sizeof(float) * rows * chunks));
  assemble_kernel<<<blocks_for(n), kThreads, 0, s>>>(dense, vals, logits.f32(), rows, V, Vl);
  LAUNCH_CHECK();
  TESSERA_CHECK(chunks <= 65535, "sample_tokens: a vocabulary of ", V, " logits (at most ",
                65535 * kArgmaxChunk, ")");
  argmax_partial_kernel<<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(chunks)),
                          kSampleThreads, 0, s>>>(part_v, part_i, dense, dev_rules, V, chunks);
  LAUNCH_CHECK();
  argmax_final_kernel<<<static_cast<unsigned>(rows), 32, 0, s>>>(ids, part_v, part_i, dev_rules, V,
                                                                 chunks);
  LAUNCH_CHECK();
  if (any_sampled) {
    std::vector<int64_t> off(static_cast<size_t>(rows + 1));
    for (int64_t i = 0; i <= rows; ++i) off[i] = i * V;
    CUDA_CHECK(cudaMemcpyAsync(offsets, off.data(), sizeof(int64_t) * off.size(),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        sort_tmp, sort_bytes, dense, sorted, vals, sorted_vals, n, static_cast<int>(rows), offsets,
        offsets + 1, 0, 32, s));
    pick_kernel<<<static_cast<unsigned>(rows), kSampleThreads, 0, s>>>(ids, sorted, sorted_vals,
                                                                       dev_rules, V);
    LAUNCH_CHECK();
  }
  std::vector<int32_t> out(static_cast<size_t>(rows));
  CUDA_CHECK(cudaMemcpyAsync(out.data(), ids, sizeof(int32_t) * rows, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // the ids are on the host when this returns
  return out;
}

}  // namespace tessera::cuda_ops
