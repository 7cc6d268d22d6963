// The CPU reference's FP8 emulation (src/ops/fp8/): the casts every FP8 kernel must match bit
// for bit, the scaled quantization, and the reference GEMM.
//
// Formats: decode() is checked against the float built directly from the code's bit fields
// (a subnormal normalized by shifting, no ldexp arithmetic) and against constants from the
// OCP spec; encode() against a brute-force oracle that searches every code for the nearest
// value (ties to the even code), and at every midpoint between neighbouring codes.
// Scaling: each element is within half an fp8 ulp of x * scale, with each block's scale
// taken from that block's amax alone. GEMM: against fp64 on the same dequantized operands.
#include "core/error.h"
#include "ops/fp8/fp8_format.h"
#include "ops/fp8/fp8_gemm_reference.h"
#include "ops/fp8/fp8_scaling.h"

#include <gtest/gtest.h>

// CUDA's own conversions (cuda_fp8.h's host code, the same results as PTX cvt.rn{.satfinite}),
// a second, independent oracle where the CUDA toolkit is installed; CPU-only CI skips it.
#if KILN_WITH_CUDA && __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#define KILN_FP8_HAVE_CUDA_ORACLE 1
#endif

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace kiln::ops::fp8 {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr Format kFormats[] = {Format::e4m3, Format::e5m2};
constexpr Overflow kOverflows[] = {Overflow::saturate, Overflow::nonfinite};

struct Layout {
  int exponent_bits, mantissa_bits, bias;
};
Layout layout(Format f) { return f == Format::e4m3 ? Layout{4, 3, 7} : Layout{5, 2, 15}; }

enum class Kind { finite, inf, nan };

// The OCP spec's value of a code, built as float bits from its fields.
Kind expected_kind(uint8_t code, Format f) {
  const Layout l = layout(f);
  const int exponent = (code & 0x7F) >> l.mantissa_bits;
  const int mantissa = code & ((1 << l.mantissa_bits) - 1);
  if (f == Format::e4m3) return exponent == 15 && mantissa == 7 ? Kind::nan : Kind::finite;
  if (exponent == 31) return mantissa == 0 ? Kind::inf : Kind::nan;
  return Kind::finite;
}

float expected_value(uint8_t code, Format f) {
  const Layout l = layout(f);
  const uint32_t sign = static_cast<uint32_t>(code >> 7) << 31;
  int exponent = (code & 0x7F) >> l.mantissa_bits;
  uint32_t mantissa = code & ((1u << l.mantissa_bits) - 1);
  if (exponent == 0 && mantissa == 0) return std::bit_cast<float>(sign);
  int unbiased = exponent - l.bias;
  if (exponent == 0) {  // subnormal: shift the leading 1 into the implicit position
    unbiased = 1 - l.bias;
    while (!(mantissa & (1u << l.mantissa_bits))) {
      mantissa <<= 1;
      --unbiased;
    }
    mantissa &= (1u << l.mantissa_bits) - 1;
  }
  const uint32_t bits = sign | uint32_t(unbiased + 127) << 23 | mantissa << (23 - l.mantissa_bits);
  return std::bit_cast<float>(bits);
}

TEST(Fp8Format, EveryCodeDecodesToTheSpecValue) {
  for (Format f : kFormats) {
    int finite = 0;
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      const float got = decode(code, f);
      switch (expected_kind(code, f)) {
        case Kind::nan:
          EXPECT_TRUE(std::isnan(got)) << name(f) << " code " << c;
          EXPECT_TRUE(is_nan(code, f));
          break;
        case Kind::inf:
          EXPECT_EQ(got, (c & 0x80) ? -kInf : kInf) << name(f) << " code " << c;
          EXPECT_TRUE(is_inf(code, f));
          break;
        case Kind::finite:
          ++finite;
          EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(expected_value(code, f)))
              << name(f) << " code " << c << ": " << got << " vs " << expected_value(code, f);
          EXPECT_FALSE(is_nan(code, f) || is_inf(code, f));
      }
    }
    EXPECT_EQ(finite, f == Format::e4m3 ? 254 : 248) << name(f);  // E4M3: 2 NaNs; E5M2: 2 infs, 6 NaNs
  }
}

