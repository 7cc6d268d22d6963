#include "core/tensor.h"

#include "core/device_memory.h"

#include <fmt/format.h>

#include <cstring>
#include <utility>

namespace kiln {

Shape::Shape(std::initializer_list<int64_t> dims) {
  KILN_CHECK(dims.size() <= kMaxDims, "tensor", "rank {} exceeds {}", dims.size(), kMaxDims);
  for (int64_t d : dims) {
    KILN_CHECK(d >= 0, "tensor", "negative dimension {}", d);
    dims_[static_cast<size_t>(rank_++)] = d;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[static_cast<size_t>(i)] != other.dims_[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) s += fmt::format("{}{}", i ? ", " : "", dims_[static_cast<size_t>(i)]);
  return s + "]";
}

Tensor Tensor::view(Shape shape) const {
  KILN_CHECK(shape.numel() == numel(), "tensor", "cannot view {} as {}", shape_.str(), shape.str());
  return Tensor(data_, dtype_, device_, shape);
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  KILN_CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= size(0), "tensor",
             "rows [{}, {}) out of range for {}", begin, end, shape_.str());
  const int64_t row_elems = size(0) == 0 ? 0 : numel() / size(0);
  Shape s;
  switch (rank()) {
    case 1: s = Shape{end - begin}; break;
    case 2: s = Shape{end - begin, shape_[1]}; break;
    case 3: s = Shape{end - begin, shape_[1], shape_[2]}; break;
    default: s = Shape{end - begin, shape_[1], shape_[2], shape_[3]}; break;
  }
  char* base = static_cast<char*>(data_) + static_cast<size_t>(begin * row_elems) * dtype_size(dtype_);
  return Tensor(base, dtype_, device_, s);
}

std::string Tensor::describe() const {
  return fmt::format("{}{}@{}", dtype_name(dtype_), shape_.str(), device_name(device_));
}

Storage::Storage(Device device, size_t bytes) : bytes_(bytes), device_(device) {
  data_ = device_alloc(device, bytes);
}

Storage::~Storage() { release(); }

Storage::Storage(Storage&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)), device_(other.device_) {}

Storage& Storage::operator=(Storage&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

void Storage::release() {
  if (data_) device_free(device_, data_);
  data_ = nullptr;
  bytes_ = 0;
}

OwnedTensor::OwnedTensor(DType dtype, Device device, Shape shape)
    : storage(device, static_cast<size_t>(shape.numel()) * dtype_size(dtype)),
      tensor(storage.data(), dtype, device, shape) {
  zero_tensor(tensor);
}

void copy_tensor(const Tensor& src, const Tensor& dst) {
  KILN_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(), "copy",
             "cannot copy {} into {}", src.describe(), dst.describe());
  device_copy(dst.raw(), dst.device(), src.raw(), src.device(), src.nbytes());
}

void zero_tensor(const Tensor& t) {
  if (t.nbytes() > 0) device_memset_zero(t.raw(), t.device(), t.nbytes());
}

}  // namespace kiln
