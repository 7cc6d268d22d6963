// How op results are judged: one tolerance table by the dtype a value was computed in,
// and one relative-error measure with a floor, shared by the op table and the GPU suites.
//
//   computed in  forward  backward   why
//   f64          1e-12    1e-10      the CPU reference against its naive twin: summation
//                                    order only (~1e-16 per term)
//   f32          1e-5     1e-4       a row sum, then a few products; backward: row dots
//                                    that cancel (g - x * coef) and long column sums
//   bf16         1e-2     1e-2       one bf16 rounding of the output (8 significant bits:
//                                    2^-8 = 3.9e-3 relative) over fp32 arithmetic
//
// Error of element i: |got - want| / max(|want|, floor_i), floor_i = kFloorFraction times
// the output's scale (its largest |want|, or the larger terms an op reports: op_case.h's
// Magnitude), so rounding near zero crossings and in cancelling differences does not count
// as relative error while a wrong element (off by O(scale)) fails by orders of magnitude.
// NaN or Inf, in the result or the reference, never passes.
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::op_test {

struct Tolerance {
  double forward;
  double backward;
};

// The row of the table for values computed in `dtype` (f64, f32 or bf16).
Tolerance tolerance_of(DType dtype);

inline constexpr double kFloorFraction = 1e-2;

struct Comparison {
  double worst = 0;     // the largest relative error; +inf when a value is not finite
  int64_t at = -1;      // where (flat index), -1 when every element is exact
  double got = 0, want = 0;
  bool sizes_match = true;
  bool want_finite = true;  // false: the reference itself is NaN/Inf at `at`

  bool within(double tolerance) const { return sizes_match && worst <= tolerance; }
  std::string str() const;
};

// Compares got against want. floors (empty: none) gives each element's floor; else the
// floor is floor_fraction * max(scale, max |want|).
Comparison compare(const std::vector<double>& got, const std::vector<double>& want, double scale = 0,
                   const std::vector<double>& floors = {}, double floor_fraction = kFloorFraction);

// Exact: the same values (NaN never equals anything); worst is 0 or +inf.
Comparison compare_exact(const std::vector<double>& got, const std::vector<double>& want);

}  // namespace kiln::op_test
