#include "ops/fp8/fp8_format.h"

#include <cmath>
#include <algorithm>
#include <limits>

namespace kiln::ops::fp8 {

namespace {

constexpr uint8_t kSignBit = 0x80;

FormatInfo make_info(int exponent_bits, int mantissa_bits, int bias, float max, uint8_t max_code, uint8_t nan) {
  return {exponent_bits, mantissa_bits, bias, max, std::ldexp(1.0f, 1 - bias),
          std::ldexp(1.0f, 1 - bias - mantissa_bits), max_code, nan};
}

}  // namespace

const FormatInfo& info(Format format) {
  // E5M2's NaN is the quiet one (mantissa 10), what CUDA's cast writes for a quiet float NaN.
  static const FormatInfo e4m3 = make_info(4, 3, 7, 448.0f, 0x7E, 0x7F);
  static const FormatInfo e5m2 = make_info(5, 2, 15, 57344.0f, 0x7B, 0x7E);
  return format == Format::e4m3 ? e4m3 : e5m2;
}

std::string_view name(Format format) { return format == Format::e4m3 ? "e4m3" : "e5m2"; }

bool is_nan(uint8_t code, Format format) {
  const uint8_t magnitude = code & 0x7F;
  return format == Format::e4m3 ? magnitude == 0x7F : magnitude > 0x7C;
}

bool is_inf(uint8_t code, Format format) {
  return format == Format::e5m2 && (code & 0x7F) == 0x7C;
}

float decode(uint8_t code, Format format) {
  const FormatInfo& f = info(format);
  const bool negative = code & kSignBit;
  if (is_nan(code, format))
    return negative ? -std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::quiet_NaN();
  if (is_inf(code, format))
    return negative ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
  const int exponent_field = (code & 0x7F) >> f.mantissa_bits;
  const int mantissa = code & ((1 << f.mantissa_bits) - 1);
  // Subnormals (exponent field 0) have no implicit 1 and the exponent of the min normal.
  const int significand = exponent_field == 0 ? mantissa : mantissa + (1 << f.mantissa_bits);
  const int exponent = (exponent_field == 0 ? 1 : exponent_field) - f.bias - f.mantissa_bits;
  const float magnitude = std::ldexp(static_cast<float>(significand), exponent);
  return negative ? -magnitude : magnitude;
}

uint8_t encode(float x, Format format, Overflow overflow) {
  const FormatInfo& f = info(format);
  const uint8_t sign = std::signbit(x) ? kSignBit : 0;
  if (std::isnan(x)) return f.nan | sign;
  const uint8_t overflowed = overflow == Overflow::saturate ? f.max_code
                             : format == Format::e4m3         ? f.nan
                                                              : uint8_t{0x7C};
  if (std::isinf(x)) return overflowed | sign;

  // Round |x| to significand * 2^(exponent - mantissa_bits) on the format's grid extended to
  // an unbounded exponent: the step is 2^(e - mantissa_bits) in binade 2^e, and below the
  // min normal it stays that of the min normal's binade (the subnormals' fixed step).
  // Scaling by a power of two is exact in double, so nearbyint (the default rounding mode:
  // to nearest, ties to even) is the only rounding.
  const double magnitude = std::fabs(static_cast<double>(x));
  if (magnitude == 0.0) return sign;
  int binade;
  std::frexp(magnitude, &binade);  // magnitude in [2^(binade-1), 2^binade)
  const int min_normal_exponent = 1 - f.bias;
  int exponent = std::max(binade - 1, min_normal_exponent);
  double significand = std::nearbyint(std::ldexp(magnitude, f.mantissa_bits - exponent));
  if (significand == 0.0) return sign;
  if (significand == std::ldexp(1.0, f.mantissa_bits + 1)) {  // rounded up into the next binade
    significand /= 2;
    exponent += 1;
  }
  if (std::ldexp(significand, exponent - f.mantissa_bits) > f.max) return overflowed | sign;

  const int n = static_cast<int>(significand);
  const bool subnormal = n < (1 << f.mantissa_bits);  // only possible at the min normal's exponent
  const int exponent_field = subnormal ? 0 : exponent + f.bias;
  const int mantissa = subnormal ? n : n - (1 << f.mantissa_bits);
  return static_cast<uint8_t>(sign | (exponent_field << f.mantissa_bits) | mantissa);
}

}  // namespace kiln::ops::fp8
