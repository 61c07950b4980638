// Tensor: a typed, shaped, contiguous view into reference-counted storage on a device.
// Views (slices along the first dimension, reshapes) share storage and cost nothing.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/core/dtype.h"

namespace loom {

// Where a tensor lives. Only the CPU exists today; a CUDA backend adds a kind, not a rewrite.
enum class DeviceKind : uint8_t { CPU };
struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;
};

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  int rank() const { return static_cast<int>(dims_.size()); }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i < 0 ? i + rank() : i)]; }
  int64_t numel() const;
  const std::vector<int64_t>& dims() const { return dims_; }
  bool operator==(const Shape& o) const { return dims_ == o.dims_; }
  std::string str() const;  // "[2, 3, 4]"

 private:
  std::vector<int64_t> dims_;
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised tensor accounted under `category`.
  static Tensor empty(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category);
  static Tensor zeros(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category);
  // Non-owning view of memory that outlives the tensor (mmap'd files, arenas owned elsewhere).
  static Tensor wrap(void* data, const Shape& shape, DType dtype);

  // False for a default-constructed tensor (which has rank 0, i.e. one element, but no storage).
  bool defined() const { return storage_ != nullptr || data_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }
  void* raw() const { return data_; }

  // Same storage, new shape with the same number of elements.
  Tensor reshape(const Shape& shape) const;
  // Rows [begin, end) of the first dimension.
  Tensor slice(int64_t begin, int64_t end) const;
  // A flat window of `shape.numel()` elements starting at element `offset`.
  Tensor view(int64_t offset, const Shape& shape) const;

  void fill_zero() const;
  // Copies contents (same dtype and numel) from `src`.
  void copy_from(const Tensor& src) const;

 private:
  std::shared_ptr<Buffer> storage_;  // null for wrapped memory
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_{};
};

}  // namespace loom
