#include "io/gguf_writer.h"

#include "core/dtype.h"
#include "core/error.h"
#include "io/quant_q8_0.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace kiln::io {

namespace {

enum GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9,
  kU64 = 10, kI64 = 11, kF64 = 12,
};

constexpr uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

class Out {
 public:
  template <typename T>
  void pod(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  std::vector<uint8_t> bytes;
};

void write_value(Out& o, const GgufValue& v) {
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, uint32_t>) o.pod<uint32_t>(kU32), o.pod(x);
        else if constexpr (std::is_same_v<T, int32_t>) o.pod<uint32_t>(kI32), o.pod(x);
        else if constexpr (std::is_same_v<T, uint64_t>) o.pod<uint32_t>(kU64), o.pod(x);
        else if constexpr (std::is_same_v<T, float>) o.pod<uint32_t>(kF32), o.pod(x);
        else if constexpr (std::is_same_v<T, bool>) o.pod<uint32_t>(kBool), o.pod<uint8_t>(x ? 1 : 0);
        else if constexpr (std::is_same_v<T, std::string>) o.pod<uint32_t>(kString), o.str(x);
        else {
          o.pod<uint32_t>(kArray);
          using E = typename T::value_type;
          o.pod<uint32_t>(std::is_same_v<E, std::string> ? kString
                          : std::is_same_v<E, int32_t>   ? kI32
                          : std::is_same_v<E, bool>      ? kBool
                                                         : kF32);
          o.pod<uint64_t>(x.size());
          for (const auto& e : x) {
            if constexpr (std::is_same_v<E, std::string>) o.str(e);
            else if constexpr (std::is_same_v<E, bool>) o.pod<uint8_t>(e ? 1 : 0);  // one byte each, as gguf's bool
            else o.pod(e);
          }
        }
      },
      v);
}

// Bounds-checked reads from the file image.
class In {
 public:
  In(const std::vector<uint8_t>& b, const std::string& path) : b_(b), path_(path) {}
  template <typename T>
  T pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str() {
    const auto n = pod<uint64_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  size_t pos() const { return pos_; }

 private:
  void need(uint64_t n) const {
    KILN_CHECK(n <= b_.size() - pos_, "gguf", "{}: truncated at byte {}", path_, pos_);
  }
  const std::vector<uint8_t>& b_;
  const std::string& path_;
  size_t pos_ = 0;
};

GgufValue read_scalar(In& in, uint32_t type, const std::string& where) {
  switch (type) {
    case kU8: return uint32_t(in.pod<uint8_t>());
    case kI8: return int32_t(in.pod<int8_t>());
    case kU16: return uint32_t(in.pod<uint16_t>());
    case kI16: return int32_t(in.pod<int16_t>());
    case kU32: return in.pod<uint32_t>();
    case kI32: return in.pod<int32_t>();
    case kF32: return in.pod<float>();
    case kBool: return in.pod<uint8_t>() != 0;
    case kString: return in.str();
    case kU64: return in.pod<uint64_t>();
    case kI64: return static_cast<uint64_t>(in.pod<int64_t>());
    case kF64: return static_cast<float>(in.pod<double>());
    default: fail("gguf", "{}: unknown value type {}", where, type);
  }
}

}  // namespace

const char* ggml_type_name(GgmlType type) {
  switch (type) {
    case GgmlType::f32: return "F32";
    case GgmlType::f16: return "F16";
    case GgmlType::q8_0: return "Q8_0";
    case GgmlType::bf16: return "BF16";
  }
  return "?";
}

size_t ggml_row_bytes(GgmlType type, int64_t count) {
  switch (type) {
    case GgmlType::f32: return static_cast<size_t>(count) * 4;
    case GgmlType::f16:
    case GgmlType::bf16: return static_cast<size_t>(count) * 2;
    case GgmlType::q8_0:
      KILN_CHECK(count % kQ8_0Block == 0, "gguf", "Q8_0 rows need a multiple of {} values, got {}", kQ8_0Block, count);
      return static_cast<size_t>(count / kQ8_0Block) * kQ8_0BlockBytes;
  }
  fail("gguf", "unknown ggml type {}", static_cast<uint32_t>(type));
}

