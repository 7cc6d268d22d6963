#include "core/dtype.h"

#include <cmath>

namespace kiln {

float f16_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  return sign ? -value : value;
}

uint16_t float_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to Inf
  if (abs < 0x38800000u) {  // subnormal or zero: round |f| * 2^24 to an integer
    const float scaled = std::ldexp(std::fabs(f), 24);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  // Normal: rebias the exponent and round the mantissa to nearest even.
  uint32_t rebased = abs - ((127u - 15u) << 23);
  rebased += 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rebased >> 13));
}

}  // namespace kiln
