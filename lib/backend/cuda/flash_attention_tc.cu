// flash_attention_tc.cu: the __global__ wrappers and launchers of the tensor-core attention whose
// bodies are in flash_attention_tc.cuh (shared with the warp emulator test), and the row-dot
// kernel of the backward.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <type_traits>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/flash_attention_tc.cuh"
#include "backend/cuda/flash_attention_tc.hpp"
#include "core/error.hpp"

namespace tessera::tc {

namespace {

// mma.sync bf16/f16 and cp.async need sm_80: older targets compile a trap (flash_supported() never
// picks them at run time).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TC_SM80(...) __VA_ARGS__
#else
#define TC_SM80(...) __trap()
#endif

// kAlibi: ALiBi's bias (p.alibi); the kernels without it have none of its code.
// kRing: context parallelism's ring blocks (FlashRing); the kernels without it are unchanged.
template <typename T, int D, bool kAlibi, bool kRing>
__global__ void __launch_bounds__(FwdCfg<D>::W * 32) flash_fwd_kernel(FlashFwdArgs p) {
  extern __shared__ __align__(16) char smem[];
  TC_SM80((flash_fwd_body<T, D, kAlibi, kRing>(p, smem)));
}
template <typename T, int D, bool kAlibi, bool kRing>
__global__ void __launch_bounds__(BwdKvCfg<D>::W * 32) flash_bwd_kv_kernel(FlashBwdArgs p) {
  extern __shared__ __align__(16) char smem[];
  TC_SM80((flash_bwd_kv_body<T, D, kAlibi, kRing>(p, smem)));
}
template <typename T, int D, bool kAlibi, bool kRing>
__global__ void __launch_bounds__(BwdQCfg<D>::W * 32) flash_bwd_q_kernel(FlashBwdArgs p) {
  extern __shared__ __align__(16) char smem[];
  TC_SM80((flash_bwd_q_body<T, D, kAlibi, kRing>(p, smem)));
}

template <typename T>
__device__ __forceinline__ float2 to_float2(uint32_t v);
template <>
__device__ __forceinline__ float2 to_float2<__nv_bfloat16>(uint32_t v) {
  __nv_bfloat162 x;
  memcpy(&x, &v, 4);
  return __bfloat1622float2(x);
}
template <>
__device__ __forceinline__ float2 to_float2<__half>(uint32_t v) {
  __half2 x;
  memcpy(&x, &v, 4);
  return __half22float2(x);
}

// rowdot[b, h, t] = dout[b, t, h, :] . out[b, t, h, :] in f32: one warp per (b, t, h), lanes over
// pairs of the head dimension (coalesced), a fixed shuffle tree (deterministic).
template <typename T, int D>
__global__ void rowdot_kernel(float* rowdot, const T* dout, const T* out, int64_t rows, int Tn,
                              int H) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;  // whole warps leave together
  // Pairs of the head dimension as one 32-bit load each (rows are D-aligned, D even).
  const uint32_t* g = reinterpret_cast<const uint32_t*>(dout + r * D);
  const uint32_t* o = reinterpret_cast<const uint32_t*>(out + r * D);
  float s = 0.f;
#pragma unroll
  for (int i = lane; i < D / 2; i += 32) {
    const float2 a = to_float2<T>(g[i]), c = to_float2<T>(o[i]);
    s += a.x * c.x + a.y * c.y;
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  if (lane == 0) {
    const int64_t h = r % H, t = (r / H) % Tn, b = r / (static_cast<int64_t>(H) * Tn);
    rowdot[(b * H + h) * Tn + t] = s;
  }
}

// Dynamic shared memory above 48 KB must be allowed per kernel, once on each device (the
// attribute belongs to the device's context); `done` holds a bit per device.
template <typename K>
void allow_smem(K kernel, int bytes, std::atomic<uint64_t>& done) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t(1) << (dev % 64);
  if (done.load(std::memory_order_acquire) & bit) return;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_release);
}