TEST(Fp8Format, KnownConstants) {
  EXPECT_EQ(decode(0x7E, Format::e4m3), 448.0f);
  EXPECT_EQ(decode(0xFE, Format::e4m3), -448.0f);
  EXPECT_EQ(decode(0x08, Format::e4m3), 0.015625f);       // min normal 2^-6
  EXPECT_EQ(decode(0x01, Format::e4m3), 0.001953125f);    // min subnormal 2^-9
  EXPECT_EQ(decode(0x07, Format::e4m3), 7 * 0.001953125f);
  EXPECT_EQ(decode(0x38, Format::e4m3), 1.0f);
  EXPECT_EQ(decode(0x39, Format::e4m3), 1.125f);
  EXPECT_TRUE(std::isnan(decode(0x7F, Format::e4m3)));
  EXPECT_TRUE(std::isnan(decode(0xFF, Format::e4m3)));
  EXPECT_EQ(decode(0x7B, Format::e5m2), 57344.0f);
  EXPECT_EQ(decode(0x04, Format::e5m2), 0.00006103515625f);        // min normal 2^-14
  EXPECT_EQ(decode(0x01, Format::e5m2), 0.0000152587890625f);      // min subnormal 2^-16
  EXPECT_EQ(decode(0x3C, Format::e5m2), 1.0f);
  EXPECT_EQ(decode(0x3D, Format::e5m2), 1.25f);
  EXPECT_EQ(decode(0x7C, Format::e5m2), kInf);
  EXPECT_EQ(decode(0xFC, Format::e5m2), -kInf);
  for (int c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(decode(static_cast<uint8_t>(c), Format::e5m2)));
  EXPECT_EQ(info(Format::e4m3).max, 448.0f);
  EXPECT_EQ(info(Format::e5m2).max, 57344.0f);
  EXPECT_EQ(info(Format::e4m3).min_subnormal, 0.001953125f);
  EXPECT_EQ(info(Format::e5m2).min_subnormal, 0.0000152587890625f);
}

TEST(Fp8Format, EncodeInvertsDecodeOnEveryNonNanCode) {
  for (Format f : kFormats)
    for (Overflow o : kOverflows)
      for (int c = 0; c < 256; ++c) {
        const auto code = static_cast<uint8_t>(c);
        if (is_nan(code, f)) continue;
        if (is_inf(code, f)) {  // inf stays inf only when not saturating
          EXPECT_EQ(encode(decode(code, f), f, o), o == Overflow::nonfinite ? code : (code & 0x80) | info(f).max_code);
          continue;
        }
        EXPECT_EQ(encode(decode(code, f), f, o), code) << name(f) << " code " << c;
      }
}

TEST(Fp8Format, MidpointsRoundToTheEvenCode) {
  for (Format f : kFormats) {
    const uint8_t max_code = info(f).max_code;
    for (uint8_t c = 0; c < max_code; ++c) {
      const float lo = decode(c, f), hi = decode(c + 1, f);
      ASSERT_LT(lo, hi) << name(f) << " codes are ordered by value";
      const float mid = (lo + hi) / 2;  // exact: both have at most 4 significant bits
      const uint8_t even = (c % 2 == 0) ? c : c + 1;
      for (Overflow o : kOverflows) {
        EXPECT_EQ(encode(mid, f, o), even) << name(f) << " midpoint " << mid;
        EXPECT_EQ(encode(-mid, f, o), even | 0x80) << name(f) << " midpoint " << -mid;
        EXPECT_EQ(encode(std::nextafter(mid, 0.0f), f, o), c) << name(f) << " just below " << mid;
        EXPECT_EQ(encode(std::nextafter(mid, kInf), f, o), c + 1) << name(f) << " just above " << mid;
        EXPECT_EQ(encode(-std::nextafter(mid, kInf), f, o), (c + 1) | 0x80) << name(f);
      }
    }
  }
}

