#include "op_table/op_run.h"

#include "core/device_memory.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"

#include <cstring>

namespace kiln::op_test {

namespace {

// Poisoned elements on each side of every tensor (8 keeps a 16-byte alignment for every
// dtype), checked after each run: a kernel that writes out of bounds fails.
constexpr int64_t kGuard = 8;
constexpr unsigned char kPoison = 0xFF;  // NaN in every float type, -1 in i32

// A stable seed from a name (FNV-1a): a case's values do not depend on its place in the table.
uint64_t seed_of(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (const char ch : s) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return h;
}

double round_to(DType dtype, double v) {
  switch (dtype) {
    case DType::f32: return static_cast<float>(v);
    case DType::bf16: return bf16_to_float(float_to_bf16(static_cast<float>(v)));
    default: return v;
  }
}

std::vector<unsigned char> encode(DType dtype, const std::vector<double>& values) {
  std::vector<unsigned char> out(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    unsigned char* p = out.data() + i * dtype_size(dtype);
    switch (dtype) {
      case DType::f64: std::memcpy(p, &values[i], 8); break;
      case DType::f32: {
        const float f = static_cast<float>(values[i]);
        std::memcpy(p, &f, 4);
        break;
      }
      case DType::bf16: {
        const uint16_t h = float_to_bf16(static_cast<float>(values[i]));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::i32: {
        const auto v = static_cast<int32_t>(values[i]);
        std::memcpy(p, &v, 4);
        break;
      }
      default: fail("op_test", "no host encoding for {}", dtype_name(dtype));
    }
  }
  return out;
}

std::vector<double> decode(DType dtype, const unsigned char* bytes, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const unsigned char* p = bytes + i * static_cast<int64_t>(dtype_size(dtype));
    switch (dtype) {
      case DType::f64: std::memcpy(&out[static_cast<size_t>(i)], p, 8); break;
      case DType::f32: {
        float f;
        std::memcpy(&f, p, 4);
        out[static_cast<size_t>(i)] = f;
        break;
      }
      case DType::bf16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        out[static_cast<size_t>(i)] = bf16_to_float(h);
        break;
      }
      case DType::i32: {
        int32_t v;
        std::memcpy(&v, p, 4);
        out[static_cast<size_t>(i)] = v;
        break;
      }
      default: fail("op_test", "no host decoding for {}", dtype_name(dtype));
    }
  }
  return out;
}

bool holds_values(const TensorSpec& s) {
  return s.width != Width::i32 &&
         (s.role == Role::input || s.role == Role::grad_output ||
          ((s.role == Role::output || s.role == Role::grad_input) && s.init == Init::random));
}

}  // namespace

DType dtype_in_run(const TensorSpec& spec, DType precision) {
  switch (spec.width) {
    case Width::i32: return DType::i32;
    case Width::f64: return DType::f64;
    case Width::wide: return precision == DType::f64 ? DType::f64 : DType::f32;
    case Width::narrow: return precision;
  }
  return precision;
}

Values make_values(const OpCase& c, DType precision) {
  Values values;
  for (const TensorSpec& s : c.tensors) {
    if (!holds_values(s)) continue;
    std::vector<double>& v = values[s.name];
    v.resize(static_cast<size_t>(s.shape.numel()));
    if (s.fill) {
      s.fill(v.data(), s.shape.numel());
    } else {
      Rng rng(seed_of(c.id() + "/" + s.name));
      for (double& x : v) x = s.offset + s.scale * rng.normal();
    }
    // Every run of the comparison must read these exact numbers.
    const DType narrowest = dtype_in_run(s, precision == DType::f64 ? DType::f32 : precision);
    for (double& x : v) x = round_to(narrowest, x);
  }
  return values;
}

Run::Run(const OpCase& c, DType precision, Device device, const Values& values)
    : case_(c), precision_(precision), device_(device), values_(values) {
  tensors_.precision = precision;
  tensors_.device = device;
  for (const TensorSpec& s : c.tensors) {
    const DType dtype = dtype_in_run(s, precision);
    const Device where = s.host ? Device::cpu : device;
    Buffer b;
    b.lead = kGuard + (c.unaligned ? 1 : 0);
    b.total = b.lead + s.shape.numel() + kGuard;
    const size_t bytes = static_cast<size_t>(b.total) * dtype_size(dtype);
    b.storage = Storage(where, bytes);
    const std::vector<unsigned char> poison(bytes, kPoison);
    device_copy(b.storage.data(), where, poison.data(), Device::cpu, bytes);
    b.view = Tensor(static_cast<unsigned char*>(b.storage.data()) + b.lead * static_cast<int64_t>(dtype_size(dtype)),
                    dtype, where, s.shape);
    tensors_.bind(s.name, b.view, s.width == Width::i32 ? &s.ints : nullptr);
    buffers_.emplace(s.name, std::move(b));
    if (s.width == Width::i32) {
      KILN_CHECK(static_cast<int64_t>(s.ints.size()) == s.shape.numel(), "op_test", "{}: '{}' has {} ints for {}",
                 c.id(), s.name, s.ints.size(), s.shape.str());
      upload(s.name, std::vector<double>(s.ints.begin(), s.ints.end()));
    } else if (s.role == Role::input || s.role == Role::grad_output) {
      upload(s.name, values.at(s.name));
    }
  }
}

