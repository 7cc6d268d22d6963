#include "io/safetensors.h"

#include "core/device_memory.h"
#include "core/printable.h"
#include "core/small_file.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace kiln::io {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace {

constexpr std::string_view kWhere = "safetensors";
// The Python/Rust library refuses headers above 100 MB; so do we (a corrupt length
// field must not make us parse gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string dims_str(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return s + "]";
}

bool is_float(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }
bool is_int(DType t) { return t == DType::i32 || t == DType::i64; }

double load_float(const uint8_t* p, DType t) {
  switch (t) {
    case DType::f32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::f64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::bf16: { uint16_t v; std::memcpy(&v, p, 2); return bf16_to_float(v); }
    case DType::f16: { uint16_t v; std::memcpy(&v, p, 2); return f16_to_float(v); }
    default: return 0.0;
  }
}

void store_float(uint8_t* p, DType t, double value) {
  switch (t) {
    case DType::f32: { float v = static_cast<float>(value); std::memcpy(p, &v, 4); break; }
    case DType::f64: std::memcpy(p, &value, 8); break;
    case DType::bf16: { uint16_t v = float_to_bf16(static_cast<float>(value)); std::memcpy(p, &v, 2); break; }
    case DType::f16: { uint16_t v = float_to_f16(static_cast<float>(value)); std::memcpy(p, &v, 2); break; }
    default: break;
  }
}

int64_t load_int(const uint8_t* p, DType t) {
  if (t == DType::i32) { int32_t v; std::memcpy(&v, p, 4); return v; }
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

// ---------------------------------------------------------------- dtypes and info

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
  }
  fail(kWhere, "unknown dtype {}", static_cast<int>(dtype));
}

DType safetensors_dtype_from_name(std::string_view name, std::string_view where) {
  if (name == "F32") return DType::f32;
  if (name == "F64") return DType::f64;
  if (name == "BF16") return DType::bf16;
  if (name == "F16") return DType::f16;
  if (name == "I32") return DType::i32;
  if (name == "I64") return DType::i64;
  if (name == "U8") return DType::u8;
  fail(kWhere, "{}: unsupported dtype '{}' (supported: F32, F64, BF16, F16, I32, I64, U8)", where, printable(name));
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const { return dims_str(shape); }

Shape TensorInfo::kiln_shape() const {
  switch (shape.size()) {
    case 0: return Shape{};
    case 1: return Shape{shape[0]};
    case 2: return Shape{shape[0], shape[1]};
    case 3: return Shape{shape[0], shape[1], shape[2]};
    case 4: return Shape{shape[0], shape[1], shape[2], shape[3]};
    default: fail(kWhere, "tensor '{}' has rank {} (at most {} supported)", name, shape.size(), Shape::kMaxDims);
  }
}

// ---------------------------------------------------------------- reading

struct SafetensorsFile::Mapping {
  void* base = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (base) munmap(base, size);
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;

  // A FIFO named model.safetensors hung `kiln import hf` in open(); only a regular file
  // can be mapped.
  const int fd = open_regular_file(path, "safetensors file", kWhere);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(kWhere, "{}: cannot stat: {}", path, std::strerror(err));
  }
  const auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail(kWhere, "{}: truncated header (file is {} bytes, the length field needs 8)", path, file_size);
  }
  auto mapping = std::make_shared<Mapping>();
  void* base = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (base == MAP_FAILED) fail(kWhere, "{}: mmap failed: {}", path, std::strerror(map_err));
  mapping->base = base;
  mapping->size = file_size;
  file.mapping_ = mapping;
  const auto* bytes = static_cast<const uint8_t*>(base);

  uint64_t header_len;
  std::memcpy(&header_len, bytes, 8);
  if (header_len > file_size - 8)
    fail(kWhere, "{}: truncated header (header length {} but only {} bytes follow)", path, header_len, file_size - 8);
  if (header_len > kMaxHeaderBytes) fail(kWhere, "{}: header length {} exceeds {}", path, header_len, kMaxHeaderBytes);
  if (header_len < 2 || bytes[8] != '{') fail(kWhere, "{}: bad header JSON: does not start with '{{'", path);

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    fail(kWhere, "{}: bad header JSON: {}", path, e.what());
  }
  if (!header.is_object()) fail(kWhere, "{}: bad header JSON: not an object", path);

  file.data_start_ = bytes + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  for (const auto& [key, value] : header.items()) {
    const std::string shown = printable(key);  // a name from the file may hold a newline
    if (key == "__metadata__") {
      if (!value.is_object()) fail(kWhere, "{}: __metadata__ is not an object", path);
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) fail(kWhere, "{}: __metadata__ value for '{}' is not a string", path, printable(mk));
        file.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    if (!value.is_object()) fail(kWhere, "{}: tensor '{}' entry is not an object", path, shown);
    TensorInfo info;
    info.name = key;

    const auto dtype_it = value.find("dtype");
    if (dtype_it == value.end() || !dtype_it->is_string())
      fail(kWhere, "{}: tensor '{}' has no dtype string", path, shown);
    info.dtype = safetensors_dtype_from_name(dtype_it->get<std::string>(), fmt::format("{}: tensor '{}'", path, shown));

    const auto shape_it = value.find("shape");
    if (shape_it == value.end() || !shape_it->is_array()) fail(kWhere, "{}: tensor '{}' has no shape array", path, shown);
    // Every running product in int64, in the order TensorInfo::numel() and Shape multiply:
    // [2^62, 2, 0] holds no bytes, yet its first two dimensions overflow an int64.
    int64_t numel = 1;
    for (const auto& d : *shape_it) {
      // Named by position, never dumped: dump() recurses, and a hostile header nests
      // arrays deeper than the stack.
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        fail(kWhere, "{}: tensor '{}' has a bad shape: dimension {} is not a non-negative integer", path, shown,
             info.shape.size());
      const auto dim = d.get<int64_t>();
      info.shape.push_back(dim);
      if (__builtin_mul_overflow(numel, dim, &numel))
        fail(kWhere, "{}: tensor '{}' shape {} overflows at dimension {}", path, shown, dims_str(info.shape),
             info.shape.size() - 1);
    }
    uint64_t expected_bytes;
    if (__builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(dtype_size(info.dtype)), &expected_bytes))
      fail(kWhere, "{}: tensor '{}' shape {} overflows", path, shown, dims_str(info.shape));

    const auto off_it = value.find("data_offsets");
    if (off_it == value.end() || !off_it->is_array() || off_it->size() != 2 || !(*off_it)[0].is_number_unsigned() ||
        !(*off_it)[1].is_number_unsigned())
      fail(kWhere, "{}: tensor '{}' needs data_offsets [begin, end] of non-negative integers", path, shown);
    const auto begin = (*off_it)[0].get<uint64_t>();
    const auto end = (*off_it)[1].get<uint64_t>();
    if (begin > end || end > data_size)
      fail(kWhere, "{}: tensor '{}' data_offsets [{}, {}] out of range (data section is {} bytes)", path, shown, begin,
           end, data_size);
    if (end - begin != expected_bytes)
      fail(kWhere, "{}: tensor '{}' data_offsets [{}, {}] hold {} bytes but {} {} needs {}", path, shown, begin, end,
           end - begin, safetensors_dtype_name(info.dtype), info.shape_str(), expected_bytes);
    info.begin = static_cast<size_t>(begin);
    info.end = static_cast<size_t>(end);
    file.tensors_.emplace(key, std::move(info));
  }

  // The data must be covered exactly once: sorted by offset, each tensor starts where the
  // previous one ended, and the last one ends at the end of the file.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& [name, info] : file.tensors_) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  size_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* info : by_offset) {
    if (info->begin < covered)
      fail(kWhere, "{}: tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", path, printable(info->name),
           info->begin, info->end, printable(previous->name), previous->begin, previous->end);
    if (info->begin > covered)
      fail(kWhere, "{}: tensor '{}' data_offsets [{}, {}] leave a gap of {} bytes before it", path, printable(info->name),
           info->begin, info->end, info->begin - covered);
    covered = info->end;
    previous = info;
  }
  if (covered != data_size)
    fail(kWhere, "{}: data section is {} bytes but the tensors cover {}", path, data_size, covered);
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) out.push_back(name);
  return out;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(kWhere, "{}: missing tensor '{}'", path_, name);
  return it->second;
}