void GgufWriter::set(const std::string& key, GgufValue value) {
  for (const auto& [k, v] : metadata_) KILN_CHECK(k != key, "gguf", "metadata key '{}' set twice", key);
  metadata_.emplace_back(key, std::move(value));
}

void GgufWriter::add_tensor(const std::string& name, GgmlType type, std::vector<int64_t> shape,
                            std::vector<uint8_t> data) {
  KILN_CHECK(!shape.empty() && shape.size() <= 4, "gguf", "tensor '{}': rank {} (1 to 4 supported)", name,
             shape.size());
  KILN_CHECK(name.size() < 64, "gguf", "tensor name '{}' is longer than ggml's 63 characters", name);
  for (const Tensor& t : tensors_) KILN_CHECK(t.name != name, "gguf", "tensor '{}' added twice", name);
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  KILN_CHECK(data.size() == static_cast<size_t>(rows) * ggml_row_bytes(type, shape.back()), "gguf",
             "tensor '{}': {} bytes do not match its shape and type {}", name, data.size(), ggml_type_name(type));
  tensors_.push_back({name, type, std::move(shape), std::move(data)});
}

void GgufWriter::write(const std::string& path) const {
  Out o;
  o.bytes.insert(o.bytes.end(), {'G', 'G', 'U', 'F'});
  o.pod<uint32_t>(3);
  o.pod<uint64_t>(tensors_.size());
  o.pod<uint64_t>(metadata_.size());
  for (const auto& [key, value] : metadata_) {
    o.str(key);
    write_value(o, value);
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    o.str(t.name);
    o.pod<uint32_t>(static_cast<uint32_t>(t.shape.size()));
    for (size_t i = t.shape.size(); i-- > 0;) o.pod<uint64_t>(static_cast<uint64_t>(t.shape[i]));  // ne[0] innermost
    o.pod<uint32_t>(static_cast<uint32_t>(t.type));
    o.pod<uint64_t>(offset);
    offset = align_up(offset + t.data.size(), kAlignment);
  }
  o.bytes.resize(align_up(o.bytes.size(), kAlignment), 0);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    KILN_CHECK(out.good(), "gguf", "cannot write '{}'", tmp);
    out.write(reinterpret_cast<const char*>(o.bytes.data()), static_cast<std::streamsize>(o.bytes.size()));
    const std::vector<char> zeros(kAlignment, 0);
    for (const Tensor& t : tensors_) {
      out.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size()));
      out.write(zeros.data(), static_cast<std::streamsize>(align_up(t.data.size(), kAlignment) - t.data.size()));
    }
    out.close();  // flushes: a full disk shows here, not in a destructor that cannot report it
    if (out.fail()) {
      const int err = errno;
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      fail("gguf", "{}: write failed: {}", tmp, std::strerror(err));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;  // not ec: the message must stay the rename's ("Success" otherwise)
    std::filesystem::remove(tmp, ignored);
    fail("gguf", "{}: cannot rename {} into place: {}", path, tmp, ec.message());
  }
}