TEST(Fp8Format, BeyondMaxSaturatesOrBecomesNanOrInf) {
  // E4M3: the next grid point past 448 would be 480; the midpoint 464 ties to 448 (even).
  for (Overflow o : kOverflows) EXPECT_EQ(encode(464.0f, Format::e4m3, o), 0x7E);
  const float above_e4m3 = std::nextafter(464.0f, kInf);
  for (float x : {above_e4m3, 1e6f, std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(encode(x, Format::e4m3, Overflow::saturate), 0x7E) << x;
    EXPECT_EQ(encode(-x, Format::e4m3, Overflow::saturate), 0xFE) << x;
    EXPECT_EQ(encode(x, Format::e4m3, Overflow::nonfinite), 0x7F) << x;
    EXPECT_EQ(encode(-x, Format::e4m3, Overflow::nonfinite), 0xFF) << x;
  }
  // E5M2: the next grid point past 57344 is 65536 (even mantissa), so the midpoint 61440 overflows.
  for (Overflow o : kOverflows) EXPECT_EQ(encode(std::nextafter(61440.0f, 0.0f), Format::e5m2, o), 0x7B);
  for (float x : {61440.0f, 1e6f, std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(encode(x, Format::e5m2, Overflow::saturate), 0x7B) << x;
    EXPECT_EQ(encode(-x, Format::e5m2, Overflow::saturate), 0xFB) << x;
    EXPECT_EQ(encode(x, Format::e5m2, Overflow::nonfinite), 0x7C) << x;
    EXPECT_EQ(encode(-x, Format::e5m2, Overflow::nonfinite), 0xFC) << x;
  }
  // NaN is never saturated away.
  for (Format f : kFormats)
    for (Overflow o : kOverflows) {
      EXPECT_TRUE(is_nan(encode(std::numeric_limits<float>::quiet_NaN(), f, o), f));
      EXPECT_TRUE(is_nan(encode(-std::numeric_limits<float>::quiet_NaN(), f, o), f));
    }
}

TEST(Fp8Format, SignedZeroAndUnderflow) {
  for (Format f : kFormats)
    for (Overflow o : kOverflows) {
      EXPECT_EQ(encode(0.0f, f, o), 0x00);
      EXPECT_EQ(encode(-0.0f, f, o), 0x80);
      EXPECT_EQ(encode(-1e-30f, f, o), 0x80);  // rounds to zero, keeps its sign
      EXPECT_EQ(encode(1e-40f, f, o), 0x00);   // a float subnormal
      EXPECT_EQ(encode(info(f).min_subnormal / 2, f, o), 0x00);  // tie with 0: even
      EXPECT_EQ(encode(std::nextafter(info(f).min_subnormal / 2, 1.0f), f, o), 0x01);
    }
  EXPECT_EQ(decode(0x80, Format::e4m3), 0.0f);
  EXPECT_TRUE(std::signbit(decode(0x80, Format::e4m3)));
  EXPECT_TRUE(std::signbit(decode(0x80, Format::e5m2)));
  EXPECT_FALSE(std::signbit(decode(0x00, Format::e5m2)));
}

// Brute force: the finite code nearest to x (ties to the even code), or "overflow" when the
// nearest point of the grid extended one step past max is that step.
int nearest_code_or_overflow(float x, Format f) {
  const double a = std::fabs(double{x});
  const uint8_t max_code = info(f).max_code;
  const double top_step = double{decode(max_code, f)} - decode(max_code - 1, f);
  const double beyond = double{info(f).max} + top_step;  // 480, 65536
  // The extended point's code parity: E4M3 480 would be 0x7F (odd), E5M2 65536 would be 0x7C (even).
  const int beyond_code = f == Format::e4m3 ? 0x7F : 0x7C;
  int best = 0;
  double best_distance = a;
  for (int c = 1; c <= max_code + 1; ++c) {
    const double v = c <= max_code ? double{decode(static_cast<uint8_t>(c), f)} : beyond;
    const int code = c <= max_code ? c : beyond_code;
    const double d = std::fabs(a - v);
    if (d < best_distance || (d == best_distance && code % 2 == 0)) {
      best_distance = d;
      best = c;
    }
  }
  return best == max_code + 1 ? -1 : best;
}

TEST(Fp8Format, EncodeMatchesNearestValueSearch) {
  std::mt19937 rng(50);
  std::uniform_real_distribution<float> log2_magnitude(-20.0f, 18.0f);
  for (Format f : kFormats)
    for (int i = 0; i < 20000; ++i) {
      const float x = std::exp2(log2_magnitude(rng)) * (i % 2 ? -1.0f : 1.0f);
      const int expected = nearest_code_or_overflow(x, f);
      const uint8_t sign = x < 0 ? 0x80 : 0;
      if (expected < 0) {
        EXPECT_EQ(encode(x, f, Overflow::saturate), info(f).max_code | sign) << name(f) << " " << x;
        EXPECT_FALSE(std::isfinite(decode(encode(x, f, Overflow::nonfinite), f))) << name(f) << " " << x;
      } else {
        for (Overflow o : kOverflows) ASSERT_EQ(encode(x, f, o), expected | sign) << name(f) << " " << x;
      }
    }
}

#ifdef KILN_FP8_HAVE_CUDA_ORACLE
TEST(Fp8Format, MatchesCudaConversions) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> log2_magnitude(-20.0f, 18.0f);
  std::vector<float> inputs = {0.0f, -0.0f, kInf, -kInf, std::numeric_limits<float>::max(), 1e-40f};
  for (int i = 0; i < 100000; ++i) inputs.push_back(std::exp2(log2_magnitude(rng)) * (i % 2 ? -1.0f : 1.0f));
  for (Format f : kFormats)
    for (uint8_t c = 0; c < info(f).max_code; ++c) {  // every midpoint and its neighbours, both signs
      const float mid = (decode(c, f) + decode(c + 1, f)) / 2;
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf)}) {
        inputs.push_back(x);
        inputs.push_back(-x);
      }
    }
  for (Format f : kFormats) {
    const __nv_fp8_interpretation_t cuda_format = f == Format::e4m3 ? __NV_E4M3 : __NV_E5M2;
    for (Overflow o : kOverflows) {
      const __nv_saturation_t cuda_overflow = o == Overflow::saturate ? __NV_SATFINITE : __NV_NOSAT;
      for (float x : inputs)
        ASSERT_EQ(+encode(x, f, o), +__nv_cvt_float_to_fp8(x, cuda_overflow, cuda_format)) << name(f) << " " << x;
    }
    for (int c = 0; c < 256; ++c) {
      const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), cuda_format);
      const float cuda_value = __half2float(__half(h));
      const float value = decode(static_cast<uint8_t>(c), f);
      if (std::isnan(value)) EXPECT_TRUE(std::isnan(cuda_value)) << name(f) << " code " << c;
      else EXPECT_EQ(std::bit_cast<uint32_t>(value), std::bit_cast<uint32_t>(cuda_value)) << name(f) << " code " << c;
    }
  }
}
#endif