const void* SafetensorsFile::data(const std::string& name) const { return data_start_ + info(name).begin; }

const std::string& SafetensorsFile::metadata(const std::string& key) const {
  const auto it = metadata_.find(key);
  if (it == metadata_.end()) fail(kWhere, "{}: missing metadata key '{}'", path_, key);
  return it->second;
}

void read_into(const SafetensorsFile& file, const std::string& name, const Tensor& dst) {
  const TensorInfo& info = file.info(name);
  KILN_CHECK(dst.defined(), kWhere, "{}: destination for tensor '{}' is not allocated", file.path(), name);
  std::vector<int64_t> expected(static_cast<size_t>(dst.rank()));
  for (int i = 0; i < dst.rank(); ++i) expected[static_cast<size_t>(i)] = dst.size(i);
  if (info.shape != expected)
    fail(kWhere, "{}: tensor '{}' has shape {}, expected {}", file.path(), name, info.shape_str(), dims_str(expected));

  const DType src_t = info.dtype, dst_t = dst.dtype();
  const bool convertible = src_t == dst_t || (is_float(src_t) && is_float(dst_t)) || (is_int(src_t) && is_int(dst_t));
  if (!convertible)
    fail(kWhere, "{}: tensor '{}' is {} and cannot be read into a {} tensor", file.path(), name,
         safetensors_dtype_name(src_t), dtype_name(dst_t));

  const auto* src = static_cast<const uint8_t*>(file.data(name));
  const int64_t n = info.numel();
  if (src_t == dst_t) {
    device_copy(dst.raw(), dst.device(), src, Device::cpu, info.nbytes());
    return;
  }
  // Convert on the host (into dst directly, or into a staging buffer for a device).
  std::vector<uint8_t> staging;
  uint8_t* out = static_cast<uint8_t*>(dst.raw());
  if (dst.device() != Device::cpu) {
    staging.resize(dst.nbytes());
    out = staging.data();
  }
  const size_t ss = dtype_size(src_t), ds = dtype_size(dst_t);
  if (src_t == DType::bf16 && dst_t == DType::f32) {  // the common checkpoint case
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + static_cast<size_t>(i) * 2, 2);
      const float f = bf16_to_float(h);
      std::memcpy(out + static_cast<size_t>(i) * 4, &f, 4);
    }
  } else if (is_float(src_t)) {
    for (int64_t i = 0; i < n; ++i)
      store_float(out + static_cast<size_t>(i) * ds, dst_t, load_float(src + static_cast<size_t>(i) * ss, src_t));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = load_int(src + static_cast<size_t>(i) * ss, src_t);
      if (dst_t == DType::i32) {
        if (v < INT32_MIN || v > INT32_MAX)
          fail(kWhere, "{}: tensor '{}' element {} = {} does not fit in i32", file.path(), name, i, v);
        const auto w = static_cast<int32_t>(v);
        std::memcpy(out + static_cast<size_t>(i) * 4, &w, 4);
      } else {
        std::memcpy(out + static_cast<size_t>(i) * 8, &v, 8);
      }
    }
  }
  if (!staging.empty()) device_copy(dst.raw(), dst.device(), staging.data(), Device::cpu, staging.size());
}