template <typename T, int D, bool kAlibi, bool kRing = false>
void forward(void* out, float* lse, const void* qkv, int64_t B, int64_t Tn, int64_t H, int64_t G,
             const AttentionDropout& drop, const AttentionAlibi& alibi, cudaStream_t s,
             const FlashRing& ring = {}, const int32_t* key_begin = nullptr) {
  static std::atomic<uint64_t> ready{0};
  constexpr int bytes = FwdCfg<D>::smem_bytes();
  allow_smem(flash_fwd_kernel<T, D, kAlibi, kRing>, bytes, ready);
  const int64_t Tq = ring.kv ? ring.Tq : Tn;  // a ring block's query rows
  const dim3 grid(static_cast<unsigned>((Tq + FwdCfg<D>::Br - 1) / FwdCfg<D>::Br),
                  static_cast<unsigned>(B * H));
  flash_fwd_kernel<T, D, kAlibi, kRing><<<grid, FwdCfg<D>::W * 32, bytes, s>>>(
      FlashFwdArgs{out, lse, qkv, static_cast<int>(Tn), static_cast<int>(H), static_cast<int>(G),
                   drop, alibi, ring, key_begin});
  CUDA_CHECK(cudaGetLastError());
}

template <typename T, int D, bool kAlibi, bool kRing = false>
void backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
              float* rowdot, int64_t B, int64_t Tn, int64_t H, int64_t G,
              const AttentionDropout& drop, const AttentionAlibi& alibi, cudaStream_t s,
              const FlashRing& ring = {}, const int32_t* key_begin = nullptr) {
  static std::atomic<uint64_t> kv_ready{0}, q_ready{0};
  constexpr int kv_bytes = BwdKvCfg<D>::smem_bytes(), q_bytes = BwdQCfg<D>::smem_bytes();
  allow_smem(flash_bwd_kv_kernel<T, D, kAlibi, kRing>, kv_bytes, kv_ready);
  allow_smem(flash_bwd_q_kernel<T, D, kAlibi, kRing>, q_bytes, q_ready);
  const int64_t rows = B * Tn * H;
  rowdot_kernel<T, D><<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, s>>>(
      rowdot, static_cast<const T*>(dout), static_cast<const T*>(out), rows, static_cast<int>(Tn),
      static_cast<int>(H));
  CUDA_CHECK(cudaGetLastError());
  const FlashBwdArgs a{dqkv,
                       dout,
                       qkv,
                       lse,
                       rowdot,
                       static_cast<int>(Tn),
                       static_cast<int>(H),
                       static_cast<int>(G),
                       drop,
                       alibi,
                       ring,
                       key_begin};
  const int64_t Tq = ring.kv ? ring.Tq : Tn, Tk = ring.kv ? ring.Tk : Tn;
  // dK/dV: one block per (b, key/value head, key tile), looping over the group's query heads.
  const dim3 kv_grid(static_cast<unsigned>((Tk + BwdKvCfg<D>::Bk - 1) / BwdKvCfg<D>::Bk),
                     static_cast<unsigned>(B * G));
  flash_bwd_kv_kernel<T, D, kAlibi, kRing><<<kv_grid, BwdKvCfg<D>::W * 32, kv_bytes, s>>>(a);
  CUDA_CHECK(cudaGetLastError());
  const dim3 q_grid(static_cast<unsigned>((Tq + BwdQCfg<D>::Br - 1) / BwdQCfg<D>::Br),
                    static_cast<unsigned>(B * H));
  flash_bwd_q_kernel<T, D, kAlibi, kRing><<<q_grid, BwdQCfg<D>::W * 32, q_bytes, s>>>(a);
  CUDA_CHECK(cudaGetLastError());
}

// Calls f(T{}, integral_constant<int, D>, bool_constant<alibi>) for the storage type, the head
// dimension and whether ALiBi is on.
template <typename F>
void dispatch(DType dtype, int64_t D, bool alibi, F&& f) {
  auto with_alibi = [&](auto tag, auto d) {
    if (alibi) return f(tag, d, std::true_type{});
    f(tag, d, std::false_type{});
  };
  if (dtype == DType::BF16) {
    if (D == 64) return with_alibi(__nv_bfloat16{}, std::integral_constant<int, 64>{});
    return with_alibi(__nv_bfloat16{}, std::integral_constant<int, 128>{});
  }
  if (D == 64) return with_alibi(__half{}, std::integral_constant<int, 64>{});
  with_alibi(__half{}, std::integral_constant<int, 128>{});
}

}  // namespace

