// tensor.hpp: a contiguous n-d array (shape, dtype, device) viewing owning storage from an
// allocator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace tessera {

enum class Device { CPU, CUDA };
const char* device_name(Device d);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

// Hands out raw memory for one device. The CPU one is 64-byte aligned host memory; the CUDA
// backend provides its own (backend/cuda/).
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  virtual Device device() const = 0;
};
Allocator& cpu_allocator();
// Bytes of tensor storage the host allocator holds now and at most since the last reset (the
// memory benchmark compares them with the --dry-run estimate).
size_t host_allocated_bytes();
size_t host_peak_allocated_bytes();
void reset_host_peak_allocated_bytes();
// The process's resident set (/proc/self/statm), 0 where it cannot be read.
size_t resident_set_bytes();

// Names what the allocations made while it lives are for ("Adam moments", "activations of one
// micro-batch"), so an out-of-memory error can say which buffer did not fit. Thread-local, nests.
class AllocationLabel {
 public:
  explicit AllocationLabel(std::string what);
  ~AllocationLabel();
  AllocationLabel(const AllocationLabel&) = delete;
  AllocationLabel& operator=(const AllocationLabel&) = delete;
  // The innermost label of this thread, or "" outside any.
  static const std::string& current();

 private:
  std::string previous_;
};

// One allocation; freed by its allocator when the last Tensor viewing it goes away.
class Storage {
 public:
  Storage(Allocator& alloc, size_t bytes);
  // Unbound storage (Tensor::unbound): no memory of its own; bind() points it at memory someone
  // else owns (FSDP's gathered units, step/fsdp.hpp), and every view made of it follows.
  struct Unbound {};
  Storage(Allocator& alloc, size_t bytes, Unbound);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return alloc_.device(); }
  bool owned() const { return owned_; }
  void bind(void* p);
  void unbind() { ptr_ = nullptr; }

 private:
  Allocator& alloc_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool owned_ = true;
};

// Contiguous row-major tensor. Copying a Tensor copies the view, not the data.
class Tensor {
 public:
  Tensor() = default;
  // Allocates uninitialized storage.
  Tensor(Shape shape, DType dtype = DType::F32, Allocator& alloc = cpu_allocator());
  static Tensor zeros(Shape shape, DType dtype = DType::F32, Allocator& alloc = cpu_allocator());
  // A tensor without memory until bind_storage (Storage::Unbound); reading it unbound is an error.
  static Tensor unbound(Shape shape, DType dtype, Allocator& alloc);
  // Points this tensor's whole storage (and so every view of it) at `memory`'s data, which must
  // be as large and on the same device; unbind_storage leaves it without memory again.
  void bind_storage(const Tensor& memory) const;
  void unbind_storage() const;
  bool storage_bound() const { return storage_ && storage_->data() != nullptr; }

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::CPU; }

  void* raw() const {
    void* base = storage_->data();
    if (!base) unbound_error();
    return static_cast<char*>(base) + offset_bytes_;
  }
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }
  float* f32() const;  // checks the dtype
  int32_t* i32() const;

  // A view of `shape` starting `elem_offset` elements into this tensor's data.
  Tensor view(int64_t elem_offset, Shape shape) const;
  Tensor reshape(Shape shape) const { return view(0, std::move(shape)); }
  // Rows [begin, end) along the first axis.
  Tensor slice0(int64_t begin, int64_t end) const;

  void zero_();         // CPU tensors only; device tensors are zeroed by their backend
  void fill_(float v);  // CPU f32 only
  void copy_from(const Tensor& src);  // CPU, same dtype and numel

 private:
  [[noreturn]] static void unbound_error();
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
};

// An optional operand of a backend op: `t`, or nullptr when it is not defined (no bias, ...).
inline const Tensor* opt(const Tensor& t) {
  return t.defined() ? &t : nullptr;
}
inline Tensor* opt(Tensor& t) {
  return t.defined() ? &t : nullptr;
}

}  // namespace tessera