void Run::upload(const std::string& name, const std::vector<double>& values) {
  const Tensor& t = buffers_.at(name).view;
  const std::vector<unsigned char> bytes = encode(t.dtype(), values);
  device_copy(t.raw(), t.device(), bytes.data(), Device::cpu, bytes.size());
}

void Run::reset(const TensorSpec& s) {
  const Tensor& t = buffers_.at(s.name).view;
  switch (s.init) {
    case Init::poison: {
      const std::vector<unsigned char> poison(t.nbytes(), kPoison);
      device_copy(t.raw(), t.device(), poison.data(), Device::cpu, poison.size());
      return;
    }
    case Init::random: upload(s.name, values_.at(s.name)); return;
    case Init::copy: copy_tensor(tensors_[s.from], t); return;  // the input as it is now (perturbed by (b))
  }
}

void Run::forward() {
  for (const TensorSpec& s : case_.tensors)
    if ((s.role == Role::output && !s.in_backward) || s.role == Role::scratch) reset(s);
  case_.forward(tensors_);
}

void Run::reference() {
  KILN_CHECK(precision_ == DType::f64 && device_ == Device::cpu, "op_test", "the naive reference runs in f64 on the CPU");
  for (const TensorSpec& s : case_.tensors)
    if ((s.role == Role::output && !s.in_backward) || s.role == Role::scratch) reset(s);
  case_.reference(tensors_);
}

void Run::backward() {
  for (const TensorSpec& s : case_.tensors)
    if (s.role == Role::grad_input || (s.role == Role::output && s.in_backward) || s.role == Role::scratch) reset(s);
  case_.backward(tensors_);
}

std::vector<unsigned char> Run::bytes(const std::string& name) const {
  const Tensor& t = buffers_.at(name).view;
  std::vector<unsigned char> out(t.nbytes());
  device_copy(out.data(), Device::cpu, t.raw(), t.device(), out.size());
  return out;
}

std::vector<double> Run::read(const std::string& name) const {
  const Tensor& t = buffers_.at(name).view;
  const std::vector<unsigned char> raw = bytes(name);
  return decode(t.dtype(), raw.data(), t.numel());
}

Tensors Run::host_copies(std::vector<OwnedTensor>& keep) const {
  Tensors host;
  host.precision = precision_;
  host.device = device_;
  for (const TensorSpec& s : case_.tensors) {
    const bool ints = s.width == Width::i32;
    OwnedTensor t(ints ? DType::i32 : DType::f64, Device::cpu, s.shape);
    const std::vector<double> v = read(s.name);
    for (int64_t i = 0; i < t->numel(); ++i) {
      if (ints) t->data<int32_t>()[i] = static_cast<int32_t>(v[static_cast<size_t>(i)]);
      else t->data<double>()[i] = v[static_cast<size_t>(i)];
    }
    host.bind(s.name, *t, ints ? &s.ints : nullptr);
    keep.push_back(std::move(t));
    if (s.init != Init::random) continue;
    // What the op accumulated onto, as "<name>.start".
    const std::vector<double>& start = values_.at(s.name);
    OwnedTensor prefill(DType::f64, Device::cpu, s.shape);
    std::copy(start.begin(), start.end(), prefill->data<double>());
    host.bind(s.name + ".start", *prefill);
    keep.push_back(std::move(prefill));
  }
  return host;
}

std::vector<std::string> Run::written_guards() const {
  std::vector<std::string> written;
  for (const auto& [name, b] : buffers_) {
    const size_t size = dtype_size(b.view.dtype());
    std::vector<unsigned char> all(static_cast<size_t>(b.total) * size);
    device_copy(all.data(), Device::cpu, b.storage.data(), b.storage.device(), all.size());
    const size_t view_begin = static_cast<size_t>(b.lead) * size, view_end = view_begin + b.view.nbytes();
    for (size_t i = 0; i < all.size(); ++i)
      if ((i < view_begin || i >= view_end) && all[i] != kPoison) {
        written.push_back(name + (i < view_begin ? " (before its start)" : " (past its end)"));
        break;
      }
  }
  return written;
}

}  // namespace kiln::op_test