// Half an ulp of the fp8 grid at |v| (the subnormals' fixed step below the min normal).
double half_ulp(double v, Format f) {
  const FormatInfo& fi = info(f);
  const double a = std::max(std::fabs(v), double{fi.min_normal});
  return std::ldexp(1.0, std::ilogb(a) - fi.mantissa_bits - 1);
}

std::vector<float> wide_range_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log2_scale(-12.0f, 12.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng) * std::exp2(log2_scale(rng));
  return x;
}

// Every element within half an ulp of x * scale, each block's scale from its own amax.
void expect_blocks_quantized(const std::vector<float>& x, int64_t rows, int64_t cols, BlockShape block, Format f) {
  const ScaledMatrix q = quantize(x, rows, cols, block, f);
  ASSERT_EQ(q.codes.size(), x.size());
  const int64_t grid_rows = (rows + block.rows - 1) / block.rows, grid_cols = (cols + block.cols - 1) / block.cols;
  ASSERT_EQ(static_cast<int64_t>(q.scale_inv.size()), grid_rows * grid_cols);
  const std::vector<float> values = dequantize(q);
  for (int64_t br = 0; br < grid_rows; ++br)
    for (int64_t bc = 0; bc < grid_cols; ++bc) {
      float amax = 0;
      for (int64_t r = br * block.rows; r < std::min(rows, (br + 1) * block.rows); ++r)
        for (int64_t c = bc * block.cols; c < std::min(cols, (bc + 1) * block.cols); ++c)
          amax = std::max(amax, std::fabs(x[r * cols + c]));
      const float scale = info(f).max / amax;
      ASSERT_EQ(q.scale_inv[br * grid_cols + bc], 1.0f / scale) << name(f) << " block " << br << "," << bc;
      bool amax_hits_max = false;
      for (int64_t r = br * block.rows; r < std::min(rows, (br + 1) * block.rows); ++r)
        for (int64_t c = bc * block.cols; c < std::min(cols, (bc + 1) * block.cols); ++c) {
          const int64_t i = r * cols + c;
          const float scaled = x[i] * scale;
          const float code_value = decode(q.codes[i], f);
          ASSERT_LE(std::fabs(double{code_value} - scaled), half_ulp(scaled, f)) << name(f) << " element " << r << "," << c;
          ASSERT_LE(std::fabs(code_value), info(f).max);
          amax_hits_max |= std::fabs(code_value) == info(f).max;
          // Dequantized: the same error times scale_inv, plus the fp32 roundings of x * scale and of the product.
          const double bound = half_ulp(scaled, f) / scale * (1 + 0x1p-21) + 3 * std::ldexp(std::fabs(double{x[i]}), -24);
          ASSERT_LE(std::fabs(double{values[i]} - x[i]), bound) << name(f) << " element " << r << "," << c;
        }
      EXPECT_TRUE(amax_hits_max) << name(f) << " block " << br << "," << bc << ": its amax should land on fp8 max";
    }
}

