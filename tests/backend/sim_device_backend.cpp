// sim_device_backend.cpp: see sim_device_backend.hpp.
#include "backend/sim_device_backend.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>

namespace tessera::simdev {

namespace {

// Every live allocation, and how many openers want them readable now.
struct Registry {
  std::mutex mu;
  std::map<void*, size_t> regions;  // start -> mapped bytes
  int open = 0;
};
Registry& registry() {
  static Registry r;
  return r;
}

size_t page_round(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

void protect_all(int prot) {
  for (auto& [p, n] : registry().regions) mprotect(p, n, prot);
}

void open_regions() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.open++ == 0) protect_all(PROT_READ | PROT_WRITE);
}
void close_regions() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (--r.open == 0) protect_all(PROT_NONE);
}

struct Open {
  Open() { open_regions(); }
  ~Open() { close_regions(); }
};

class SimAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    const size_t n = page_round(bytes ? bytes : 1);
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TESSERA_CHECK(p != MAP_FAILED, "sim device: mmap of ", n, " bytes failed");
    std::memset(p, 0xff, n);  // poison: NaN in f32, like fresh device memory is garbage
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.regions[p] = n;
    if (r.open == 0) mprotect(p, n, PROT_NONE);
    return p;
  }
  void deallocate(void* p, size_t) override {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.regions.find(p);
    if (it == r.regions.end()) return;
    munmap(p, it->second);
    r.regions.erase(it);
  }
  // The wrapped CPU kernels check for host tensors; the guard, not the label, keeps the host out.
  Device device() const override { return Device::CPU; }
};

