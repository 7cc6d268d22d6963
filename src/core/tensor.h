// Tensor: a typed, shaped, non-owning view of contiguous memory on one device.
//
// Memory is owned by arenas (core/arena.h) planned when a model is built; a Tensor is
// only a pointer plus metadata, so it is cheap to copy, reshape and slice. Tensors are
// always contiguous and row-major: activations are token-major, [tokens, features].
#pragma once

#include "core/dtype.h"
#include "core/error.h"

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace kiln {

class Shape {
 public:
  static constexpr int kMaxDims = 4;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i)]; }
  int64_t numel() const;
  bool operator==(const Shape& other) const;
  std::string str() const;  // "[4, 16]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, DType dtype, Device device, Shape shape)
      : data_(data), dtype_(dtype), device_(device), shape_(shape) {}

  bool defined() const { return data_ != nullptr; }
  void* raw() const { return data_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t size(int dim) const { return shape_[dim < 0 ? dim + rank() : dim]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  // Typed access; throws if T does not match the dtype (bf16/f16 use raw()).
  template <typename T>
  T* data() const {
    if (dtype_of<T>() != dtype_) fail("tensor", "accessed {} as {}", describe(), dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }
  // data<T>() of a tensor that may be absent (an optional weight, bias or state): null then.
  template <typename T>
  T* data_or_null() const {
    return defined() ? data<T>() : nullptr;
  }

  // Same memory, new shape (same element count).
  Tensor view(Shape shape) const;
  // Rows [begin, end) of dimension 0.
  Tensor rows(int64_t begin, int64_t end) const;

  // Plan-time binding: arenas set the shape first and the pointer once memory exists.
  void bind(void* data) { data_ = data; }
  void set_meta(DType dtype, Device device, Shape shape) {
    dtype_ = dtype;
    device_ = device;
    shape_ = shape;
  }

  std::string describe() const;  // "f32[4, 16]@cpu"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu;
  Shape shape_;
};

// Owning, aligned allocation on a device (used by arenas and tests, never in the step loop).
class Storage {
 public:
  Storage() = default;
  Storage(Device device, size_t bytes);
  ~Storage();
  Storage(Storage&& other) noexcept;
  Storage& operator=(Storage&& other) noexcept;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::cpu;
};

// A tensor together with the storage it owns; for tests, tools and small host buffers.
struct OwnedTensor {
  Storage storage;
  Tensor tensor;
  OwnedTensor() = default;
  OwnedTensor(DType dtype, Device device, Shape shape);
  const Tensor& operator*() const { return tensor; }
  const Tensor* operator->() const { return &tensor; }
};

// Copies between tensors of equal dtype and size on any devices.
void copy_tensor(const Tensor& src, const Tensor& dst);
// Fills with zeros (any device).
void zero_tensor(const Tensor& t);

}  // namespace kiln
