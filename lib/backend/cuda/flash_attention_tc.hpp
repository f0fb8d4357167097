// flash_attention_tc.hpp: launchers of the tensor-core causal attention (flash_attention_tc.cuh)
// for the CUDA backend (attention.cu). bf16 and f16, head dims 64 and 128; every other case keeps
// the scalar kernels, and f32 stays on them as the exact reference path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "core/alibi.hpp"
#include "core/dropout.hpp"
#include "core/dtype.hpp"

namespace tessera::tc {

// Whether the tensor-core kernels take this case: dtype bf16/f16, head dim 64 or 128, batch x
// heads within the grid's y limit, every pointer 16-byte aligned, and a current device of sm_80 or
// newer with the shared memory they need. TESSERA_ATTENTION=scalar in the environment turns them
// off (to compare).
bool flash_supported(DType dtype, int64_t head_dim, int64_t batch_heads,
                     std::initializer_list<const void*> ptrs);

// out (B,T,H,D), lse (B,H,T) f32 from qkv (B,T,H+2G,D): H query heads, G key/value heads
// (1 <= G, G divides H; query head h reads key/value head h / (H/G)).
// `drop`: attention dropout when drop.spec.active(). `alibi` (null: none): ALiBi's bias on the
// scores (core/alibi.hpp), by kernels compiled for it; the kernels without it are unchanged.
// `key_begin` (null: none): documents inside the samples, (B, T) int32 on the device, row t of
// sample b seeing keys key_begin[b*T+t] .. t only (core/documents.hpp).
void flash_forward(DType dtype, void* out, float* lse, const void* qkv, int64_t B, int64_t Tn,
                   int64_t H, int64_t G, int64_t D, const AttentionDropout& drop,
                   const AttentionAlibi* alibi, cudaStream_t stream,
                   const int32_t* key_begin = nullptr);
// dqkv (B,T,H+2G,D) overwritten (each key/value head's gradient sums its group's query heads);
// rowdot (B,H,T) f32 workspace filled here with dout . out.
void flash_backward(DType dtype, void* dqkv, const void* dout, const void* qkv, const void* out,
                    const float* lse, float* rowdot, int64_t B, int64_t Tn, int64_t H, int64_t G,
                    int64_t D, const AttentionDropout& drop, const AttentionAlibi* alibi,
                    cudaStream_t stream, const int32_t* key_begin = nullptr);

// Context parallelism's ring blocks on the same kernels (flash_attention_tc.cuh, FlashRing):
// queries rows [ring.q_off, + ring.Tq) of qkv (B,Tn,H+2G,D), keys and values rows [ring.k_off,
// + ring.Tk) of kv = ring.kv (B,Tn,2G,D), causal (by local row) or not; no dropout, no ALiBi.
// The forward writes out (B,Tq,H,D) and lse (B,H,Tq); the backward fills rowdot (B,H,Tn) from
// dout and the final out (B,Tn,H,D) and adds dQ into dqkv's query rows and dK/dV into ring.dkv.
// `key_begin` (null: none): documents, each query row's first visible key as a key row of the
// block, (B, Tn) int32 with row i of sample b at b*Tn + i (core/context_parallel.hpp,
// cp_block_key_begin).
struct FlashRing;
void flash_ring_forward(DType dtype, void* out, float* lse, const void* qkv, const void* kv,
                        int64_t B, int64_t Tn, int64_t H, int64_t G, int64_t D,
                        const FlashRing& ring, cudaStream_t stream,
                        const int32_t* key_begin = nullptr);
void flash_ring_backward(DType dtype, void* dqkv, const void* dout, const void* qkv,
                         const void* out, const float* lse, float* rowdot, int64_t B, int64_t Tn,
                         int64_t H, int64_t G, int64_t D, const FlashRing& ring,
                         cudaStream_t stream, const int32_t* key_begin = nullptr);

}  // namespace tessera::tc
