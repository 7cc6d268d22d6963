#include "op_table/op_compare.h"

#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace kiln::op_test {

Tolerance tolerance_of(DType dtype) {
  switch (dtype) {
    case DType::f64: return {1e-12, 1e-10};
    case DType::f32: return {1e-5, 1e-4};
    case DType::bf16: return {1e-2, 1e-2};
    default: fail("op_test", "no tolerance for {}", dtype_name(dtype));
  }
}

std::string Comparison::str() const {
  if (!sizes_match) return "sizes differ";
  if (at < 0) return "exact";
  if (!want_finite) return fmt::format("the reference is {} at [{}]", want, at);
  return fmt::format("max relative error {:.3e} at [{}] (got {:.9g}, want {:.9g}){}", worst, at, got, want,
                     std::isfinite(got) ? "" : ": not finite (unwritten, or an overflow)");
}

Comparison compare(const std::vector<double>& got, const std::vector<double>& want, double scale,
                   const std::vector<double>& floors, double floor_fraction) {
  Comparison c;
  if (got.size() != want.size() || (!floors.empty() && floors.size() != want.size())) {
    c.sizes_match = false;
    c.worst = std::numeric_limits<double>::infinity();
    return c;
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(want[i])) {
      c.worst = std::numeric_limits<double>::infinity();
      c.at = static_cast<int64_t>(i), c.got = got[i], c.want = want[i], c.want_finite = false;
      return c;
    }
    scale = std::max(scale, std::fabs(want[i]));
  }
  const double global_floor = std::max(floor_fraction * scale, 1e-300);
  for (size_t i = 0; i < want.size(); ++i) {
    const double floor = floors.empty() ? global_floor : std::max(floor_fraction * floors[i], 1e-300);
    const double err = std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), floor)
                                             : std::numeric_limits<double>::infinity();
    if (err > c.worst || (c.at < 0 && err > 0)) {
      c.worst = err, c.at = static_cast<int64_t>(i), c.got = got[i], c.want = want[i];
      if (std::isinf(err)) return c;
    }
  }
  return c;
}

Comparison compare_exact(const std::vector<double>& got, const std::vector<double>& want) {
  Comparison c;
  if (got.size() != want.size()) {
    c.sizes_match = false;
    c.worst = std::numeric_limits<double>::infinity();
    return c;
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;  // NaN never equals
    c.worst = std::numeric_limits<double>::infinity();
    c.at = static_cast<int64_t>(i), c.got = got[i], c.want = want[i], c.want_finite = std::isfinite(want[i]);
    return c;
  }
  return c;
}

}  // namespace kiln::op_test