OwnedTensor read_tensor(const SafetensorsFile& file, const std::string& name, DType dtype) {
  OwnedTensor t(dtype, Device::cpu, file.info(name).kiln_shape());
  read_into(file, name, *t);
  return t;
}

// ---------------------------------------------------------------- writing

void SafetensorsWriter::add(const std::string& name, const Tensor& tensor) {
  KILN_CHECK(tensor.defined() || tensor.numel() == 0, kWhere, "tensor '{}' is not allocated", name);
  std::vector<int64_t> shape(static_cast<size_t>(tensor.rank()));
  for (int i = 0; i < tensor.rank(); ++i) shape[static_cast<size_t>(i)] = tensor.size(i);
  std::vector<uint8_t> bytes(tensor.nbytes());
  if (!bytes.empty()) device_copy(bytes.data(), Device::cpu, tensor.raw(), tensor.device(), bytes.size());
  add_raw(name, tensor.dtype(), std::move(shape), bytes.data(), bytes.size());
}

void SafetensorsWriter::add_raw(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
                                size_t nbytes) {
  KILN_CHECK(!name.empty() && name != "__metadata__", kWhere, "bad tensor name '{}'", name);
  KILN_CHECK(!entries_.count(name), kWhere, "tensor '{}' added twice", name);
  int64_t numel = 1;
  for (int64_t d : shape) {
    KILN_CHECK(d >= 0, kWhere, "tensor '{}' has a negative dimension in {}", name, dims_str(shape));
    numel *= d;
  }
  KILN_CHECK(static_cast<size_t>(numel) * dtype_size(dtype) == nbytes, kWhere,
             "tensor '{}': {} bytes given for {} {}", name, nbytes, dtype_name(dtype), dims_str(shape));
  Entry entry{dtype, std::move(shape), {}};
  if (nbytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    entry.bytes.assign(p, p + nbytes);
  }
  entries_.emplace(name, std::move(entry));
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

void SafetensorsWriter::write(const std::string& path) const {
  // Data order: larger elements first, then by name, so every tensor stays aligned.
  std::vector<std::pair<const std::string*, const Entry*>> order;
  for (const auto& [name, entry] : entries_) order.emplace_back(&name, &entry);
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return dtype_size(a.second->dtype) > dtype_size(b.second->dtype);
  });

  nlohmann::json header = nlohmann::json::object();  // std::map: keys come out sorted
  size_t offset = 0;
  for (const auto& [name, entry] : order) {
    header[*name] = {{"dtype", safetensors_dtype_name(entry->dtype)},
                     {"shape", entry->shape},
                     {"data_offsets", {offset, offset + entry->bytes.size()}}};
    offset += entry->bytes.size();
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  const std::string tmp = path + ".tmp";
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  FILE* out = std::fopen(tmp.c_str(), "wb");
  if (!out) fail(kWhere, "{}: cannot create: {}", tmp, std::strerror(errno));
  bool ok = std::fwrite(&header_len, 8, 1, out) == 1 && std::fwrite(text.data(), 1, text.size(), out) == text.size();
  for (const auto& [name, entry] : order) {
    if (!ok) break;
    const auto& b = entry->bytes;
    ok = b.empty() || std::fwrite(b.data(), 1, b.size(), out) == b.size();
  }
  ok = std::fflush(out) == 0 && ok;
  ok = fsync(fileno(out)) == 0 && ok;
  const int err = errno;
  ok = std::fclose(out) == 0 && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    fail(kWhere, "{}: write failed: {}", tmp, std::strerror(err));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    fail(kWhere, "{}: cannot rename {} into place: {}", path, tmp, ec.message());
  }
}

}  // namespace kiln::io
