// ring.cu: context parallelism's ring-attention ops of the CUDA backend. The merge and the column
// copies are kernels (bodies in ring.cuh, checked on the host warp emulator by test_ring_emu).
// The block attention (ring_block_forward / ring_block_backward) runs on the tensor-core
// attention kernels (flash_attention_tc.cuh in its ring mode: separate K/V rows, no causal mask
// off the diagonal, dQ and dK/dV added where they belong; also on the emulator) in bf16/f16 at
// head dims 64 and 128 without attention dropout or ALiBi; every other block runs the host
// reference (backend/cpu/ring_attention.hpp) on f32 copies: correct, and slow (a device round
// trip per block). Documents (RingBlockSpec::docs) run on both: the tensor-core blocks get each
// query row's first visible key as a key row of the block (ring_key_begin_kernel), the host
// blocks the whole tables.
#include <cuda_runtime.h>

#include <initializer_list>
#include <vector>

#include "backend/cpu/ring_attention.hpp"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/flash_attention_tc.cuh"
#include "backend/cuda/flash_attention_tc.hpp"
#include "backend/cuda/ops.hpp"
#include "backend/cuda/ring.cuh"
#include "core/documents.hpp"
#include "core/error.hpp"

namespace tessera::cuda_ops {

namespace rk = ring_kernels;

namespace {

template <typename T>
__global__ void __launch_bounds__(rk::kThreads)
    merge_kernel(T* out, float* lse, const T* part_out, const float* part_lse, int64_t B,
                 int64_t Tn, int64_t H, int64_t hd, int64_t q0, int64_t nq) {
  rk::merge(out, lse, part_out, part_lse, B, Tn, H, hd, q0, nq);
}

template <typename T>
__global__ void __launch_bounds__(rk::kThreads)
    copy_columns_kernel(T* dst, int64_t dst_width, int64_t dst_col, const T* src, int64_t src_width,
                        int64_t src_col, int64_t rows, int64_t cols) {
  rk::copy_columns(dst, dst_width, dst_col, src, src_width, src_col, rows, cols);
}

template <typename T>
__global__ void __launch_bounds__(rk::kThreads)
    copy_column_blocks_kernel(T* dst, int64_t dst_width, int64_t dst_col, int64_t dst_stride,
                              const T* src, int64_t src_width, int64_t src_col, int64_t src_stride,
                              int64_t rows, int64_t cols, int64_t blocks) {
  rk::copy_column_blocks(dst, dst_width, dst_col, dst_stride, src, src_width, src_col, src_stride,
                         rows, cols, blocks);
}

// A device tensor as host f32 values (the stream synchronized), and back.
std::vector<float> to_host_f32(const Tensor& t, cudaStream_t s) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::F32) {
    CUDA_CHECK(cudaMemcpyAsync(out.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return out;
  }
  std::vector<uint16_t> h(out.size());
  CUDA_CHECK(cudaMemcpyAsync(h.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  for (size_t i = 0; i < h.size(); ++i)
    out[i] = t.dtype() == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
  return out;
}
void from_host_f32(Tensor& t, const std::vector<float>& v, cudaStream_t s) {
  if (t.dtype() == DType::F32) {
    CUDA_CHECK(cudaMemcpyAsync(t.raw(), v.data(), t.nbytes(), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < h.size(); ++i)
    h[i] = t.dtype() == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
  CUDA_CHECK(cudaMemcpyAsync(t.raw(), h.data(), t.nbytes(), cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // h goes out of scope
}

// The tensor-core kernels take the block: bf16/f16, head dim 64 or 128, no dropout or ALiBi, and a
// causal block only on the diagonal (the mask is by local row).
bool ring_on_tensor_cores(const Tensor& qkv, const RingShape& r, const RingBlockSpec& b,
                          std::initializer_list<const void*> ptrs) {
  if (b.dropout || b.alibi || b.nq == 0 || b.nk == 0) return false;
  if (b.causal && !(b.q0 == 0 && b.k0 == 0 && b.nq == r.T && b.nk == r.T && b.q_rank == b.k_rank))
    return false;
  return tc::flash_supported(qkv.dtype(), r.hd, r.B * b.heads, ptrs);
}

// Documents (RingBlockSpec::docs: the whole samples' tables by global position) for a block:
// each query row's first visible key as a key row of the block.
__global__ void ring_key_begin_kernel(int32_t* out, const int32_t* key_begin, int64_t B, int64_t Tn,
                                      int q_rank, int k_rank, int cp, int64_t q0, int64_t nq,
                                      int64_t k0, int64_t nk) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * nq) return;
  const int64_t b = i / nq, row = i % nq, S = Tn * cp;
  out[b * Tn + row] =
      cp_block_key_begin(key_begin + b * S, q_rank, k_rank, cp, Tn / 2, q0, k0, nk, row);
}

// The block's first-key table on the device (B, Tn) in the workspace, or null without documents.
// ALiBi's reset positions are not needed by the tensor-core blocks (no ALiBi there).
const int32_t* ring_key_begin(const RingBlockSpec& b, const RingShape& r, Workspace& ws,
                              cudaStream_t s) {
  if (!b.docs || !b.docs->key_begin) return nullptr;
  const Tensor& kb = *b.docs->key_begin;
  TESSERA_CHECK(kb.dtype() == DType::I32 && kb.numel() == r.B * r.T * b.cp,
                "ring block documents: a first-key table of ", kb.numel(), " entries for ", r.B,
                " samples of ", r.T * b.cp, " positions");
  int32_t* out = ws.get<int32_t>(Scratch::kRingDocs, r.B * r.T);
  const int64_t n = r.B * b.nq;
  if (n > 0)
    ring_key_begin_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(
        out, kb.i32(), r.B, r.T, b.q_rank, b.k_rank, b.cp, b.q0, b.nq, b.k0, b.nk);
  LAUNCH_CHECK();
  return out;
}

// The whole samples' tables on the host, for the host blocks (dropout or ALiBi with documents).
struct HostDocs {
  std::vector<int32_t> key_begin, positions;
  cpu::ring::RingDocs docs() const {
    return {key_begin.empty() ? nullptr : key_begin.data(),
            positions.empty() ? nullptr : positions.data()};
  }
};
HostDocs host_docs(const RingBlockSpec& b, cudaStream_t s) {
  HostDocs h;
  if (!b.docs) return h;
  auto copy = [&](const Tensor* t, std::vector<int32_t>& v) {
    if (!t) return;
    v.resize(static_cast<size_t>(t->numel()));
    CUDA_CHECK(cudaMemcpyAsync(v.data(), t->raw(), t->nbytes(), cudaMemcpyDeviceToHost, s));
  };
  copy(b.docs->key_begin, h.key_begin);
  copy(b.docs->positions, h.positions);
  CUDA_CHECK(cudaStreamSynchronize(s));
  return h;
}

tc::FlashRing flash_ring(const RingBlockSpec& b, const Tensor& kv, Tensor* dkv) {
  tc::FlashRing f;
  f.kv = kv.raw();
  f.dkv = dkv ? dkv->raw() : nullptr;
  f.q_off = static_cast<int>(b.q0);
  f.Tq = static_cast<int>(b.nq);
  f.k_off = static_cast<int>(b.k0);
  f.Tk = static_cast<int>(b.nk);
  f.causal = b.causal;
  return f;
}

}  // namespace

void attention_merge(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse,
                     int64_t q0, cudaStream_t s) {
  const MergeShape m = check_attention_merge(out, lse, part_out, part_lse, q0);
  const int64_t items = m.B * m.nq * m.H;
  if (items == 0) return;
  dispatch(out.dtype(), "attention merge", [&](auto tag) {
    using T = decltype(tag);
    merge_kernel<T><<<rowwise::warp_blocks(items), rk::kThreads, 0, s>>>(
        out.data<T>(), lse.f32(), part_out.data<T>(), part_lse.f32(), m.B, m.T, m.H, m.hd, q0,
        m.nq);
  });
  LAUNCH_CHECK();
}

void copy_columns(Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t cols,
                  cudaStream_t s) {
  const ColumnCopy c = check_copy_columns(dst, dst_col, src, src_col, cols);
  if (c.rows == 0 || cols == 0) return;
  dispatch(dst.dtype(), "copy columns", [&](auto tag) {
    using T = decltype(tag);
    copy_columns_kernel<T><<<rowwise::warp_blocks(c.rows), rk::kThreads, 0, s>>>(
        dst.data<T>(), c.dst_width, dst_col, src.data<T>(), c.src_width, src_col, c.rows, cols);
  });
  LAUNCH_CHECK();
}

void copy_column_blocks(Tensor& dst, int64_t dst_col, int64_t dst_stride, const Tensor& src,
                        int64_t src_col, int64_t src_stride, int64_t cols, int64_t blocks,
                        cudaStream_t s) {
  if (blocks <= 0) return;
  // The first and the last block bound every other (strides >= 0).
  TESSERA_CHECK(dst_stride >= 0 && src_stride >= 0, "copy_column_blocks: negative stride");
  const ColumnCopy c = check_copy_columns(dst, dst_col, src, src_col, cols);
  check_copy_columns(dst, dst_col + (blocks - 1) * dst_stride, src,
                     src_col + (blocks - 1) * src_stride, cols);
  if (c.rows == 0 || cols == 0) return;
  dispatch(dst.dtype(), "copy column blocks", [&](auto tag) {
    using T = decltype(tag);
    copy_column_blocks_kernel<T><<<rowwise::warp_blocks(c.rows), rk::kThreads, 0, s>>>(
        dst.data<T>(), c.dst_width, dst_col, dst_stride, src.data<T>(), c.src_width, src_col,
        src_stride, c.rows, cols, blocks);
  });
  LAUNCH_CHECK();
}

void ring_block_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv,
                        const RingBlockSpec& b, Workspace& ws, cudaStream_t s) {
  const RingShape r = check_ring_block(qkv, kv, b);
  TESSERA_CHECK(out.numel() == r.B * b.nq * b.heads * r.hd && lse.numel() == r.B * b.heads * b.nq &&
                    lse.dtype() == DType::F32,
                "ring block: out must be (B,nq,H*hd) and lse (B,H,nq) f32");
  if (ring_on_tensor_cores(qkv, r, b, {qkv.raw(), kv.raw(), out.raw()})) {
    tc::flash_ring_forward(qkv.dtype(), out.raw(), lse.f32(), qkv.raw(), kv.raw(), r.B, r.T,
                           b.heads, r.G, r.hd, flash_ring(b, kv, nullptr), s,
                           ring_key_begin(b, r, ws, s));
    return;
  }
  const std::vector<float> q = to_host_f32(qkv, s), k = to_host_f32(kv, s);
  std::vector<float> o(static_cast<size_t>(out.numel())), l(static_cast<size_t>(lse.numel()));
  const HostDocs docs = host_docs(b, s);
  cpu::ring::ring_block_forward(o.data(), l.data(), q.data(), k.data(), r.B, r.T, r.hd, b,
                                docs.docs());
  from_host_f32(out, o, s);
  from_host_f32(lse, l, s);
}

void ring_block_backward(Tensor& dqkv, Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                         const Tensor& kv, const Tensor& out, const Tensor& lse,
                         const RingBlockSpec& b, Workspace& ws, cudaStream_t s) {
  const RingShape r = check_ring_block(qkv, kv, b);
  TESSERA_CHECK(dqkv.numel() == qkv.numel() && dkv.numel() == kv.numel() &&
                    dout.numel() == r.B * r.T * b.heads * r.hd && out.numel() == dout.numel() &&
                    lse.numel() == r.B * b.heads * r.T && lse.dtype() == DType::F32,
                "ring block backward shapes");
  if (ring_on_tensor_cores(qkv, r, b,
                           {qkv.raw(), kv.raw(), dqkv.raw(), dkv.raw(), dout.raw(), out.raw()})) {
    float* rowdot = ws.get<float>(Scratch::kAttentionRowdot, r.B * b.heads * r.T);
    tc::flash_ring_backward(qkv.dtype(), dqkv.raw(), dout.raw(), qkv.raw(), out.raw(), lse.f32(),
                            rowdot, r.B, r.T, b.heads, r.G, r.hd, flash_ring(b, kv, &dkv), s,
                            ring_key_begin(b, r, ws, s));
    return;
  }
  std::vector<float> dq = to_host_f32(dqkv, s), dk = to_host_f32(dkv, s);
  const std::vector<float> d = to_host_f32(dout, s), q = to_host_f32(qkv, s),
                           k = to_host_f32(kv, s), o = to_host_f32(out, s), l = to_host_f32(lse, s);
  const HostDocs docs = host_docs(b, s);
  cpu::ring::ring_block_backward(dq.data(), dk.data(), d.data(), q.data(), k.data(), o.data(),
                                 l.data(), r.B, r.T, r.hd, b, docs.docs());
  from_host_f32(dqkv, dq, s);
  from_host_f32(dkv, dk, s);
}

}  // namespace tessera::cuda_ops