class SimDeviceBackend final : public Backend {
 public:
  SimDeviceBackend() : cpu_(make_cpu_backend()) {}
  Device device() const override { return Device::CUDA; }
  const char* name() const override { return "sim-device"; }
  Allocator& allocator() override { return alloc_; }
  void copy_from_host(Tensor& dst, const void* src) override {
    Open open;
    std::memcpy(dst.raw(), src, dst.nbytes());
  }
  void copy_to_host(void* dst, const Tensor& src) override {
    Open open;
    std::memcpy(dst, src.raw(), src.nbytes());
  }
  void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                         int64_t row_begin) override {
    Open open;
    cpu_->embedding_forward(out, ids, table, row_begin);
  }
  void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                          int64_t row_begin) override {
    Open open;
    cpu_->embedding_backward(dtable, dout, ids, row_begin);
  }
  void position_embedding_forward(Tensor& out, const Tensor& wpe) override {
    Open open;
    cpu_->position_embedding_forward(out, wpe);
  }
  void position_embedding_backward(Tensor& dwpe, const Tensor& dout) override {
    Open open;
    cpu_->position_embedding_backward(dwpe, dout);
  }
  void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                         const Tensor& weight, const Tensor& bias, double eps) override {
    Open open;
    cpu_->layernorm_forward(out, mean, rstd, inp, weight, bias, eps);
  }
  void layernorm_backward(Tensor& dinp, Tensor& dweight, Tensor& dbias, const Tensor& dout,
                          const Tensor& inp, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd) override {
    Open open;
    cpu_->layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd);
  }
  void matmul_forward(Tensor& out, const Tensor& inp, const Tensor& weight,
                      const Tensor* bias) override {
    Open open;
    cpu_->matmul_forward(out, inp, weight, bias);
  }
  void matmul_backward(Tensor* dinp, Tensor& dweight, Tensor* dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight) override {
    Open open;
    cpu_->matmul_backward(dinp, dweight, dbias, dout, inp, weight);
  }
  void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, int64_t heads,
                         const AttentionDropout* drop, int64_t kv_heads,
                         const AttentionAlibi* alibi, const AttentionDocuments* docs) override {
    Open open;
    cpu_->attention_forward(out, lse, qkv, heads, drop, kv_heads, alibi, docs);
  }
  void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int64_t heads, const AttentionDropout* drop,
                          int64_t kv_heads, const AttentionAlibi* alibi,
                          const AttentionDocuments* docs) override {
    Open open;
    cpu_->attention_backward(dqkv, dout, qkv, out, lse, heads, drop, kv_heads, alibi, docs);
  }
  void ring_block_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv,
                          const RingBlock& blk) override {
    Open open;
    cpu_->ring_block_forward(out, lse, qkv, kv, blk);
  }
  void ring_block_backward(Tensor& dqkv, Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                           const Tensor& kv, const Tensor& out, const Tensor& lse,
                           const RingBlock& blk) override {
    Open open;
    cpu_->ring_block_backward(dqkv, dkv, dout, qkv, kv, out, lse, blk);
  }
  void attention_merge(Tensor& out, Tensor& lse, const Tensor& part_out, const Tensor& part_lse,
                       int64_t q0) override {
    Open open;
    cpu_->attention_merge(out, lse, part_out, part_lse, q0);
  }
  void copy_columns(Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                    int64_t cols) override {
    Open open;
    cpu_->copy_columns(dst, dst_col, src, src_col, cols);
  }
  void kv_attention(Tensor& out, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                    const std::vector<KvSegment>& segments, int64_t heads, int64_t kv_heads,
                    const AttentionAlibi* alibi) override {
    Open open;
    cpu_->kv_attention(out, qkv, k_cache, v_cache, segments, heads, kv_heads, alibi);
  }
  void rope(Tensor& qkv, const RopeSpec& spec, const Tensor* positions, bool inverse) override {
    Open open;
    cpu_->rope(qkv, spec, positions, inverse);
  }
  void swiglu_forward(Tensor& out, const Tensor& inp) override {
    Open open;
    cpu_->swiglu_forward(out, inp);
  }
  void swiglu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    Open open;
    cpu_->swiglu_backward(dinp, inp, dout);
  }
  void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       double eps) override {
    Open open;
    cpu_->rmsnorm_forward(out, rstd, inp, weight, eps);
  }
  void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& rstd) override {
    Open open;
    cpu_->rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd);
  }
  void gelu_forward(Tensor& out, const Tensor& inp) override {
    Open open;
    cpu_->gelu_forward(out, inp);
  }
  void gelu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    Open open;
    cpu_->gelu_backward(dinp, inp, dout);
  }
  void squared_relu_forward(Tensor& out, const Tensor& inp) override {
    Open open;
    cpu_->squared_relu_forward(out, inp);
  }
  void squared_relu_backward(Tensor& dinp, const Tensor& inp, const Tensor& dout) override {
    Open open;
    cpu_->squared_relu_backward(dinp, inp, dout);
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override {
    Open open;
    cpu_->add(out, a, b);
  }
  void dropout(Tensor& out, const Tensor& in, const DropoutSpec& d, int64_t row_begin,
               int64_t seq_len) override {
    Open open;
    cpu_->dropout(out, in, d, row_begin, seq_len);
  }
  void xent_row_max(Tensor& rowmax, const Tensor& logits, int64_t valid_cols) override {
    Open open;
    cpu_->xent_row_max(rowmax, logits, valid_cols);
  }
  void xent_row_sums(Tensor& sumexp, Tensor& target_logit, const Tensor& logits,
                     const Tensor& rowmax, const Tensor& targets, int64_t valid_cols,
                     int64_t col_begin) override {
    Open open;
    cpu_->xent_row_sums(sumexp, target_logit, logits, rowmax, targets, valid_cols, col_begin);
  }
  void xent_loss_and_grad(Tensor& losses, Tensor& logits, const Tensor& rowmax,
                          const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets,
                          int64_t valid_cols, int64_t col_begin, float grad_scale) override {
    Open open;
    cpu_->xent_loss_and_grad(losses, logits, rowmax, sumexp, target_logit, targets, valid_cols,
                             col_begin, grad_scale);
  }
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                  double weight_decay, int64_t step) override {
    Open open;
    cpu_->adamw_step(param, grad, m, v, h, weight_decay, step);
  }
  double sum_squares(const Tensor& x) override {
    Open open;
    return cpu_->sum_squares(x);
  }
  double sum_squares_all(const std::vector<Tensor>& xs) override {
    Open open;
    return cpu_->sum_squares_all(xs);
  }
  void scale(Tensor& x, float s) override {
    Open open;
    cpu_->scale(x, s);
  }
  void gemm(Tensor& c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha,
            float beta) override {
    Open open;
    cpu_->gemm(c, a, ta, b, tb, alpha, beta);
  }
  void zero(Tensor& t) override {
    Open open;
    cpu_->zero(t);
  }
  void adamw_step_flat(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                       const std::vector<AdamWSegment>& segments, const AdamWHyper& h, int64_t step,
                       Tensor* compute) override {
    Open open;
    cpu_->adamw_step_flat(params, grads, m, v, segments, h, step, compute);
  }
  void add_layernorm_forward(Tensor& sum, Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& a,
                             const Tensor& b, const Tensor& weight, const Tensor& bias,
                             double eps) override {
    Open open;
    cpu_->add_layernorm_forward(sum, out, mean, rstd, a, b, weight, bias, eps);
  }
  void cast(Tensor& dst, const Tensor& src) override {
    Open open;
    cpu_->cast(dst, src);
  }

 private:
  std::unique_ptr<Backend> cpu_;
  SimAllocator alloc_;
};

}  // namespace

std::unique_ptr<Backend> make_sim_device_backend() {
  return std::make_unique<SimDeviceBackend>();
}

SimDeviceUnlock::SimDeviceUnlock() {
  open_regions();
}
SimDeviceUnlock::~SimDeviceUnlock() {
  close_regions();
}

}  // namespace tessera::simdev