bool flash_supported(DType dtype, int64_t head_dim, int64_t batch_heads,
                     std::initializer_list<const void*> ptrs) {
  static const bool off = [] {
    const char* v = std::getenv("TESSERA_ATTENTION");
    return v && std::strcmp(v, "scalar") == 0;
  }();
  if (off || (dtype != DType::BF16 && dtype != DType::F16)) return false;
  if (head_dim != 64 && head_dim != 128) return false;
  if (batch_heads > 65535) return false;  // grid.y
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  // The device: sm_80 or newer, and room for the largest of the three kernels' shared memory
  // (sm_86/sm_89 allow 99 KB per block, less than the head-dim-128 kernels take). Cached per
  // device and head dim.
  static std::mutex mu;
  static std::map<std::pair<int, int64_t>, bool> known;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find({dev, head_dim});
  if (it != known.end()) return it->second;
  int major = 0, optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const int need = head_dim == 64
                       ? std::max({FwdCfg<64>::smem_bytes(), BwdKvCfg<64>::smem_bytes(),
                                   BwdQCfg<64>::smem_bytes()})
                       : std::max({FwdCfg<128>::smem_bytes(), BwdKvCfg<128>::smem_bytes(),
                                   BwdQCfg<128>::smem_bytes()});
  const bool ok = major >= 8 && optin >= need;
  known[{dev, head_dim}] = ok;
  return ok;
}

void flash_forward(DType dtype, void* out, float* lse, const void* qkv, int64_t B, int64_t Tn,
                   int64_t H, int64_t G, int64_t D, const AttentionDropout& drop,
                   const AttentionAlibi* alibi, cudaStream_t stream, const int32_t* key_begin) {
  const AttentionAlibi al = alibi ? *alibi : AttentionAlibi{};
  dispatch(dtype, D, alibi != nullptr, [&](auto tag, auto d, auto a) {
    forward<decltype(tag), decltype(d)::value, decltype(a)::value>(out, lse, qkv, B, Tn, H, G, drop,
                                                                   al, stream, {}, key_begin);
  });
}

void flash_backward(DType dtype, void* dqkv, const void* dout, const void* qkv, const void* out,
                    const float* lse, float* rowdot, int64_t B, int64_t Tn, int64_t H, int64_t G,
                    int64_t D, const AttentionDropout& drop, const AttentionAlibi* alibi,
                    cudaStream_t stream, const int32_t* key_begin) {
  const AttentionAlibi al = alibi ? *alibi : AttentionAlibi{};
  dispatch(dtype, D, alibi != nullptr, [&](auto tag, auto d, auto a) {
    backward<decltype(tag), decltype(d)::value, decltype(a)::value>(
        dqkv, dout, qkv, out, lse, rowdot, B, Tn, H, G, drop, al, stream, {}, key_begin);
  });
}

void flash_ring_forward(DType dtype, void* out, float* lse, const void* qkv, const void* kv,
                        int64_t B, int64_t Tn, int64_t H, int64_t G, int64_t D,
                        const FlashRing& ring, cudaStream_t stream, const int32_t* key_begin) {
  TESSERA_CHECK(ring.kv == kv && ring.Tq > 0 && ring.Tk > 0, "flash_ring_forward: empty block");
  dispatch(dtype, D, false, [&](auto tag, auto d, auto) {
    forward<decltype(tag), decltype(d)::value, false, true>(
        out, lse, qkv, B, Tn, H, G, AttentionDropout{}, AttentionAlibi{}, stream, ring, key_begin);
  });
}

void flash_ring_backward(DType dtype, void* dqkv, const void* dout, const void* qkv,
                         const void* out, const float* lse, float* rowdot, int64_t B, int64_t Tn,
                         int64_t H, int64_t G, int64_t D, const FlashRing& ring,
                         cudaStream_t stream, const int32_t* key_begin) {
  TESSERA_CHECK(ring.kv && ring.dkv && ring.Tq > 0 && ring.Tk > 0,
                "flash_ring_backward: empty block");
  dispatch(dtype, D, false, [&](auto tag, auto d, auto) {
    backward<decltype(tag), decltype(d)::value, false, true>(
        dqkv, dout, qkv, out, lse, rowdot, B, Tn, H, G, AttentionDropout{}, AttentionAlibi{},
        stream, ring, key_begin);
  });
}

}  // namespace tessera::tc
