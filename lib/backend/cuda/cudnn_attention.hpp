// cudnn_attention.hpp: cuDNN's fused flash attention (Megatron's --attention-backend fused) through
// cuDNN's backend graph API: the causal forward with its log-sum-exp statistics and the backward,
// bf16/f16, grouped-query heads read in place from the packed qkv (B,T,(H+2G)*hd) by strides. The
// graphs are the ones cuDNN's frontend builds for scaled-dot-product attention (written here
// against the backend API: the header-only frontend is not a dependency), one execution plan per
// shape, built at the shape's first call and cached; a shape cuDNN refuses is cached with cuDNN's
// reason. The plans' workspace (and the backward's row sums and f32 dQ accumulator) comes from
// the backend's Workspace. docs/kernels.md "cuDNN attention" draws the two graphs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "backend/cuda/ops.hpp"
#include "core/tensor.hpp"

namespace tessera::cuda_ops {

// One attention call's shape: qkv (B,T,(H+2G)*hd), causal.
struct CudnnAttentionShape {
  DType dtype = DType::BF16;
  int64_t B = 0, T = 0, H = 0, G = 0, hd = 0;
  auto key() const { return std::make_tuple(static_cast<int>(dtype), B, T, H, G, hd); }
};

// True when this build links cuDNN (TESSERA_HAVE_CUDNN); cudnn_version() is then the loaded
// library's version as "9.19.0" (the library the process loaded, not the headers').
bool cudnn_built_in();
std::string cudnn_version();

class CudnnAttention {
 public:
  // The handle is created on `stream`'s device at the first plan.
  explicit CudnnAttention(cudaStream_t stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Empty when cuDNN runs this shape forward and backward (both plans built); otherwise why not,
  // as one line ("cuDNN 9.19.0 found no engine for ...", "head dim 80 is not a multiple of 8").
  // `deterministic` picks the backward without atomics (--deterministic-mode).
  std::string refusal(const CudnnAttentionShape& s, bool deterministic);

  // out (B,T,H*hd), lse (B,H,T) f32 natural-log softmax statistics of the scaled scores.
  void forward(void* out, float* lse, const void* qkv, const CudnnAttentionShape& s, Workspace& ws);
  // dqkv (qkv's layout) overwritten.
  void backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                const CudnnAttentionShape& s, bool deterministic, Workspace& ws);

  struct Plan;  // a built (or refused) execution plan

 private:
  Plan& plan(const CudnnAttentionShape& s, bool backward, bool deterministic);
  cudaStream_t stream_;
  void* handle_ = nullptr;  // cudnnHandle_t
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool>,
           std::unique_ptr<Plan>>
      plans_;
};

}  // namespace tessera::cuda_ops
