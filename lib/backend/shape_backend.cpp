// shape_backend.cpp: the backend of shapes only (backend/shape_backend.hpp).
#include "backend/shape_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tessera {

namespace {

// Distinct addresses, never mapped: a tensor compares by address (views, aliasing checks) but
// reading one faults. Past the top of the user half of a 47-bit address space's first half.
class ShapeAllocator final : public Allocator {
 public:
  explicit ShapeAllocator(Device d) : device_(d) {}
  void* allocate(size_t bytes) override {
    const uintptr_t p = next_;
    next_ += (bytes + 255) / 256 * 256 + 256;
    return reinterpret_cast<void*>(p);
  }
  void deallocate(void*, size_t) override {}
  Device device() const override { return device_; }

 private:
  Device device_;
  uintptr_t next_ = uintptr_t(1) << 46;
};

// `total` items spread over `n` bins as evenly as integers allow (the first bins one more).
int64_t share(int64_t total, int64_t n, int64_t i) {
  return total / n + (i < total % n ? 1 : 0);
}

class ShapeBackend final : public Backend {
 public:
  explicit ShapeBackend(Device d) : device_(d), alloc_(d) {}
  Device device() const override { return device_; }
  const char* name() const override { return "shape"; }
  bool computes() const override { return false; }
  Allocator& allocator() override { return alloc_; }
  void zero(Tensor&) override {}
  void copy_from_host(Tensor&, const void*) override {}
  // The host buffer keeps what it holds (the caller's zeros or last values).
  void copy_to_host(void*, const Tensor&) override {}
  void cast(Tensor&, const Tensor&) override {}
  void embedding_forward(Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void embedding_backward(Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void position_embedding_forward(Tensor&, const Tensor&) override {}
  void position_embedding_backward(Tensor&, const Tensor&) override {}
  void layernorm_forward(Tensor&, Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         double) override {}
  void add_layernorm_forward(Tensor&, Tensor&, Tensor&, Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, double) override {}
  void layernorm_backward(Tensor&, Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&) override {}
  void rmsnorm_forward(Tensor&, Tensor&, const Tensor&, const Tensor&, double) override {}
  void add_rmsnorm_forward(Tensor&, Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           double) override {}
  void rmsnorm_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&) override {}
  void matmul_forward(Tensor&, const Tensor&, const Tensor&, const Tensor*) override {}
  void matmul_backward(Tensor*, Tensor&, Tensor*, const Tensor&, const Tensor&,
                       const Tensor&) override {}
  void grouped_matmul_forward(const std::vector<GroupedGemm>&) override {}
  void grouped_matmul_backward(const std::vector<GroupedGemm>&) override {}
  void fp8_amax(Tensor&, const Tensor&, bool) override {}
  void fp8_current_scale(Tensor&, const Tensor&, Fp8Format) override {}
  void fp8_delayed_update(Tensor&, Tensor&, Tensor&, const Tensor&, bool, int) override {}
  void fp8_matmul_forward(Tensor&, const Tensor&, const Tensor&, const Tensor*, const Fp8Operand&,
                          const Fp8Operand&) override {}
  void fp8_matmul_backward(Tensor*, Tensor&, Tensor*, const Tensor&, const Tensor&, const Tensor&,
                           const Fp8Operand&, const Fp8Operand&, const Fp8Operand&) override {}
  void attention_forward(Tensor&, Tensor&, const Tensor&, int64_t, const AttentionDropout*, int64_t,
                         const AttentionAlibi*, const AttentionDocuments*) override {}
  void attention_backward(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          int64_t, const AttentionDropout*, int64_t, const AttentionAlibi*,
                          const AttentionDocuments*) override {}
  // Any attention backend is accepted: the plan of a CUDA run names the run's.
  void set_attention_backend(AttentionBackend, bool) override {}
  std::string attention_plan(const AttentionCall&) override { return "none (shapes only)"; }
  void ring_block_forward(Tensor&, Tensor&, const Tensor&, const Tensor&,
                          const RingBlock&) override {}
  void ring_block_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, const RingBlock&) override {}
  void attention_merge(Tensor&, Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void copy_columns(Tensor&, int64_t, const Tensor&, int64_t, int64_t) override {}
  void copy_column_blocks(Tensor&, int64_t, int64_t, const Tensor&, int64_t, int64_t, int64_t,
                          int64_t) override {}
  void kv_attention(Tensor&, const Tensor&, Tensor&, Tensor&, const std::vector<KvSegment>&,
                    int64_t, int64_t, const AttentionAlibi*) override {}
  void kv_decode(Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                 const AttentionAlibi*) override {}
  std::vector<int32_t> sample_tokens(const Tensor&, int64_t, int64_t rows, int64_t,
                                     const std::vector<TokenSampling>&) override {
    return std::vector<int32_t>(static_cast<size_t>(rows), 0);
  }
  void rope(Tensor&, const RopeSpec&, const Tensor*, bool) override {}
  void gelu_forward(Tensor&, const Tensor&) override {}
  void gelu_backward(Tensor&, const Tensor&, const Tensor&) override {}
  void matmul_gelu_forward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor*) override {
  }
  void matmul_gelu_backward(Tensor&, Tensor&, Tensor*, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&) override {}
  void squared_relu_forward(Tensor&, const Tensor&) override {}
  void squared_relu_backward(Tensor&, const Tensor&, const Tensor&) override {}
  void swiglu_forward(Tensor&, const Tensor&) override {}
  void swiglu_backward(Tensor&, const Tensor&, const Tensor&) override {}
  void add(Tensor&, const Tensor&, const Tensor&) override {}
  void dropout(Tensor&, const Tensor&, const DropoutSpec&, int64_t, int64_t) override {}
  void xent_row_max(Tensor&, const Tensor&, int64_t) override {}
  void xent_row_sums(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                     int64_t) override {}
  void xent_loss_and_grad(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, int64_t, int64_t, float) override {}
  void adamw_step(Tensor&, const Tensor&, Tensor&, Tensor&, const AdamWHyper&, double,
                  int64_t) override {}
  void adamw_step_flat(Tensor&, const Tensor&, Tensor&, Tensor&, const std::vector<AdamWSegment>&,
                       const AdamWHyper&, int64_t, Tensor*) override {}
  double sum_squares(const Tensor&) override { return 0; }
  double sum_squares_all(const std::vector<Tensor>&) override { return 0; }
  void collect_sum_squares(const Tensor&, bool) override {}
  double collected_sum_squares() override { return 0; }
  void scale(Tensor&, float) override {}
  void gemm(Tensor&, const Tensor&, bool, const Tensor&, bool, float, float) override {}
  // Balanced routing: each group's N K token copies spread evenly over the experts, each expert
  // keeping what its capacity allows.
  int64_t moe_route(Tensor&, Tensor&, Tensor&, const Tensor& logits, const MoERouting& r,
                    int64_t group_rows, std::vector<int64_t>& routed,
                    std::vector<int64_t>& kept) override {
    const int64_t E = r.experts, N = logits.numel() / E, K = r.topk;
    const int64_t G = group_rows > 0 ? N / group_rows : 1;
    routed.assign(static_cast<size_t>(G * E), 0);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t e = 0; e < E; ++e)
        routed[static_cast<size_t>(g * E + e)] = share(group_rows * K, E, e);
    kept.assign(static_cast<size_t>(E), 0);
    const int64_t cap =
        r.capacity_factor > 0
            ? static_cast<int64_t>(std::ceil(double(N) * K / double(E) * r.capacity_factor))
            : N * K;
    int64_t R = 0;
    for (int64_t e = 0; e < E; ++e) {
      kept[static_cast<size_t>(e)] = std::min(share(N * K, E, e), cap);
      R += kept[static_cast<size_t>(e)];
    }
    return R;
  }
  void moe_router_stats(const Tensor& logits, const MoERouting& r, int64_t group_rows,
                        std::vector<double>& score_sums, double& lse_sq_sum) override {
    const int64_t N = logits.numel() / r.experts;
    score_sums.assign(static_cast<size_t>((group_rows > 0 ? N / group_rows : 1) * r.experts), 0.0);
    lse_sq_sum = 0;
  }
  void moe_router_backward(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const MoERouting&, int64_t, const std::vector<double>&,
                           double) override {}
  void moe_permute(Tensor&, const Tensor&, const Tensor&) override {}
  void moe_unpermute(Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void moe_unpermute_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&) override {}
  void moe_permute_backward(Tensor&, const Tensor&, const Tensor&) override {}
  MemoryStats memory_stats() override { return MemoryStats{}; }
  double count_zeros(const Tensor&) override { return 0; }

 private:
  Device device_;
  ShapeAllocator alloc_;
};

}  // namespace

std::unique_ptr<Backend> make_shape_backend(Device device) {
  return std::make_unique<ShapeBackend>(device);
}

}  // namespace tessera
