#include "io/weight_check.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cmath>
#include <vector>

namespace kiln::io {

namespace {

struct Scan {
  int64_t non_finite = 0;
  bool all_zero = true;
};

template <typename T>
Scan scan(const T* x, int64_t n) {
  Scan s;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) ++s.non_finite;
    if (x[i] != 0) s.all_zero = false;
  }
  return s;
}

Scan scan_tensor(const Tensor& value) {
  OwnedTensor host(value.dtype(), Device::cpu, value.shape());  // the weights may be on the GPU
  copy_tensor(value, *host);
  if (value.dtype() == DType::f64) return scan(host->data<double>(), value.numel());
  if (value.dtype() == DType::bf16) {  // bf16 masters (optim.master_weights)
    std::vector<float> wide(static_cast<size_t>(value.numel()));
    const auto* bits = static_cast<const uint16_t*>(host->raw());
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = bf16_to_float(bits[i]);
    return scan(wide.data(), value.numel());
  }
  KILN_CHECK(value.dtype() == DType::f32, "load", "weights of dtype {} cannot be checked", dtype_name(value.dtype()));
  return scan(host->data<float>(), value.numel());
}

}  // namespace

void check_weights_usable(const Model& model, const std::string& source) {
  std::vector<std::string> zero_matrices;
  int64_t matrices = 0;
  for (const auto& p : model.parameters()) {
    const Tensor value = p->value();
    const Scan s = scan_tensor(value);
    KILN_CHECK(s.non_finite == 0, "load",
               "{}: tensor '{}' holds {} non-finite values (NaN/Inf) of {}: the weights are broken (a diverged run or "
               "a damaged file)",
               source, p->name(), s.non_finite, value.numel());
    if (value.rank() < 2) continue;
    ++matrices;
    if (s.all_zero) zero_matrices.push_back(p->name());
  }
  KILN_CHECK(matrices == 0 || static_cast<int64_t>(zero_matrices.size()) < matrices, "load",
             "{}: every weight matrix is zero: there is no trained model in it (a file of zeros, or never trained)",
             source);
  for (const std::string& name : zero_matrices)
    warn("load", fmt::format("{}: weight matrix '{}' is all zeros", source, name));
}

}  // namespace kiln::io
