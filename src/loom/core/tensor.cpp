#include "loom/core/tensor.h"

#include <cstring>

#include "loom/error.h"

namespace loom {

int64_t Shape::numel() const {
  int64_t n = 1;
  for (auto d : dims_) n *= d;
  return n;
}

std::string Shape::str() const {
  std::string s = "[";
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[i]);
  }
  return s + "]";
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category) {
  for (auto d : shape.dims())
    if (d < 0) throw ShapeError("negative dimension in shape " + shape.str());
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Buffer>(alloc, t.nbytes(), category);
  t.data_ = t.storage_->data();
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Allocator& alloc, MemCategory category) {
  Tensor t = empty(shape, dtype, alloc, category);
  t.fill_zero();
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype) {
  Tensor t;
  t.data_ = data;
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (shape.numel() != numel())
    throw ShapeError("cannot reshape " + shape_.str() + " to " + shape.str() + ": element counts differ");
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  if (shape_.rank() == 0 || begin < 0 || end < begin || end > shape_[0])
    throw ShapeError("slice [" + std::to_string(begin) + ", " + std::to_string(end) + ") out of range for " +
                     shape_.str());
  std::vector<int64_t> dims = shape_.dims();
  int64_t row = numel() / (dims[0] == 0 ? 1 : dims[0]);
  dims[0] = end - begin;
  return view(begin * row, Shape(dims));
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  if (offset < 0 || offset + shape.numel() > numel())
    throw ShapeError("view of " + shape.str() + " at element " + std::to_string(offset) + " exceeds tensor " +
                     shape_.str());
  Tensor t = *this;
  t.shape_ = shape;
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(offset) * dtype_size(dtype_);
  return t;
}

void Tensor::fill_zero() const {
  if (nbytes()) std::memset(data_, 0, nbytes());
}

void Tensor::copy_from(const Tensor& src) const {
  if (src.dtype() != dtype_ || src.numel() != numel())
    throw ShapeError("copy_from: " + std::string(dtype_name(src.dtype())) + src.shape().str() + " into " +
                     std::string(dtype_name(dtype_)) + shape_.str());
  if (nbytes()) std::memcpy(data_, src.raw(), nbytes());
}

}  // namespace loom
