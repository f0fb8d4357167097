// embedding.cu: token embedding lookup over a vocabulary shard and the position embedding add,
// forward and backward. The token backward scatters dout into the rows of the ids: it sorts the
// tokens by row (CUB), so each row is summed by one block, in token order, with no atomics; the
// result is the same, bit for bit, as adding the tokens one after the other. The CPU reference is
// backend/cpu/embedding.hpp.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <climits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/ops.hpp"

namespace tessera::cuda_ops {

namespace {

// ---- embeddings -------------------------------------------------------------------------------

template <typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* ids, const T* table, int64_t N,
                                         int64_t C, int64_t row_begin, int64_t rows) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t n = i / C, c = i % C;
  const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
  out[i] = (r >= 0 && r < rows) ? table[r * C + c] : to<T>(0.f);
}

// The sort keys of the backward: key[n] is the shard-local row of token n, or `rows` (past every
// row) when the token's id belongs to another shard; the values are the token indices 0..N-1.
__global__ void embedding_sort_keys_kernel(uint32_t* keys, int32_t* tokens, const int32_t* ids,
                                           int64_t N, int64_t row_begin, int64_t rows) {
  const int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (n >= N) return;
  const int64_t r = static_cast<int64_t>(ids[n]) - row_begin;
  keys[n] = static_cast<uint32_t>(r >= 0 && r < rows ? r : rows);
  tokens[n] = static_cast<int32_t>(n);
}

// V storage elements read in one aligned load.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// dtable[r] += dout[n] for the tokens n of one run (the tokens whose id is row r, in increasing n):
// one block per run, V consecutive channels per thread. Blocks past the number of runs, and the run
// of the tokens of other shards (row == other_shard), do nothing.
//
// Deterministic, and bitwise the same as one thread per channel walking all tokens in order
// (dtable[r,c] += dout[n,c] for n = 0..N-1): the radix sort is stable and its values were the
// token indices in increasing order, so a run lists its tokens in increasing n; rows are distinct
// across runs, so each dtable[r,c] has exactly one writer, which starts from the stored value and
// adds the run's tokens in that order, rounding to f32 after each add (acc is a float, and there
// is no multiply to fuse with). No atomics; nothing depends on the order blocks run in.
template <typename T, int V>
__global__ void embedding_backward_runs_kernel(
    float* __restrict__ dtable, const T* __restrict__ dout, const int32_t* __restrict__ tokens,
    const uint32_t* __restrict__ run_rows, const int32_t* __restrict__ run_counts,
    const int32_t* __restrict__ run_starts, const int32_t* __restrict__ num_runs, int64_t C,
    uint32_t other_shard) {
  const int run = blockIdx.x;
  if (run >= *num_runs) return;
  const uint32_t r = run_rows[run];
  if (r == other_shard) return;
  const int32_t* tok = tokens + run_starts[run];
  const int count = run_counts[run];
  float* row = dtable + static_cast<int64_t>(r) * C;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < C;
       c += static_cast<int64_t>(blockDim.x) * V) {
    float acc[V];
    if constexpr (V % 4 == 0) {  // 16-byte loads and stores of the f32 row
#pragma unroll
      for (int g = 0; g < V; g += 4) {
        const float4 q = *reinterpret_cast<const float4*>(row + c + g);
        acc[g] = q.x;
        acc[g + 1] = q.y;
        acc[g + 2] = q.z;
        acc[g + 3] = q.w;
      }
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = row[c + v];
    }
#pragma unroll 4
    for (int j = 0; j < count; ++j) {
      const Pack<T, V> x =
          *reinterpret_cast<const Pack<T, V>*>(dout + static_cast<int64_t>(tok[j]) * C + c);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += ld(x.v[v]);
    }
    if constexpr (V % 4 == 0) {
#pragma unroll
      for (int g = 0; g < V; g += 4)
        *reinterpret_cast<float4*>(row + c + g) =
            make_float4(acc[g], acc[g + 1], acc[g + 2], acc[g + 3]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) row[c + v] = acc[v];
    }
  }
}

template <typename S>
__global__ void position_forward_kernel(S* out, const S* wpe, int64_t B, int64_t T, int64_t C) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * T * C) return;
  out[i] = to<S>(ld(out[i]) + ld(wpe[((i / C) % T) * C + i % C]));
}
template <typename S>
__global__ void position_backward_kernel(float* dwpe, const S* dout, int64_t B, int64_t T,
                                         int64_t C) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= T * C) return;
  float s = 0.f;
  for (int64_t b = 0; b < B; ++b) s += ld(dout[b * T * C + i]);
  dwpe[i] += s;
}

// The runs kernel for storage type T: 16-byte loads where the rows allow, else one channel per
// thread; as many threads as the row needs, at most kThreads.
template <typename T>
void launch_runs(float* dtable, const T* dout, const int32_t* tokens, const uint32_t* run_rows,
                 const int32_t* run_counts, const int32_t* run_starts, const int32_t* num_runs,
                 int64_t N, int64_t C, uint32_t other_shard, cudaStream_t s) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = C % kVec == 0 && reinterpret_cast<uintptr_t>(dout) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dtable) % 16 == 0;
  const int64_t lanes = aligned ? C / kVec : C;  // threads one row needs
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, (lanes + 31) / 32 * 32));
  const unsigned grid = static_cast<unsigned>(N);  // at most one run per token
  if (aligned)
    embedding_backward_runs_kernel<T, kVec><<<grid, threads, 0, s>>>(
        dtable, dout, tokens, run_rows, run_counts, run_starts, num_runs, C, other_shard);
  else
    embedding_backward_runs_kernel<T, 1><<<grid, threads, 0, s>>>(
        dtable, dout, tokens, run_rows, run_counts, run_starts, num_runs, C, other_shard);
}

}  // namespace

