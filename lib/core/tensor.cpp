// tensor.cpp: storage, views and the host allocator.
#include "core/tensor.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

namespace tessera {

namespace {
thread_local std::string g_alloc_label;
}

AllocationLabel::AllocationLabel(std::string what) : previous_(std::move(g_alloc_label)) {
  g_alloc_label = std::move(what);
}
AllocationLabel::~AllocationLabel() {
  g_alloc_label = std::move(previous_);
}
const std::string& AllocationLabel::current() {
  return g_alloc_label;
}

const char* device_name(Device d) {
  return d == Device::CPU ? "cpu" : "cuda";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    TESSERA_CHECK(d >= 0, "negative dimension in shape ", shape_str(s));
    n *= d;
  }
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

namespace {
std::atomic<size_t> g_host_live{0}, g_host_peak{0};

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p)
      throw Error("out of host memory allocating " + std::to_string(bytes) +
                  " bytes; reduce --micro-batch-size or the model size");
    const size_t now = g_host_live += bytes;
    size_t peak = g_host_peak.load();
    while (now > peak && !g_host_peak.compare_exchange_weak(peak, now)) {
    }
    return p;
  }
  void deallocate(void* p, size_t bytes) override {
    std::free(p);
    g_host_live -= bytes;
  }
  Device device() const override { return Device::CPU; }
};
}  // namespace

size_t host_allocated_bytes() {
  return g_host_live.load();
}
size_t host_peak_allocated_bytes() {
  return g_host_peak.load();
}
void reset_host_peak_allocated_bytes() {
  g_host_peak = g_host_live.load();
}

Allocator& cpu_allocator() {
  static CpuAllocator alloc;
  return alloc;
}

Storage::Storage(Allocator& alloc, size_t bytes) : alloc_(alloc), bytes_(bytes) {
  ptr_ = alloc_.allocate(bytes);
}
Storage::Storage(Allocator& alloc, size_t bytes, Unbound)
    : alloc_(alloc), bytes_(bytes), owned_(false) {}
Storage::~Storage() {
  if (owned_) alloc_.deallocate(ptr_, bytes_);
}
void Storage::bind(void* p) {
  TESSERA_CHECK(!owned_, "bind() on storage that owns its memory");
  ptr_ = p;
}

Tensor::Tensor(Shape shape, DType dtype, Allocator& alloc)
    : shape_(std::move(shape)), dtype_(dtype) {
  numel_ = shape_numel(shape_);
  storage_ = std::make_shared<Storage>(alloc, static_cast<size_t>(numel_) * dtype_size(dtype));
}

Tensor Tensor::unbound(Shape shape, DType dtype, Allocator& alloc) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.numel_ = shape_numel(t.shape_);
  t.storage_ = std::make_shared<Storage>(alloc, static_cast<size_t>(t.numel_) * dtype_size(dtype),
                                         Storage::Unbound{});
  return t;
}

void Tensor::bind_storage(const Tensor& memory) const {
  TESSERA_CHECK(storage_ && !storage_->owned(), "bind_storage on a tensor that owns its memory");
  TESSERA_CHECK(
      memory.defined() && memory.nbytes() >= storage_->bytes() && memory.device() == device(),
      "bind_storage: ", memory.nbytes(), " bytes on ", device_name(memory.device()), " for ",
      storage_->bytes(), " on ", device_name(device()));
  storage_->bind(memory.raw());
}

void Tensor::unbind_storage() const {
  TESSERA_CHECK(storage_ && !storage_->owned(), "unbind_storage on a tensor that owns its memory");
  storage_->unbind();
}

void Tensor::unbound_error() {
  throw Error(
      "a tensor was read while it had no memory: an FSDP unit's parameters or gradients were "
      "used outside the passes that gather them (step/fsdp.hpp)");
}

Tensor Tensor::zeros(Shape shape, DType dtype, Allocator& alloc) {
  Tensor t(std::move(shape), dtype, alloc);
  t.zero_();
  return t;
}

int64_t Tensor::dim(int i) const {
  TESSERA_CHECK(i >= 0 && i < ndim(), "axis ", i, " out of range for shape ", shape_str(shape_));
  return shape_[i];
}

float* Tensor::f32() const {
  TESSERA_CHECK(dtype_ == DType::F32, "expected an f32 tensor, got ", dtype_name(dtype_));
  return data<float>();
}

int32_t* Tensor::i32() const {
  TESSERA_CHECK(dtype_ == DType::I32, "expected an i32 tensor, got ", dtype_name(dtype_));
  return data<int32_t>();
}

Tensor Tensor::view(int64_t elem_offset, Shape shape) const {
  TESSERA_CHECK(defined(), "view of an undefined tensor");
  const int64_t n = shape_numel(shape);
  TESSERA_CHECK(elem_offset >= 0 && elem_offset + n <= numel_, "view ", shape_str(shape), " at ",
                elem_offset, " exceeds tensor ", shape_str(shape_));
  Tensor t = *this;
  t.offset_bytes_ = offset_bytes_ + static_cast<size_t>(elem_offset) * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  t.numel_ = n;
  return t;
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  TESSERA_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "slice [", begin,
                ", ", end, ") of ", shape_str(shape_));
  Shape s = shape_;
  s[0] = end - begin;
  return view(begin * (numel_ / (shape_[0] ? shape_[0] : 1)), s);
}

void Tensor::zero_() {
  TESSERA_CHECK(device() == Device::CPU, "zero_ on a device tensor");
  std::memset(raw(), 0, nbytes());
}

void Tensor::fill_(float v) {
  float* p = f32();
  TESSERA_CHECK(device() == Device::CPU, "fill_ on a device tensor");
  for (int64_t i = 0; i < numel_; ++i) p[i] = v;
}

void Tensor::copy_from(const Tensor& src) {
  TESSERA_CHECK(device() == Device::CPU && src.device() == Device::CPU,
                "copy_from needs host tensors");
  TESSERA_CHECK(src.dtype() == dtype_ && src.numel() == numel_, "copy_from ",
                shape_str(src.shape()), " ", dtype_name(src.dtype()), " into ", shape_str(shape_),
                " ", dtype_name(dtype_));
  std::memcpy(raw(), src.raw(), nbytes());
}

size_t resident_set_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long long pages = 0, resident = 0;
  const int got = std::fscanf(f, "%llu %llu", &pages, &resident);
  std::fclose(f);
  return got == 2 ? static_cast<size_t>(resident) * static_cast<size_t>(sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace tessera