TEST(Fp8Scaling, QuantizeDequantizeWithinHalfAnUlpPerElement) {
  const int64_t rows = 130, cols = 300;  // partial tiles and blocks at both edges
  const std::vector<float> x = wide_range_values(rows * cols, 7);
  for (Format f : kFormats) {
    expect_blocks_quantized(x, rows, cols, {rows, cols}, f);  // per tensor
    expect_blocks_quantized(x, rows, cols, kActivationTile, f);
    expect_blocks_quantized(x, rows, cols, kWeightBlock, f);
  }
  const ScaledMatrix tensorwise = quantize_tensorwise(x, rows, cols, Format::e4m3);
  EXPECT_EQ(tensorwise.scale_inv.size(), 1u);
  EXPECT_EQ(quantize(x, rows, cols, kActivationTile, Format::e4m3).scale_inv.size(), 130u * 3);
  EXPECT_EQ(quantize(x, rows, cols, kWeightBlock, Format::e4m3).scale_inv.size(), 2u * 3);
}

TEST(Fp8Scaling, OneHugeValueCostsOnlyItsOwnBlock) {
  const int64_t n = 256;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> magnitude(0.5f, 1.0f);
  std::vector<float> w(n * n);
  for (int64_t i = 0; i < n * n; ++i) w[i] = magnitude(rng) * (i % 3 ? 1.0f : -1.0f);
  w[0] = 1e6f;  // block (0, 0)'s, and the tensor's, amax
  // Scaled by 448 / 1e6, values of magnitude <= 1 land below half the min subnormal: zero.
  const std::vector<float> tensorwise = dequantize(quantize_tensorwise(w, n, n, Format::e4m3));
  const std::vector<float> blockwise = dequantize(quantize(w, n, n, kWeightBlock, Format::e4m3));
  int64_t zeroed_tensorwise = 0, outside = 0;
  double worst_blockwise = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < n; ++c) {
      if (r < 128 && c < 128) continue;
      ++outside;
      const int64_t i = r * n + c;
      zeroed_tensorwise += tensorwise[i] == 0.0f;
      worst_blockwise = std::max(worst_blockwise, std::fabs(double{blockwise[i]} - w[i]) / std::fabs(w[i]));
    }
  EXPECT_EQ(zeroed_tensorwise, outside) << "per-tensor scaling flushes every small value to zero";
  // E4M3 normals: relative error <= 2^-4 (half an ulp of a 3-bit mantissa), plus fp32 roundings.
  EXPECT_LE(worst_blockwise, 0.0625 * (1 + 1e-6)) << "blocks without the outlier keep full precision";
  EXPECT_EQ(blockwise[0], 448.0f * (1.0f / (448.0f / 1e6f)));  // the outlier itself lands on fp8 max
}

TEST(Fp8Scaling, ZeroBlockGetsScaleOneAndNonFiniteIsRejected) {
  std::vector<float> x(2 * 256, 0.0f);
  x[1] = 3.0f;  // only the first activation tile of row 0 is nonzero
  const ScaledMatrix q = quantize(x, 2, 256, kActivationTile, Format::e4m3);
  EXPECT_EQ(q.scale_inv[1], 1.0f);
  EXPECT_EQ(q.scale_inv[2], 1.0f);
  EXPECT_EQ(q.scale_inv[0], 1.0f / (448.0f / 3.0f));
  const std::vector<float> values = dequantize(q);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(q.codes[i], i == 1 ? 0x7E : 0x00) << i;
    EXPECT_EQ(values[i], i == 1 ? 448.0f * q.scale_inv[0] : 0.0f) << i;
  }
  EXPECT_NEAR(values[1], 3.0f, 3.0f * 0x1p-22f);
  EXPECT_EQ(scale_from_amax(1e-40f, Format::e4m3), std::numeric_limits<float>::max());
  x[300] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(quantize(x, 2, 256, kActivationTile, Format::e4m3), kiln::Error);
  x[300] = kInf;
  EXPECT_THROW(quantize_tensorwise(x, 2, 256, Format::e5m2), kiln::Error);
}