GgufFile GgufFile::open(const std::string& path) {
  GgufFile f;
  f.path_ = path;
  std::ifstream file(path, std::ios::binary);
  KILN_CHECK(file.good(), "gguf", "cannot open '{}'", path);
  f.bytes_ = std::make_shared<std::vector<uint8_t>>((std::istreambuf_iterator<char>(file)),
                                                    std::istreambuf_iterator<char>());
  const std::vector<uint8_t>& b = *f.bytes_;
  In in(b, path);
  KILN_CHECK(b.size() >= 4 && std::memcmp(b.data(), "GGUF", 4) == 0, "gguf", "{}: not a GGUF file", path);
  in.pod<uint32_t>();
  const auto version = in.pod<uint32_t>();
  KILN_CHECK(version == 3, "gguf", "{}: version {} (3 expected)", path, version);
  const auto n_tensors = in.pod<uint64_t>(), n_kv = in.pod<uint64_t>();
  KILN_CHECK(n_tensors < (1u << 20) && n_kv < (1u << 20), "gguf", "{}: implausible counts", path);
  uint64_t alignment = GgufWriter::kAlignment;
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = in.str();
    const auto type = in.pod<uint32_t>();
    if (type == kArray) {
      const auto et = in.pod<uint32_t>();
      const auto n = in.pod<uint64_t>();
      KILN_CHECK(n <= b.size(), "gguf", "{}: array '{}' too long", path, key);
      if (et == kString) {
        std::vector<std::string> v;
        for (uint64_t j = 0; j < n; ++j) v.push_back(in.str());
        f.metadata_.emplace_back(key, std::move(v));
      } else if (et == kI32) {
        std::vector<int32_t> v;
        for (uint64_t j = 0; j < n; ++j) v.push_back(in.pod<int32_t>());
        f.metadata_.emplace_back(key, std::move(v));
      } else if (et == kF32) {
        std::vector<float> v;
        for (uint64_t j = 0; j < n; ++j) v.push_back(in.pod<float>());
        f.metadata_.emplace_back(key, std::move(v));
      } else if (et == kBool) {
        std::vector<bool> v;
        for (uint64_t j = 0; j < n; ++j) v.push_back(in.pod<uint8_t>() != 0);
        f.metadata_.emplace_back(key, std::move(v));
      } else {
        fail("gguf", "{}: array '{}' of element type {} is not supported here", path, key, et);
      }
    } else {
      f.metadata_.emplace_back(key, read_scalar(in, type, path));
    }
    if (key == "general.alignment") alignment = std::get<uint32_t>(f.metadata_.back().second);
  }
  std::vector<uint64_t> offsets;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    t.name = in.str();
    const auto dims = in.pod<uint32_t>();
    KILN_CHECK(dims >= 1 && dims <= 4, "gguf", "{}: tensor '{}' has {} dims", path, t.name, dims);
    t.shape.resize(dims);
    for (uint32_t d = 0; d < dims; ++d) t.shape[dims - 1 - d] = static_cast<int64_t>(in.pod<uint64_t>());
    t.type = static_cast<GgmlType>(in.pod<uint32_t>());
    offsets.push_back(in.pod<uint64_t>());
    int64_t rows = 1;
    for (uint32_t d = 0; d + 1 < dims; ++d) rows *= t.shape[d];
    t.bytes = static_cast<size_t>(rows) * ggml_row_bytes(t.type, t.shape.back());
    f.tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = align_up(in.pos(), alignment);
  for (size_t i = 0; i < f.tensors_.size(); ++i) {
    TensorInfo& t = f.tensors_[i];
    KILN_CHECK(offsets[i] % alignment == 0 && data_start + offsets[i] + t.bytes <= b.size(), "gguf",
               "{}: tensor '{}' lies outside the file or is misaligned", path, t.name);
    t.data = b.data() + data_start + offsets[i];
  }
  return f;
}

bool GgufFile::contains(const std::string& key) const {
  for (const auto& [k, v] : metadata_)
    if (k == key) return true;
  return false;
}

const GgufValue& GgufFile::get(const std::string& key) const {
  for (const auto& [k, v] : metadata_)
    if (k == key) return v;
  fail("gguf", "{}: no metadata key '{}'", path_, key);
}

const GgufFile::TensorInfo& GgufFile::tensor(const std::string& name) const {
  for (const TensorInfo& t : tensors_)
    if (t.name == name) return t;
  fail("gguf", "{}: no tensor '{}'", path_, name);
}

std::vector<float> GgufFile::read_f32(const std::string& name) const {
  const TensorInfo& t = tensor(name);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  switch (t.type) {
    case GgmlType::f32: std::memcpy(out.data(), t.data, t.bytes); break;
    case GgmlType::q8_0: dequantize_q8_0(t.data, n, out.data()); break;
    case GgmlType::f16:
    case GgmlType::bf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        out[static_cast<size_t>(i)] = t.type == GgmlType::f16 ? f16_to_float(h) : bf16_to_float(h);
      }
      break;
  }
  return out;
}

}  // namespace kiln::io