void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, int64_t row_begin,
                       cudaStream_t s) {
  const int64_t N = ids.numel(), C = cols_of(out);
  dispatch(out.dtype(), "embedding", [&](auto tag) {
    using T = decltype(tag);
    embedding_forward_kernel<T><<<blocks_for(N * C), kThreads, 0, s>>>(
        out.data<T>(), ids.i32(), table.data<T>(), N, C, row_begin, rows_of(table));
  });
  LAUNCH_CHECK();
}

// Sort the tokens by row (stable radix sort of (row, token) pairs over the bits a row needs), find
// the runs of equal rows and where each starts (run-length encoding, exclusive scan of the run
// lengths), then add each run's tokens into its row (embedding_backward_runs_kernel). The arrays
// and CUB's temporary storage share one grow-only workspace buffer.
void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t row_begin,
                        Workspace& ws, cudaStream_t s) {
  const int64_t N = ids.numel(), C = cols_of(dout), rows = rows_of(dtable);
  if (N == 0 || C == 0 || rows == 0) return;
  TESSERA_CHECK(N < INT_MAX && rows < INT_MAX, "embedding backward: ", N, " tokens and ", rows,
                " rows must each be fewer than 2^31");
  const int n = static_cast<int>(N);
  const uint32_t other_shard = static_cast<uint32_t>(rows);  // the key past every row
  int end_bit = 0;                                           // keys 0..rows take end_bit bits
  while ((int64_t{1} << end_bit) <= rows) ++end_bit;

  // CUB's temporary storage (sizes only: nothing runs), shared by the three calls in turn.
  size_t sort_bytes = 0, encode_bytes = 0, scan_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n, 0, end_bit, s));
  CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(
      nullptr, encode_bytes, static_cast<uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n, s));
  CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                           static_cast<int32_t*>(nullptr), n, s));
  const size_t temp_bytes = std::max({sort_bytes, encode_bytes, scan_bytes});

  // Seven arrays of N 4-byte words, the run count, then the temporary storage, each 256-aligned.
  const size_t array = (sizeof(int32_t) * static_cast<size_t>(N) + 255) / 256 * 256;
  char* base = static_cast<char*>(ws.get(Scratch::kEmbeddingSort, 7 * array + 256 + temp_bytes));
  auto* keys = reinterpret_cast<uint32_t*>(base);
  auto* sorted_keys = reinterpret_cast<uint32_t*>(base + array);
  auto* tokens = reinterpret_cast<int32_t*>(base + 2 * array);
  auto* sorted_tokens = reinterpret_cast<int32_t*>(base + 3 * array);
  auto* run_rows = reinterpret_cast<uint32_t*>(base + 4 * array);
  auto* run_counts = reinterpret_cast<int32_t*>(base + 5 * array);
  auto* run_starts = reinterpret_cast<int32_t*>(base + 6 * array);
  auto* num_runs = reinterpret_cast<int32_t*>(base + 7 * array);
  void* temp = base + 7 * array + 256;

  dispatch(dout.dtype(), "embedding backward", [&](auto tag) {
    using T = decltype(tag);
    embedding_sort_keys_kernel<<<blocks_for(N), kThreads, 0, s>>>(keys, tokens, ids.i32(), N,
                                                                  row_begin, rows);
    LAUNCH_CHECK();
    size_t bytes = temp_bytes;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, keys, sorted_keys, tokens,
                                               sorted_tokens, n, 0, end_bit, s));
    // Counts past the last run are never written; zeroed, the scan over all N reads defined values.
    CUDA_CHECK(cudaMemsetAsync(run_counts, 0, sizeof(int32_t) * static_cast<size_t>(N), s));
    bytes = temp_bytes;
    CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(temp, bytes, sorted_keys, run_rows, run_counts,
                                                  num_runs, n, s));
    bytes = temp_bytes;
    CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, bytes, run_counts, run_starts, n, s));
    launch_runs<T>(dtable.f32(), dout.data<T>(), sorted_tokens, run_rows, run_counts, run_starts,
                   num_runs, N, C, other_shard, s);
  });
  LAUNCH_CHECK();
}

void position_embedding_forward(Tensor& out, const Tensor& wpe, cudaStream_t s) {
  dispatch(out.dtype(), "position embedding", [&](auto tag) {
    using T = decltype(tag);
    position_forward_kernel<T><<<blocks_for(out.numel()), kThreads, 0, s>>>(
        out.data<T>(), wpe.data<T>(), out.dim(0), out.dim(1), out.dim(2));
  });
  LAUNCH_CHECK();
}

void position_embedding_backward(Tensor& dwpe, const Tensor& dout, cudaStream_t s) {
  dispatch(dout.dtype(), "position embedding backward", [&](auto tag) {
    using T = decltype(tag);
    position_backward_kernel<T><<<blocks_for(dout.dim(1) * dout.dim(2)), kThreads, 0, s>>>(
        dwpe.f32(), dout.data<T>(), dout.dim(0), dout.dim(1), dout.dim(2));
  });
  LAUNCH_CHECK();
}

}  // namespace tessera::cuda_ops
