// safetensors: the tensor file format of Hugging Face checkpoints.
//
// Layout: 8-byte little-endian header length N, N bytes of JSON header, then the data.
//   {"name": {"dtype": "F32", "shape": [4, 16], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// Offsets are relative to the start of the data; the data must be covered exactly
// (no holes, no overlaps, nothing after the last tensor).
//
// Reading maps the file read-only and validates the whole header before anything is
// returned, so a bad file fails at open() with "[safetensors] FILE: what is wrong".
// Writing copies each tensor at add() and writes the file at write() through a
// temporary file and a rename, so a crash never leaves a half-written checkpoint.
#pragma once

#include "core/tensor.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kiln::io {

// "F32" <-> DType::f32, ... (F32, F64, BF16, F16, I32, I64). Unknown names throw.
std::string_view safetensors_dtype_name(DType dtype);
DType safetensors_dtype_from_name(std::string_view name, std::string_view where);

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;  // any rank; rank 0 is a scalar
  size_t begin = 0;            // byte offsets into the data section
  size_t end = 0;

  int64_t numel() const;
  size_t nbytes() const { return end - begin; }
  std::string shape_str() const;  // "[3, 4]"
  // As a kiln Shape; throws if the rank exceeds Shape::kMaxDims.
  Shape kiln_shape() const;
};

class SafetensorsFile {
 public:
  // Maps and validates the file; throws kiln::Error on any problem.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws "[safetensors] FILE: missing tensor 'x'".
  const TensorInfo& info(const std::string& name) const;
  // The raw little-endian bytes of a tensor inside the mapping (not necessarily aligned);
  // valid while this object (or a copy of it) lives.
  const void* data(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Throws "[safetensors] FILE: missing metadata key 'k'".
  const std::string& metadata(const std::string& key) const;

 private:
  struct Mapping;
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;  // shared so copies are cheap
  const uint8_t* data_start_ = nullptr;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Copies tensor `name` into dst (host or device), converting between floating types
// (F32/F64/BF16/F16 -> f32/f64/bf16/f16) or between integer types (I32/I64 -> i32/i64,
// range-checked). The shapes must match exactly:
//   "[safetensors] FILE: tensor 'x' has shape [3, 4], expected [4, 3]".
void read_into(const SafetensorsFile& file, const std::string& name, const Tensor& dst);
// A new host tensor of the stored shape, converted to `dtype` as read_into does.
OwnedTensor read_tensor(const SafetensorsFile& file, const std::string& name, DType dtype);

class SafetensorsWriter {
 public:
  // Copies the tensor now (host or device memory). Names must be unique.
  void add(const std::string& name, const Tensor& tensor);
  // Raw little-endian bytes of any rank (nbytes must equal numel * dtype size).
  void add_raw(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes);
  void set_metadata(const std::string& key, const std::string& value);
  size_t size() const { return entries_.size(); }

  // Header keys sorted by name (as the Python library writes them), padded with spaces
  // to a multiple of 8 bytes; data ordered by element size (largest first), then name,
  // so every tensor stays aligned to its element size. Writes PATH.tmp, then renames.
  void write(const std::string& path) const;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kiln::io
