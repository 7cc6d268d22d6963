// GGUF v3, the file format of llama.cpp / ggml: a writer and a reader.
//
// Layout (little-endian): "GGUF", u32 version 3, u64 tensor count, u64 metadata count;
// metadata as (string key, u32 type, value); tensor infos as (string name, u32 n_dims,
// u64 ne[n_dims] innermost first, u32 ggml type, u64 offset); zero padding to the
// alignment (32, general.alignment); then the tensor data, each tensor at an aligned
// offset. Strings are u64 length + bytes. A PyTorch [out, in] matrix is ne = {in, out}.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace kiln::io {

enum class GgmlType : uint32_t { f32 = 0, f16 = 1, q8_0 = 8, bf16 = 30 };
const char* ggml_type_name(GgmlType type);
// Bytes of `count` elements of a row (count % block size == 0 for quantized types).
size_t ggml_row_bytes(GgmlType type, int64_t count);

// A metadata value: scalars, a string, or an array of one of those.
using GgufValue = std::variant<uint32_t, int32_t, uint64_t, float, bool, std::string, std::vector<std::string>,
                               std::vector<int32_t>, std::vector<float>, std::vector<bool>>;

class GgufWriter {
 public:
  static constexpr uint32_t kAlignment = 32;

  // Keys are written in insertion order; a repeated key throws.
  void set(const std::string& key, GgufValue value);
  // shape: PyTorch order (outermost first); data: ggml_row_bytes(type, shape.back()) per row.
  void add_tensor(const std::string& name, GgmlType type, std::vector<int64_t> shape, std::vector<uint8_t> data);
  // Writes PATH.tmp then renames.
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
  };
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::vector<Tensor> tensors_;
};

// Reads a whole GGUF v3 file into memory and validates its structure (offsets, sizes,
// types): enough for kiln's tests and for reading back what kiln exported.
class GgufFile {
 public:
  struct TensorInfo {
    std::string name;
    GgmlType type;
    std::vector<int64_t> shape;  // PyTorch order (outermost first)
    const uint8_t* data = nullptr;
    size_t bytes = 0;
  };
  static GgufFile open(const std::string& path);

  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  const GgufValue& get(const std::string& key) const;  // throws naming the key
  bool contains(const std::string& key) const;
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo& tensor(const std::string& name) const;
  // The tensor as f32 (dequantized / widened).
  std::vector<float> read_f32(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<std::vector<uint8_t>> bytes_;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::vector<TensorInfo> tensors_;
};

}  // namespace kiln::io
