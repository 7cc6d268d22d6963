// The two OCP 8-bit floating-point formats (OCP "OFP8" spec, 2023), emulated bit-exactly
// on the CPU: the reference every FP8 cast kernel is compared with, code for code.
//
//   E4M3 ("fn": finite, NaN only): bias 7, no infinities, NaN is S.1111.111 (0x7F/0xFF),
//        max 448 (S.1111.110), min normal 2^-6, min subnormal 2^-9.
//   E5M2 (IEEE-like): bias 15, inf is S.11111.00, NaNs S.11111.{01,10,11},
//        max 57344 (S.11110.11), min normal 2^-14, min subnormal 2^-16.
//
// encode() rounds to nearest, ties to even (also into and within the subnormals), on the
// unbounded-exponent grid first: a value overflows when it rounds past max, so the
// threshold is max + half an ulp (E4M3: 464 rounds to 448, anything above to overflow;
// E5M2: 61440 ties to the even 65536, i.e. overflows). That is PTX's cvt.rn and CUDA's
// __nv_cvt_float_to_fp8.
#pragma once

#include <cstdint>
#include <string_view>

namespace kiln::ops::fp8 {

enum class Format { e4m3, e5m2 };

// What encode() does with a value that rounds past max, and with +-inf.
enum class Overflow {
  saturate,     // clamp to +-max (Transformer Engine's and DeepSeek-V3's casts, cvt.satfinite)
  nonfinite,    // E4M3: NaN, E5M2: +-inf (the OCP spec's non-saturating mode)
};

// The bit layout of a format; everything else is derived from it.
struct FormatInfo {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  float max;           // largest finite magnitude
  float min_normal;    // 2^(1 - bias)
  float min_subnormal; // 2^(1 - bias - mantissa_bits)
  uint8_t max_code;    // the code of +max
  uint8_t nan;         // the positive NaN encode() writes (the sign bit is kept from the input)
};

const FormatInfo& info(Format format);
std::string_view name(Format format);  // "e4m3" or "e5m2"

// float -> code, round-to-nearest-even. NaN stays NaN (info().nan with the input's sign;
// payloads are not carried, so compare NaN codes by is_nan(), not by bits). -0 and values
// that round to zero from below keep the sign (0x80).
uint8_t encode(float x, Format format, Overflow overflow);
// code -> float, exact (every fp8 value is a float).
float decode(uint8_t code, Format format);

bool is_nan(uint8_t code, Format format);
bool is_inf(uint8_t code, Format format);  // always false for E4M3

}  // namespace kiln::ops::fp8
