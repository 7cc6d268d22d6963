#include "ops/optim/dynamic_map.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::ops {

namespace {

// The nonzero magnitudes of codes with `bits` bits after the sign: 2^bits - 1 of them.
std::vector<double> magnitudes(int bits) {
  std::vector<double> out;
  for (int zeros = 0; zeros < bits; ++zeros) {
    const int fraction_bits = bits - 1 - zeros;  // after the zeros and the indicator bit
    const double decade = std::pow(10.0, -zeros), bins = static_cast<double>(1 << fraction_bits);
    for (int j = 0; j < (1 << fraction_bits); ++j) out.push_back(decade * (0.1 + 0.9 * (j + 1) / bins));
  }
  return out;
}

DynamicMap sorted(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  DynamicMap map{};
  for (size_t i = 0; i < map.size(); ++i) map[i] = static_cast<float>(values.at(i));
  return map;
}

}  // namespace

const DynamicMap& signed_dynamic_map() {
  static const DynamicMap map = [] {
    std::vector<double> values = {0.0, 0.0};  // +0 and -0
    for (double m : magnitudes(7)) values.push_back(m), values.push_back(-m);
    return sorted(std::move(values));
  }();
  return map;
}

const DynamicMap& unsigned_dynamic_map() {
  static const DynamicMap map = [] {
    std::vector<double> values = magnitudes(8);
    values.push_back(0.0);
    return sorted(std::move(values));
  }();
  return map;
}

}  // namespace kiln::ops