// C = A * B^T: the reference in fp32 against fp64 on the same dequantized operands.
void expect_gemm_matches_fp64(const ScaledMatrix& a, const ScaledMatrix& b) {
  const std::vector<float> c = gemm_reference(a, b);
  const int64_t m = a.rows, n = b.rows, k = a.cols;
  ASSERT_EQ(static_cast<int64_t>(c.size()), m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double exact = 0, magnitude = 0;
      for (int64_t p = 0; p < k; ++p) {
        // Dequantized here from the codes and the block's scale, not by dequantize().
        const double av = double{decode(a.codes[i * k + p], a.format)} * a.scale_inv_of(i, p);
        const double bv = double{decode(b.codes[j * k + p], b.format)} * b.scale_inv_of(j, p);
        exact += av * bv;
        magnitude += std::fabs(av * bv);
      }
      // k + 4: the sums' roundings, each operand's fp32 dequantization, the product's rounding.
      const double bound = (k + 4) * std::ldexp(1.0, -24) * magnitude;
      ASSERT_LE(std::fabs(c[i * n + j] - exact), bound) << "C[" << i << "," << j << "]";
    }
}

TEST(Fp8Gemm, ReferenceMatchesFp64OnDequantizedOperands) {
  const int64_t m = 37, n = 45, k = 300;
  const std::vector<float> a = wide_range_values(m * k, 11), b = wide_range_values(n * k, 12);
  // DeepSeek-V3's forward (e4m3 tiles x e4m3 blocks), a backward-style e5m2 operand, per tensor.
  expect_gemm_matches_fp64(quantize(a, m, k, kActivationTile, Format::e4m3), quantize(b, n, k, kWeightBlock, Format::e4m3));
  expect_gemm_matches_fp64(quantize(a, m, k, kActivationTile, Format::e5m2), quantize(b, n, k, kWeightBlock, Format::e4m3));
  expect_gemm_matches_fp64(quantize_tensorwise(a, m, k, Format::e4m3), quantize_tensorwise(b, n, k, Format::e4m3));
}

TEST(Fp8Gemm, ReferenceIsCloseToTheUnquantizedProduct) {
  // Blockwise e4m3 on N(0, 1) operands: each element within 2^-4 relative (plus subnormals'
  // absolute error near zero), so C's relative Frobenius error is a few percent at most.
  const int64_t m = 64, n = 96, k = 384;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(m * k), b(n * k);
  for (float& v : a) v = normal(rng);
  for (float& v : b) v = normal(rng);
  const std::vector<float> c = gemm_reference(quantize(a, m, k, kActivationTile, Format::e4m3),
                                              quantize(b, n, k, kWeightBlock, Format::e4m3));
  double error = 0, norm = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double exact = 0;
      for (int64_t p = 0; p < k; ++p) exact += double{a[i * k + p]} * b[j * k + p];
      error += (c[i * n + j] - exact) * (c[i * n + j] - exact);
      norm += exact * exact;
    }
  // Per element the rounding error is uniform within half an ulp, 2^-5..2^-4 relative: RMS
  // about 0.026, about 0.037 for a product of two, and so for C.
  const double relative = std::sqrt(error / norm);
  EXPECT_LT(relative, 0.06);
  EXPECT_GT(relative, 0.01) << "a quantized product should carry fp8's rounding error";
  RecordProperty("relative_frobenius_error", std::to_string(relative));
}

TEST(Fp8Gemm, MismatchedInnerDimensionIsAnError) {
  const std::vector<float> a(4 * 8, 1.0f), b(3 * 6, 1.0f);
  EXPECT_THROW(gemm_reference(quantize_tensorwise(a, 4, 8, Format::e4m3), quantize_tensorwise(b, 3, 6, Format::e4m3)),
               kiln::Error);
}

}  // namespace
}  // namespace kiln::ops::fp8
