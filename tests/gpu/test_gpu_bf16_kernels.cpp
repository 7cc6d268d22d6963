// The bf16 kernels of the mixed-precision path (ops/mixed_precision.h) against fp64 CPU
// references computed from the same inputs: bf16 inputs are random values rounded to
// bf16 first (kiln::float_to_bf16), so both sides read identical numbers and the only
// differences are the kernel's fp32 arithmetic and the final rounding of its outputs.
// Outputs are poisoned with NaN bytes before each run; NaN/Inf never pass. Sizes are
// awkward: one row, odd counts, lengths not a multiple of 8 (scalar path), head-sized rows
// (8 or 16 threads per row), warp-per-row and block-per-row lengths, offset pointers.
//
// Tolerances: max over elements of |gpu - ref| / max(|ref|, floor). The floor is
// kFloorFraction of the output's scale unless a row says otherwise.
//   output                           tolerance  why
//   casts, qkv shuffle               bit-exact  conversions (round to nearest even) and copies
//   add_f32_bf16 (fp32)              1e-6       one fp32 rounding (2^-24) of exactly known inputs
//   bf16 outputs: rms y, bf16 dx,    1e-2       one bf16 rounding (8 significant bits: at most
//     rope, swiglu fwd/bwd, CE grad             2^-8 = 3.9e-3 relative) over fp32 math (~1e-6)
//   rope vs reference                1e-2       floor 1% of the pair's norm (the pair mixes)
//   rope then inverse vs input       1e-2       two roundings carried through a rotation:
//                                               <= 2 * 2^-8 = 7.8e-3 of the pair's norm (the floor)
//   CE grad                          1e-2       floor 1% of its terms, |p * zfactor| + [target],
//                                               so every logit, however small, is checked
//   rstd (fp32)                      1e-5       fp32 sum of positive squares, <= 2048 terms
//   fp32 dx                          1e-4       fp32 row dot that cancels; floor from |old| + |r g|
//                                               (as the fp32 suite)
//   dw (fp32)                        1e-4       fp32 column sums; floor from |dw0| + sum |terms|
//   row_stats (f64 from fp32 lse)    1e-5       fp32 logsumexp (__expf: ~2 ulp near the max);
//                                               loss judged against |lse| + |target logit|
//   decode projections (the decoder's fused norm/residual/SwiGLU products, <= 8 rows):
//     norm_gemv f32                  2e-4       fp32 dot over staged bf16 rows; floor sum |terms|
//                                               (a staged value may round the other way from the
//                                               host's replica of the norm: 2^-8 of one term)
//     norm_gemv bf16, residual add   1e-2       one bf16 rounding; floor sum |terms| (+ |x0|)
//     swiglu                         2e-2       bf16 gate, up and output: three roundings;
//                                               floor |g u| + 1e-3 (terms_g |u| + terms_u |g|)
#include "core/device_memory.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "gpu/gpu_harness.h"
#include "infer/decoder_cuda.h"
#include "ops/cross_entropy/cross_entropy_cuda.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/linear/linear_cuda.h"
#include "ops/rms_norm/rms_norm_cuda.h"
#include "ops/rope/rope_cuda.h"
#include "ops/split/qkv_split_cuda.h"
#include "ops/swiglu/swiglu_cuda.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

constexpr double kBf16Tol = 1e-2;
constexpr double kAddTol = 1e-6;
constexpr double kRstdTol = 1e-5;
constexpr double kF32GradTol = 1e-4;
constexpr double kStatsTol = 1e-5;
constexpr float kEps = 1e-6f;

// ---- host data ---------------------------------------------------------------------------

std::vector<float> random_f32(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.normal() * scale);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, double scale = 1.0) {
  return to_bf16(random_f32(n, seed, scale));
}

std::vector<float> bf16_values(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

bool bf16_is_nan(uint16_t h) { return (h & 0x7fffu) > 0x7f80u; }

// ---- device buffers ------------------------------------------------------------------------

template <typename T>
DType dtype_for() {
  if constexpr (std::is_same_v<T, uint16_t>) return DType::bf16;
  else if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else return DType::i32;
}

// A flat device buffer holding `host` (bf16 travels as its 16 bits).
template <typename T>
OwnedTensor upload(const std::vector<T>& host) {
  const Shape shape{static_cast<int64_t>(host.size())};
  OwnedTensor dev(dtype_for<T>(), Device::cuda, shape);
  copy_tensor(Tensor(const_cast<T*>(host.data()), dtype_for<T>(), Device::cpu, shape), *dev);
  return dev;
}

// A poisoned (NaN bytes) device buffer of n elements.
template <typename T>
OwnedTensor poisoned(size_t n) {
  OwnedTensor dev(dtype_for<T>(), Device::cuda, Shape{static_cast<int64_t>(n)});
  poison(*dev);
  return dev;
}

template <typename T>
std::vector<T> download(const Tensor& dev) {
  std::vector<T> host(dev.nbytes() / sizeof(T));
  copy_tensor(dev, Tensor(host.data(), dev.dtype(), Device::cpu, dev.shape()));
  return host;
}

template <typename T>
T* ptr(const OwnedTensor& t) {
  return static_cast<T*>(t->raw());
}

// ---- comparison ----------------------------------------------------------------------------

struct Worst {
  double error = 0;  // +inf when an output is not finite
  size_t at = 0;
};

// Max relative error with denominator max(|ref|, floor_i): floor_i is floors[i] when given,
// else kFloorFraction of max(scale, max |ref|).
Worst max_rel_error(const std::vector<float>& gpu, const std::vector<double>& ref, double scale = 0,
                    const std::vector<double>* floors = nullptr) {
  Worst worst;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  const double global_floor = kFloorFraction * scale;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(gpu[i])) return {std::numeric_limits<double>::infinity(), i};
    const double floor = std::max(floors ? (*floors)[i] : global_floor, 1e-30);
    const double err = std::fabs(gpu[i] - ref[i]) / std::max(std::fabs(ref[i]), floor);
    if (err > worst.error) worst = {err, i};
  }
  return worst;
}

void expect_values_close(const std::string& name, const std::vector<float>& gpu, const std::vector<double>& ref,
                  double tolerance, double scale = 0, const std::vector<double>* floors = nullptr) {
  ASSERT_EQ(gpu.size(), ref.size()) << name;
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_TRUE(std::isfinite(ref[i])) << name << ": reference not finite at " << i;
  const Worst w = max_rel_error(gpu, ref, scale, floors);
  EXPECT_LE(w.error, tolerance) << name << ": max relative error " << w.error << " at " << w.at << " (gpu "
                                << gpu[w.at] << ", ref " << ref[w.at] << ")";
  ::testing::Test::RecordProperty(name + "_max_rel_err", fmt::format("{:.3e}", w.error));
}

void expect_bf16_close(const std::string& name, const std::vector<uint16_t>& gpu, const std::vector<double>& ref,
                       double tolerance, double scale = 0, const std::vector<double>* floors = nullptr) {
  expect_values_close(name, bf16_values(gpu), ref, tolerance, scale, floors);
}

// The comparison itself: a poisoned (never written) output cannot pass.
TEST(Bf16Harness, NonFiniteNeverPasses) {
  const std::vector<double> ref = {1.0, -2.0, 3.0};
  std::vector<float> gpu = {1.0f, -2.0f, 3.0f};
  EXPECT_EQ(max_rel_error(gpu, ref).error, 0.0);
  gpu[1] = bf16_to_float(0xFFFFu);  // the poison pattern of a bf16 output
  EXPECT_TRUE(std::isnan(gpu[1]));
  EXPECT_FALSE(max_rel_error(gpu, ref).error <= 1e30);
  gpu[1] = INFINITY;
  EXPECT_FALSE(max_rel_error(gpu, ref).error <= 1e30);
}

class Bf16Kernels : public GpuTest {};

// ---- casts -----------------------------------------------------------------------------------

// Floats of every kind: normals over the whole exponent range, both zeros, infinities,
// the largest float (rounds up to inf), subnormals, exact ties of both parities, NaNs.
std::vector<float> cast_inputs(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (rng.below(8)) {
      case 0: v[i] = static_cast<float>(rng.normal()); break;
      case 1: v[i] = static_cast<float>(rng.normal() * std::ldexp(1.0, static_cast<int>(rng.below(250)) - 125)); break;
      case 2: v[i] = float_of(static_cast<uint32_t>(rng.next_u64())); break;  // any bit pattern (some NaN)
      case 3: v[i] = float_of((static_cast<uint32_t>(rng.next_u64()) & 0xffff0000u) | 0x8000u); break;  // a tie
      case 4: v[i] = float_of(static_cast<uint32_t>(rng.below(0x00800000u) | rng.below(2) << 31)); break;  // subnormal
      default: v[i] = static_cast<float>(rng.normal() * 1e3); break;
    }
  }
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, FLT_MIN, 1e-45f, NAN, 1.0f + 0x1p-8f,
                            1.0f + 0x1p-8f + 0x1p-7f, 65504.0f};
  for (size_t i = 0; i < std::size(specials) && i < n; ++i) v[i] = specials[i];
  return v;
}

TEST_F(Bf16Kernels, CastF32ToBf16RoundsToNearestEven) {
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{13}, size_t{1000}, (size_t{1} << 20) + 3}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {  // offset 1: unaligned pointers, the scalar path
      SCOPED_TRACE(fmt::format("n={} offset={}", n, offset));
      const std::vector<float> src = cast_inputs(n + offset, 40 + n);
      OwnedTensor src_dev = upload(src), dst_dev = poisoned<uint16_t>(n + offset);
      cuda::cast_f32_to_bf16(ptr<float>(src_dev) + offset, static_cast<int64_t>(n), ptr<uint16_t>(dst_dev) + offset);
      const std::vector<uint16_t> dst = download<uint16_t>(*dst_dev);
      size_t mismatches = 0, first = 0;
      for (size_t i = offset; i < n + offset; ++i) {
        const bool ok = std::isnan(src[i]) ? bf16_is_nan(dst[i]) : dst[i] == float_to_bf16(src[i]);
        if (!ok && mismatches++ == 0) first = i;
      }
      EXPECT_EQ(mismatches, 0u) << "first at " << first << ": " << src[first] << " (0x" << std::hex << bits_of(src[first])
                                << ") -> 0x" << dst[first] << ", expected 0x" << float_to_bf16(src[first]);
      if (offset) {
        EXPECT_EQ(dst[0], 0xFFFFu) << "wrote before the start";
      }
    }
  }
}

TEST_F(Bf16Kernels, CastBf16ToF32IsExactAndRoundTrips) {
  for (size_t offset : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE(fmt::format("offset={}", offset));
    // Every bf16 bit pattern, then a ragged tail.
    std::vector<uint16_t> src(65536 + 5 + offset);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>((i - offset) * 40503u);
    const size_t n = src.size() - offset;
    OwnedTensor src_dev = upload(src), f32_dev = poisoned<float>(src.size()), back_dev = poisoned<uint16_t>(src.size());
    cuda::cast_bf16_to_f32(ptr<uint16_t>(src_dev) + offset, static_cast<int64_t>(n), ptr<float>(f32_dev) + offset);
    cuda::cast_f32_to_bf16(ptr<float>(f32_dev) + offset, static_cast<int64_t>(n), ptr<uint16_t>(back_dev) + offset);
    const std::vector<float> f32 = download<float>(*f32_dev);
    const std::vector<uint16_t> back = download<uint16_t>(*back_dev);
    size_t bad_value = 0, bad_trip = 0;
    for (size_t i = offset; i < src.size(); ++i) {
      if (bf16_is_nan(src[i])) {
        bad_value += !std::isnan(f32[i]);
        bad_trip += !bf16_is_nan(back[i]);
      } else {
        bad_value += bits_of(f32[i]) != bits_of(bf16_to_float(src[i]));
        bad_trip += back[i] != src[i];
      }
    }
    EXPECT_EQ(bad_value, 0u) << "bf16 -> f32 must be exact";
    EXPECT_EQ(bad_trip, 0u) << "bf16 -> f32 -> bf16 must be the identity";
  }
}

// ---- add ---------------------------------------------------------------------------------------

TEST_F(Bf16Kernels, AddF32Bf16) {
  for (size_t n : {size_t{1}, size_t{13}, size_t{1000}, size_t{4099}, (size_t{1} << 20) + 5}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(fmt::format("n={} offset={} in_place={}", n, offset, in_place));
        const std::vector<float> a = random_f32(n + offset, 50 + n, 3.0);
        const std::vector<uint16_t> b = random_bf16(n + offset, 51 + n);
        OwnedTensor a_dev = upload(a), b_dev = upload(b);
        OwnedTensor out_dev = in_place ? OwnedTensor() : poisoned<float>(n + offset);
        float* out = in_place ? ptr<float>(a_dev) + offset : ptr<float>(out_dev) + offset;
        cuda::add_f32_bf16(ptr<float>(a_dev) + offset, ptr<uint16_t>(b_dev) + offset, static_cast<int64_t>(n), out);
        const std::vector<float> got = download<float>(in_place ? *a_dev : *out_dev);
        std::vector<double> ref(n);
        std::vector<float> gpu(n);
        for (size_t i = 0; i < n; ++i) {
          ref[i] = static_cast<double>(a[i + offset]) + bf16_to_float(b[i + offset]);
          gpu[i] = got[i + offset];
        }
        expect_values_close("out", gpu, ref, kAddTol);
      }
    }
  }
}

// ---- rms_norm ------------------------------------------------------------------------------------

// Rows 1..1000; columns: 13 and 1001 (scalar path, 16 threads / block per row), 64 and 128
// (8 and 16 threads per row), 768 and 1000 (warp per row), 2048 (block per row).
const auto kRows = ::testing::Values<int64_t>(1, 3, 37, 1000);
const auto kCols = ::testing::Values<int64_t>(13, 64, 128, 768, 1000, 1001, 2048);

uint64_t seed_of(int64_t rows, int64_t cols, int salt) {
  return static_cast<uint64_t>(rows) * 1000003ull + static_cast<uint64_t>(cols) * 7919ull + static_cast<uint64_t>(salt);
}

// x as the kernel reads it: fp32 values, or bf16 bits whose values are `values`.
struct RowsInput {
  DType dtype;
  std::vector<float> values;
  std::vector<uint16_t> bits;
  OwnedTensor dev;
  RowsInput(DType t, size_t n, uint64_t seed, double scale = 1.0) : dtype(t) {
    if (t == DType::bf16) {
      bits = random_bf16(n, seed, scale);
      values = bf16_values(bits);
      dev = upload(bits);
    } else {
      values = random_f32(n, seed, scale);
      dev = upload(values);
    }
  }
};

// rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w, in fp64.
void rms_forward_reference(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t cols,
                           std::vector<double>& y, std::vector<double>& rstd) {
  y.assign(x.size(), 0.0);
  rstd.assign(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += static_cast<double>(x[r * cols + c]) * x[r * cols + c];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(cols) + kEps);
    rstd[r] = inv;
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] * inv * w[c];
  }
}

using ForwardParam = std::tuple<int64_t, int64_t, bool>;  // rows, cols, x is bf16

class RmsNormMixedForward : public GpuTest, public ::testing::WithParamInterface<ForwardParam> {};

TEST_P(RmsNormMixedForward, MatchesReference) {
  const auto [rows, cols, x_bf16] = GetParam();
  const size_t n = static_cast<size_t>(rows * cols);
  const RowsInput x(x_bf16 ? DType::bf16 : DType::f32, n, seed_of(rows, cols, 1), 2.0);
  const std::vector<float> w = random_f32(static_cast<size_t>(cols), seed_of(rows, cols, 2));
  OwnedTensor w_dev = upload(w), y_dev = poisoned<uint16_t>(n), rstd_dev = poisoned<float>(static_cast<size_t>(rows));
  cuda::rms_norm_forward_mixed(x.dev->raw(), x.dtype, ptr<float>(w_dev), kEps, rows, cols, ptr<uint16_t>(y_dev),
                               ptr<float>(rstd_dev));
  std::vector<double> y_ref, rstd_ref;
  rms_forward_reference(x.values, w, rows, cols, y_ref, rstd_ref);
  expect_bf16_close("y", download<uint16_t>(*y_dev), y_ref, kBf16Tol);
  expect_values_close("rstd", download<float>(*rstd_dev), rstd_ref, kRstdTol);
}

std::string forward_name(const ::testing::TestParamInfo<ForwardParam>& info) {
  const auto& [rows, cols, x_bf16] = info.param;
  return fmt::format("r{}_c{}_x{}", rows, cols, x_bf16 ? "bf16" : "f32");
}
INSTANTIATE_TEST_SUITE_P(Sizes, RmsNormMixedForward, ::testing::Combine(kRows, kCols, ::testing::Bool()),
                         forward_name);

// The fused residual add + norm (the pre-norm block's mid = x + branch, norm2(mid)) gives
// the bits of its two unfused kernels: sum as add_f32_bf16 writes it, y and rstd as the
// norm of that sum. Vector rows (768, 1024), a scalar row (1001) and one row.
TEST_F(Bf16Kernels, FusedAddRmsNormMatchesAddThenNorm) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{37, 768}, {300, 1024}, {5, 1001}, {1, 64}}) {
    SCOPED_TRACE(fmt::format("rows={} cols={}", rows, cols));
    const size_t n = static_cast<size_t>(rows * cols);
    const std::vector<float> x = random_f32(n, seed_of(rows, cols, 5), 2.0);
    const std::vector<float> w = random_f32(static_cast<size_t>(cols), 6);
    const std::vector<uint16_t> b = random_bf16(n, seed_of(rows, cols, 7));
    OwnedTensor x_dev = upload(x), b_dev = upload(b), w_dev = upload(w);
    OwnedTensor sum_ref = poisoned<float>(n), y_ref = poisoned<uint16_t>(n), rstd_ref = poisoned<float>(static_cast<size_t>(rows));
    cuda::add_f32_bf16(ptr<float>(x_dev), ptr<uint16_t>(b_dev), static_cast<int64_t>(n), ptr<float>(sum_ref));
    cuda::rms_norm_forward_mixed(ptr<float>(sum_ref), DType::f32, ptr<float>(w_dev), kEps, rows, cols,
                                 ptr<uint16_t>(y_ref), ptr<float>(rstd_ref));
    OwnedTensor sum = poisoned<float>(n), y = poisoned<uint16_t>(n), rstd = poisoned<float>(static_cast<size_t>(rows));
    cuda::rms_norm_forward_mixed(ptr<float>(x_dev), DType::f32, ptr<float>(w_dev), kEps, rows, cols,
                                 ptr<uint16_t>(y), ptr<float>(rstd), ptr<uint16_t>(b_dev), ptr<float>(sum));
    EXPECT_TRUE(download<float>(*sum) == download<float>(*sum_ref)) << "sum differs from add_f32_bf16";
    EXPECT_TRUE(download<uint16_t>(*y) == download<uint16_t>(*y_ref)) << "y differs from the unfused norm";
    EXPECT_TRUE(download<float>(*rstd) == download<float>(*rstd_ref)) << "rstd differs from the unfused norm";
  }
}

// Offset views (x, y not 16-byte aligned) take the scalar path with the same results.
TEST_F(Bf16Kernels, RmsNormForwardUnalignedViews) {
  const int64_t rows = 5, cols = 64;
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<uint16_t> x = random_bf16(n + 1, 3);
  const std::vector<float> w = random_f32(static_cast<size_t>(cols), 4);
  OwnedTensor x_dev = upload(x), w_dev = upload(w), y_dev = poisoned<uint16_t>(n + 1), rstd_dev = poisoned<float>(5);
  cuda::rms_norm_forward_mixed(ptr<uint16_t>(x_dev) + 1, DType::bf16, ptr<float>(w_dev), kEps, rows, cols,
                               ptr<uint16_t>(y_dev) + 1, ptr<float>(rstd_dev));
  const std::vector<float> all = bf16_values(x), xv(all.begin() + 1, all.end());
  std::vector<double> y_ref, rstd_ref;
  rms_forward_reference(xv, w, rows, cols, y_ref, rstd_ref);
  const std::vector<uint16_t> y = download<uint16_t>(*y_dev);
  EXPECT_EQ(y[0], 0xFFFFu) << "wrote before the start";
  expect_bf16_close("y", std::vector<uint16_t>(y.begin() + 1, y.end()), y_ref, kBf16Tol);
  expect_values_close("rstd", download<float>(*rstd_dev), rstd_ref, kRstdTol);
}

// One backward case: x (fp32 or bf16), dx of x's dtype written or accumulated, dw (+=) from a
// non-zero start. Runs twice from the same state: dx and dw must match bit for bit.
void check_rms_backward(int64_t rows, int64_t cols, bool x_bf16, bool accumulate) {
  const size_t n = static_cast<size_t>(rows * cols), nc = static_cast<size_t>(cols);
  const DType x_dtype = x_bf16 ? DType::bf16 : DType::f32;
  const RowsInput x(x_dtype, n, seed_of(rows, cols, 11), 2.0);
  const std::vector<uint16_t> dy = random_bf16(n, seed_of(rows, cols, 12));
  const std::vector<float> w = random_f32(nc, seed_of(rows, cols, 13));
  const RowsInput dx_init(x_dtype, n, seed_of(rows, cols, 14));
  const std::vector<float> dw_init = random_f32(nc, seed_of(rows, cols, 15));
  const std::vector<float> dyv = bf16_values(dy);

  // rstd from an fp64 forward, rounded to fp32 so both sides read the same saved value.
  std::vector<double> y_unused, rstd64;
  rms_forward_reference(x.values, w, rows, cols, y_unused, rstd64);
  std::vector<float> rstd(rstd64.begin(), rstd64.end());

  // Reference: dx = r * (g - x * r^2 * mean(g * x)) (+ old), g = dy * w; dw += sum dy * x * r.
  std::vector<double> dx_ref(n), dw_ref(dw_init.begin(), dw_init.end());
  double dx_scale = 0, dw_scale = 0;
  std::vector<double> column_abs(nc, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double inv = rstd[r];
    double dot = 0;
    for (int64_t c = 0; c < cols; ++c) dot += static_cast<double>(dyv[r * cols + c]) * w[c] * x.values[r * cols + c];
    const double coef = dot * inv * inv / static_cast<double>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      const double g = static_cast<double>(dyv[i]) * w[c];
      const double old = accumulate ? dx_init.values[i] : 0.0;
      dx_ref[i] = inv * (g - x.values[i] * coef) + old;
      dx_scale = std::max(dx_scale, std::fabs(inv * g) + std::fabs(old));
      const double term = static_cast<double>(dyv[i]) * x.values[i] * inv;
      dw_ref[static_cast<size_t>(c)] += term;
      column_abs[static_cast<size_t>(c)] += std::fabs(term);
    }
  }
  for (size_t c = 0; c < nc; ++c) dw_scale = std::max(dw_scale, std::fabs(dw_init[c]) + column_abs[c]);

  OwnedTensor w_dev = upload(w), rstd_dev = upload(rstd), dy_dev = upload(dy);
  OwnedTensor dx_dev(x_dtype, Device::cuda, Shape{static_cast<int64_t>(n)}), dw_dev = upload(dw_init);
  std::vector<float> dx_runs[2], dw_runs[2];
  OwnedTensor dx_copy(DType::bf16, Device::cuda, Shape{static_cast<int64_t>(n)});
  for (int run = 0; run < 2; ++run) {
    if (accumulate) copy_tensor(*dx_init.dev, *dx_dev);
    else poison(*dx_dev);
    copy_tensor(*upload(dw_init), *dw_dev);
    poison(*dx_copy);
    // The second run also writes dx's bf16 copy (the residual gradient the branches read):
    // the same dx and dw, and a copy equal to dx rounded to bf16.
    cuda::rms_norm_backward_mixed(x.dev->raw(), x_dtype, ptr<float>(w_dev), ptr<float>(rstd_dev),
                                  ptr<uint16_t>(dy_dev), rows, cols, dx_dev->raw(), accumulate, ptr<float>(dw_dev),
                                  run == 1 ? ptr<uint16_t>(dx_copy) : nullptr);
    dx_runs[run] = x_bf16 ? bf16_values(download<uint16_t>(*dx_dev)) : download<float>(*dx_dev);
    dw_runs[run] = download<float>(*dw_dev);
  }
  EXPECT_TRUE(download<uint16_t>(*dx_copy) == to_bf16(dx_runs[1])) << "dx_copy is not dx rounded to bf16";

  expect_values_close("dx", dx_runs[0], dx_ref, x_bf16 ? kBf16Tol : kF32GradTol, dx_scale);
  expect_values_close("dw", dw_runs[0], dw_ref, kF32GradTol, dw_scale);
  EXPECT_TRUE(std::memcmp(dx_runs[0].data(), dx_runs[1].data(), n * sizeof(float)) == 0)
      << "dx differs between two identical runs";
  EXPECT_TRUE(std::memcmp(dw_runs[0].data(), dw_runs[1].data(), nc * sizeof(float)) == 0)
      << "dw differs between two identical runs";
}

// rows, cols, x is bf16, accumulate dx. The mixed path uses fp32 += (residual gradient)
// and bf16 = (q/k norm); the other two combinations are covered too.
using BackwardParam = std::tuple<int64_t, int64_t, bool, bool>;

class RmsNormMixedBackward : public GpuTest, public ::testing::WithParamInterface<BackwardParam> {};

TEST_P(RmsNormMixedBackward, MatchesReferenceAndIsDeterministic) {
  const auto [rows, cols, x_bf16, accumulate] = GetParam();
  check_rms_backward(rows, cols, x_bf16, accumulate);
}

std::string backward_name(const ::testing::TestParamInfo<BackwardParam>& info) {
  const auto& [rows, cols, x_bf16, accumulate] = info.param;
  return fmt::format("r{}_c{}_x{}_{}", rows, cols, x_bf16 ? "bf16" : "f32", accumulate ? "acc" : "set");
}
INSTANTIATE_TEST_SUITE_P(Sizes, RmsNormMixedBackward,
                         ::testing::Combine(kRows, kCols, ::testing::Bool(), ::testing::Bool()), backward_name);

// Many rows per block (each block's groups loop over its rows before the partial sums),
// block counts capped by the dw scratch, and a row long enough to need the shared-memory
// opt-in (16384 fp32 sums).
INSTANTIATE_TEST_SUITE_P(ManyRows, RmsNormMixedBackward,
                         ::testing::Values(BackwardParam{5000, 2048, false, true}, BackwardParam{70001, 64, true, false},
                                           BackwardParam{20000, 768, false, true}, BackwardParam{3000, 4096, false, true},
                                           BackwardParam{3, 16384, false, true}, BackwardParam{2100, 13, true, true}),
                         backward_name);

// ---- rope ------------------------------------------------------------------------------------------

// fp32 tables [max_pos, half] as the model fills them (HF rotate_half, theta 1e4).
void rope_tables(int64_t max_pos, int64_t half, std::vector<float>& cos_t, std::vector<float>& sin_t) {
  cos_t.resize(static_cast<size_t>(max_pos * half));
  sin_t.resize(cos_t.size());
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t j = 0; j < half; ++j) {
      const double angle = static_cast<double>(p) * std::pow(10000.0, -static_cast<double>(j) / static_cast<double>(half));
      cos_t[static_cast<size_t>(p * half + j)] = static_cast<float>(std::cos(angle));
      sin_t[static_cast<size_t>(p * half + j)] = static_cast<float>(std::sin(angle));
    }
}

// x [n, heads, 2 * half] rotated in fp64 by the fp32 table values; floors[i] = 1% of the
// norm of i's pair (x_j, x_{j + half}) of the input.
void rope_reference(const std::vector<float>& x, const std::vector<int32_t>& pos, const std::vector<float>& cos_t,
                    const std::vector<float>& sin_t, int64_t n, int64_t heads, int64_t half, bool inverse,
                    std::vector<double>& out, std::vector<double>& pair_norm) {
  out.assign(x.size(), 0.0);
  pair_norm.assign(x.size(), 0.0);
  const double sign = inverse ? -1.0 : 1.0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < half; ++j) {
        const size_t a = static_cast<size_t>((i * heads + h) * 2 * half + j), b = a + static_cast<size_t>(half);
        const size_t t = static_cast<size_t>(pos[static_cast<size_t>(i)] * half + j);
        const double c = cos_t[t], s = sign * sin_t[t], x1 = x[a], x2 = x[b];
        out[a] = x1 * c - x2 * s;
        out[b] = x2 * c + x1 * s;
        pair_norm[a] = pair_norm[b] = std::sqrt(x1 * x1 + x2 * x2);
      }
}

TEST_F(Bf16Kernels, RopeForwardInverseAndReference) {
  const int64_t max_pos = 4096;
  // n, heads, half: vector path (half 32, 64) and scalar path (half 4, 5).
  for (auto [n, heads, half] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 32}, {37, 3, 64}, {1000, 4, 64},
                                {300, 2, 32}, {37, 3, 4}, {13, 5, 5}}) {
    SCOPED_TRACE(fmt::format("n={} heads={} half={}", n, heads, half));
    std::vector<float> cos_t, sin_t;
    rope_tables(max_pos, half, cos_t, sin_t);
    Rng rng(static_cast<uint64_t>(n * heads * half));
    std::vector<int32_t> pos(static_cast<size_t>(n));
    for (int32_t& p : pos) p = static_cast<int32_t>(rng.below(max_pos));
    const size_t count = static_cast<size_t>(n * heads * 2 * half);
    const std::vector<uint16_t> x = random_bf16(count, 60 + count);
    const std::vector<float> xv = bf16_values(x);
    OwnedTensor x_dev = upload(x), pos_dev = upload(pos), cos_dev = upload(cos_t), sin_dev = upload(sin_t);

    // Forward, in place.
    cuda::rope_apply_bf16(ptr<uint16_t>(x_dev), ptr<int32_t>(pos_dev), ptr<float>(cos_dev), ptr<float>(sin_dev), n,
                          heads, half, false);
    const std::vector<uint16_t> y = download<uint16_t>(*x_dev);
    std::vector<double> y_ref, norms;
    rope_reference(xv, pos, cos_t, sin_t, n, heads, half, false, y_ref, norms);
    std::vector<double> floors(count);
    for (size_t i = 0; i < count; ++i) floors[i] = kFloorFraction * norms[i];
    expect_bf16_close("rope", y, y_ref, kBf16Tol, 0, &floors);

    // Inverse of the GPU's output: against the reference inverse of the same bf16 values,
    // and against the original input (judged against the pair's norm: see the table).
    cuda::rope_apply_bf16(ptr<uint16_t>(x_dev), ptr<int32_t>(pos_dev), ptr<float>(cos_dev), ptr<float>(sin_dev), n,
                          heads, half, true);
    const std::vector<uint16_t> back = download<uint16_t>(*x_dev);
    std::vector<double> back_ref, y_norms;
    rope_reference(bf16_values(y), pos, cos_t, sin_t, n, heads, half, true, back_ref, y_norms);
    for (size_t i = 0; i < count; ++i) floors[i] = kFloorFraction * y_norms[i];
    expect_bf16_close("rope inverse", back, back_ref, kBf16Tol, 0, &floors);
    expect_bf16_close("rope then inverse", back, widen(xv), kBf16Tol, 0, &norms);
  }
}

// ---- q|k|v shuffle -----------------------------------------------------------------------------------

TEST_F(Bf16Kernels, QkvShuffleBothWaysIsExact) {
  // n, q_cols, kv_cols: vector path (multiples of 8) and scalar path.
  for (auto [n, q_cols, kv_cols] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 32}, {37, 768, 256}, {1000, 128, 64},
                                    {29, 48, 16}, {29, 12, 4}, {7, 13, 5}}) {
    SCOPED_TRACE(fmt::format("n={} q_cols={} kv_cols={}", n, q_cols, kv_cols));
    const int64_t cols = q_cols + 2 * kv_cols;
    const size_t nq = static_cast<size_t>(n * q_cols), nkv = static_cast<size_t>(n * kv_cols);
    const std::vector<uint16_t> fused = random_bf16(static_cast<size_t>(n * cols), 70 + cols);
    std::vector<uint16_t> q_ref(nq), k_ref(nkv), v_ref(nkv);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t value = fused[static_cast<size_t>(i * cols + c)];
        if (c < q_cols) q_ref[static_cast<size_t>(i * q_cols + c)] = value;
        else if (c < q_cols + kv_cols) k_ref[static_cast<size_t>(i * kv_cols + c - q_cols)] = value;
        else v_ref[static_cast<size_t>(i * kv_cols + c - q_cols - kv_cols)] = value;
      }

    OwnedTensor fused_dev = upload(fused), q = poisoned<uint16_t>(nq), k = poisoned<uint16_t>(nkv),
                v = poisoned<uint16_t>(nkv);
    cuda::qkv_shuffle_bf16(ptr<uint16_t>(fused_dev), ptr<uint16_t>(q), ptr<uint16_t>(k), ptr<uint16_t>(v), n, q_cols,
                           kv_cols, true);
    EXPECT_TRUE(download<uint16_t>(*q) == q_ref);
    EXPECT_TRUE(download<uint16_t>(*k) == k_ref);
    EXPECT_TRUE(download<uint16_t>(*v) == v_ref);

    OwnedTensor merged = poisoned<uint16_t>(fused.size());
    cuda::qkv_shuffle_bf16(ptr<uint16_t>(merged), ptr<uint16_t>(q), ptr<uint16_t>(k), ptr<uint16_t>(v), n, q_cols,
                           kv_cols, false);
    EXPECT_TRUE(download<uint16_t>(*merged) == fused);
  }
}

// ---- swiglu ------------------------------------------------------------------------------------------

TEST_F(Bf16Kernels, SwigluForwardBackward) {
  for (auto [n, f] : {std::pair<int64_t, int64_t>{1, 64}, {37, 768}, {1000, 1000}, {3, 2048}, {37, 13}, {5, 1001}}) {
    SCOPED_TRACE(fmt::format("n={} f={}", n, f));
    const size_t nf = static_cast<size_t>(n * f);
    const std::vector<uint16_t> gu = random_bf16(2 * nf, 80 + nf, 2.0), dout = random_bf16(nf, 81 + nf);
    const std::vector<float> guv = bf16_values(gu), dv = bf16_values(dout);
    std::vector<double> out_ref(nf), dgu_ref(2 * nf);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j) {
        const size_t gi = static_cast<size_t>(i * 2 * f + j), ui = gi + static_cast<size_t>(f);
        const size_t oi = static_cast<size_t>(i * f + j);
        const double g = guv[gi], u = guv[ui], dy = dv[oi], s = 1.0 / (1.0 + std::exp(-g));
        out_ref[oi] = g * s * u;
        dgu_ref[gi] = dy * u * s * (1.0 + g * (1.0 - s));
        dgu_ref[ui] = dy * g * s;
      }
    OwnedTensor gu_dev = upload(gu), dout_dev = upload(dout), out = poisoned<uint16_t>(nf),
                dgu = poisoned<uint16_t>(2 * nf);
    cuda::swiglu_forward_bf16(ptr<uint16_t>(gu_dev), n, f, ptr<uint16_t>(out));
    cuda::swiglu_backward_bf16(ptr<uint16_t>(gu_dev), ptr<uint16_t>(dout_dev), n, f, ptr<uint16_t>(dgu), nullptr);
    expect_bf16_close("swiglu", download<uint16_t>(*out), out_ref, kBf16Tol);
    expect_bf16_close("swiglu dgate_up", download<uint16_t>(*dgu), dgu_ref, kBf16Tol);
    // The backward that also rebuilds the output over dout (the MLP's recompute): the same
    // gradient, and the output bit for bit as the forward wrote it.
    OwnedTensor dgu2 = poisoned<uint16_t>(2 * nf);
    cuda::swiglu_backward_bf16(ptr<uint16_t>(gu_dev), ptr<uint16_t>(dout_dev), n, f, ptr<uint16_t>(dgu2),
                               ptr<uint16_t>(dout_dev));
    EXPECT_TRUE(download<uint16_t>(*dgu2) == download<uint16_t>(*dgu));
    EXPECT_TRUE(download<uint16_t>(*dout_dev) == download<uint16_t>(*out));
  }
}

// ---- cross-entropy -------------------------------------------------------------------------------------

struct CeOptions {
  float z_loss = 0, loss_scale = 1, softcap = 0;
};

// The reference of one row (fp64 from the fp32 logits): stats {loss, lse^2}, the gradient
// and the floors of its elements (1% of |p * zfactor| + [target], times the chain factors).
struct CeRow {
  double loss = 0, lse_sq = 0, loss_floor = 0;
  std::vector<double> grad, floors;
};

// logsumexp of a row after the softcap.
double ce_lse(const float* x, int64_t vocab, double cap) {
  double m = -INFINITY;
  std::vector<double> xc(static_cast<size_t>(vocab));
  for (int64_t j = 0; j < vocab; ++j) {
    xc[static_cast<size_t>(j)] = cap > 0 ? cap * std::tanh(x[j] / cap) : x[j];
    m = std::max(m, xc[static_cast<size_t>(j)]);
  }
  double sum = 0;
  for (double v : xc) sum += std::exp(v - m);
  return m + std::log(sum);
}

CeRow ce_reference(const float* x, int64_t vocab, int32_t target, const CeOptions& o, bool with_grad, double lse) {
  CeRow row;
  if (with_grad) {
    row.grad.assign(static_cast<size_t>(vocab), 0.0);
    row.floors.assign(static_cast<size_t>(vocab), 0.0);
  }
  if (target < 0) return row;
  const double cap = o.softcap;
  auto capped = [&](int64_t j) { return cap > 0 ? cap * std::tanh(x[j] / cap) : static_cast<double>(x[j]); };
  const double tl = capped(target);
  row.loss = lse - tl;
  row.lse_sq = lse * lse;
  row.loss_floor = std::fabs(lse) + std::fabs(tl);
  if (!with_grad) return row;
  const double zfactor = 1.0 + 2.0 * o.z_loss * lse;
  for (int64_t j = 0; j < vocab; ++j) {
    const double xc = capped(j), p = std::exp(xc - lse) * zfactor, hot = j == target ? 1.0 : 0.0;
    const double chain = (cap > 0 ? 1.0 - (xc / cap) * (xc / cap) : 1.0) * o.loss_scale;
    row.grad[static_cast<size_t>(j)] = (p - hot) * chain;
    row.floors[static_cast<size_t>(j)] = kFloorFraction * (std::fabs(p) + hot) * std::fabs(chain);
  }
  return row;
}

std::vector<int32_t> ce_targets(int64_t rows, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    t[static_cast<size_t>(r)] = r % 4 == 1 ? -1 : static_cast<int32_t>((r * 7919 + 13) % vocab);
  return t;
}

// The reference of a whole chunk: row_stats and the gradient with their floors.
struct CeChunk {
  std::vector<double> stats, stats_floor, grad, grad_floor;
};

CeChunk ce_chunk_reference(const std::vector<float>& logits, const std::vector<int32_t>& targets, int64_t rows,
                           int64_t vocab, const CeOptions& o, bool grad) {
  CeChunk c;
  c.stats.resize(static_cast<size_t>(2 * rows));
  c.stats_floor.resize(c.stats.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits.data() + r * vocab;
    const int32_t t = targets[static_cast<size_t>(r)];
    const CeRow ref = ce_reference(x, vocab, t, o, grad, t < 0 ? 0.0 : ce_lse(x, vocab, o.softcap));
    c.stats[static_cast<size_t>(2 * r)] = ref.loss;
    c.stats[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
    c.stats_floor[static_cast<size_t>(2 * r)] = ref.loss_floor;
    c.stats_floor[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
    c.grad.insert(c.grad.end(), ref.grad.begin(), ref.grad.end());
    c.grad_floor.insert(c.grad_floor.end(), ref.floors.begin(), ref.floors.end());
  }
  return c;
}

TEST_F(Bf16Kernels, CrossEntropyRows) {
  const CeOptions option_sets[] = {{0, 1, 0}, {1e-2f, 1.0f / 37, 0}, {0, 0.5f, 30}, {1e-3f, 1.0f / 3, 5}};
  // rows, vocab: vector path (1000, 50304, 65536) and scalar path (1001).
  for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{1, 1000}, {37, 1000}, {3, 50304}, {37, 50304}, {2, 65536},
                             {5, 1001}}) {
    for (const CeOptions& o : option_sets) {
      for (bool grad : {true, false}) {
        SCOPED_TRACE(fmt::format("rows={} vocab={} z={} scale={} softcap={} grad={}", rows, vocab, o.z_loss,
                                 o.loss_scale, o.softcap, grad));
        const size_t n = static_cast<size_t>(rows * vocab);
        const std::vector<float> logits = random_f32(n, 90 + n, 2.5);
        const std::vector<int32_t> targets = ce_targets(rows, vocab);
        OwnedTensor logits_dev = upload(logits), targets_dev = upload(targets);
        OwnedTensor stats_dev = poisoned<double>(static_cast<size_t>(2 * rows)), grad_dev = poisoned<uint16_t>(n);
        std::vector<double> stats_runs[2];
        std::vector<uint16_t> grad_runs[2];
        for (int run = 0; run < 2; ++run) {
          cuda::cross_entropy_rows_to_bf16(ptr<float>(logits_dev), ptr<int32_t>(targets_dev), rows, vocab, o.z_loss,
                                           o.loss_scale, o.softcap, grad, ptr<double>(stats_dev),
                                           ptr<uint16_t>(grad_dev));
          stats_runs[run] = download<double>(*stats_dev);
          grad_runs[run] = download<uint16_t>(*grad_dev);
        }
        EXPECT_TRUE(stats_runs[0] == stats_runs[1]) << "row_stats differ between two identical runs";
        EXPECT_TRUE(grad_runs[0] == grad_runs[1]) << "grad differs between two identical runs";
        EXPECT_TRUE(download<float>(*logits_dev) == logits) << "logits must be left as they were";

        const CeChunk ref = ce_chunk_reference(logits, targets, rows, vocab, o, grad);
        std::vector<float> stats_gpu(stats_runs[0].begin(), stats_runs[0].end());
        expect_values_close("row_stats", stats_gpu, ref.stats, kStatsTol, 0, &ref.stats_floor);
        for (int64_t r = 0; r < rows; ++r) {
          if (targets[static_cast<size_t>(r)] >= 0) continue;
          EXPECT_TRUE(stats_runs[0][static_cast<size_t>(2 * r)] == 0 && stats_runs[0][static_cast<size_t>(2 * r + 1)] == 0)
              << "ignored row " << r << " must have zero stats";
        }
        if (grad) {
          // Ignored rows: the reference is 0 with a zero floor, so only an exact 0 passes.
          expect_bf16_close("grad", grad_runs[0], ref.grad, kBf16Tol, 0, &ref.grad_floor);
        } else {
          const bool untouched = std::all_of(grad_runs[0].begin(), grad_runs[0].end(),
                                             [](uint16_t h) { return h == 0xFFFFu; });
          EXPECT_TRUE(untouched) << "grad=false must leave grad_out untouched";
        }
      }
    }
  }
}

// The in-place variant on bf16 logits (the LM head's mixed path): the same reference on
// the bf16-rounded logits; with grad the logits turn into the gradient, without it they
// are left as they were.
TEST_F(Bf16Kernels, CrossEntropyRowsInPlaceOnBf16Logits) {
  const CeOptions option_sets[] = {{0, 1, 0}, {1e-2f, 1.0f / 37, 0}, {1e-3f, 1.0f / 3, 5}};
  for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{37, 1000}, {3, 50304}, {5, 1001}}) {
    for (const CeOptions& o : option_sets) {
      for (bool grad : {true, false}) {
        SCOPED_TRACE(fmt::format("rows={} vocab={} z={} scale={} softcap={} grad={}", rows, vocab, o.z_loss,
                                 o.loss_scale, o.softcap, grad));
        const size_t n = static_cast<size_t>(rows * vocab);
        std::vector<float> logits = random_f32(n, 190 + n, 2.5);
        std::vector<uint16_t> bits(n);
        for (size_t i = 0; i < n; ++i) bits[i] = float_to_bf16(logits[i]), logits[i] = bf16_to_float(bits[i]);
        const std::vector<int32_t> targets = ce_targets(rows, vocab);
        OwnedTensor logits_dev = upload(bits), targets_dev = upload(targets);
        OwnedTensor stats_dev = poisoned<double>(static_cast<size_t>(2 * rows));
        cuda::cross_entropy_rows_bf16(ptr<uint16_t>(logits_dev), ptr<int32_t>(targets_dev), rows, vocab, o.z_loss,
                                      o.loss_scale, o.softcap, grad, ptr<double>(stats_dev));
        const std::vector<double> stats = download<double>(*stats_dev);
        const std::vector<uint16_t> out = download<uint16_t>(*logits_dev);
        const CeChunk ref = ce_chunk_reference(logits, targets, rows, vocab, o, grad);
        expect_values_close("row_stats", std::vector<float>(stats.begin(), stats.end()), ref.stats, kStatsTol, 0,
                            &ref.stats_floor);
        if (grad)
          expect_bf16_close("grad", out, ref.grad, kBf16Tol, 0, &ref.grad_floor);
        else
          EXPECT_TRUE(out == bits) << "grad=false must leave the logits as they were";
      }
    }
  }
}

// Decode-sized products (m = 1..9 rows against a weight): m <= kMaxSkinnyRows go to the
// skinny kernel of cuda::gemm, the rest to cuBLASLt: C = A B^T in f32 and bf16, and
// C = A B^T + C (beta 1). The reference sums the bf16 inputs' exact values in fp64; the
// f32 result is one fp32 dot product of k terms (judged against the terms' scale).
TEST_F(Bf16Kernels, SkinnyGemmMatchesReference) {
  const int64_t n = 1000, k = 1024;
  const std::vector<uint16_t> b = random_bf16(static_cast<size_t>(n * k), 7001);
  const std::vector<float> bv = bf16_values(b);
  OwnedTensor b_dev = upload(b);
  for (int64_t m : {1, 2, 3, 4, 5, 8, 9}) {
    for (bool f32_out : {true, false}) {
      for (float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(fmt::format("m={} {} beta={}", m, f32_out ? "f32" : "bf16", beta));
        const std::vector<uint16_t> a = random_bf16(static_cast<size_t>(m * k), 7100 + static_cast<uint64_t>(m));
        const std::vector<float> av = bf16_values(a);
        const std::vector<uint16_t> c0 = random_bf16(static_cast<size_t>(m * n), 7200 + static_cast<uint64_t>(m));
        const std::vector<float> c0v = bf16_values(c0);
        std::vector<double> ref(static_cast<size_t>(m * n)), scale(ref.size());
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0, terms = 0;
            for (int64_t i = 0; i < k; ++i) {
              const double t = static_cast<double>(av[static_cast<size_t>(r * k + i)]) * bv[static_cast<size_t>(j * k + i)];
              sum += t, terms += std::fabs(t);
            }
            ref[static_cast<size_t>(r * n + j)] = sum + beta * c0v[static_cast<size_t>(r * n + j)];
            scale[static_cast<size_t>(r * n + j)] = 1e-2 * (terms + std::fabs(c0v[static_cast<size_t>(r * n + j)]));
          }
        OwnedTensor a_dev = upload(a);
        if (f32_out) {
          OwnedTensor c_dev = upload(c0v);
          cuda::gemm(false, true, m, n, k, 1.0f, ptr<uint16_t>(a_dev), k, ptr<uint16_t>(b_dev), k, DType::bf16, beta,
                     ptr<float>(c_dev), n, DType::f32);
          expect_values_close("skinny gemm f32", download<float>(*c_dev), ref, 1e-3, 0, &scale);
        } else {
          OwnedTensor c_dev = upload(c0);
          cuda::gemm(false, true, m, n, k, 1.0f, ptr<uint16_t>(a_dev), k, ptr<uint16_t>(b_dev), k, DType::bf16, beta,
                     ptr<uint16_t>(c_dev), n, DType::bf16);
          expect_bf16_close("skinny gemm bf16", download<uint16_t>(*c_dev), ref, kBf16Tol, 0, &scale);
        }
      }
    }
  }
}

// The decoder's fused projections (infer/decoder_cuda.h) on awkward shapes: one to eight
// rows (instantiations of 1, 2, 4 and 8), k of 64 (lanes idle), 1032 (k split unevenly
// over warps) and 4096 (64 KiB of staged rows at 8 rows, past the default shared-memory
// limit), column counts that leave partial tiles, few columns (k split over all 8 warps).
// The reference stages RMSNorm(x) * gain as bf16 on the host and sums in fp64.
TEST_F(Bf16Kernels, DecodeProjectionsMatchReference) {
  struct Case {
    int64_t m, n, k;
  };
  for (const Case cs : {Case{1, 1000, 1032}, Case{3, 40, 4096}, Case{8, 259, 64}, Case{5, 1000, 1032},
                        Case{8, 300, 4096}, Case{2, 7, 1032}}) {
    const int64_t m = cs.m, n = cs.n, k = cs.k;
    SCOPED_TRACE(fmt::format("m={} n={} k={}", m, n, k));
    const uint64_t seed = 9000 + static_cast<uint64_t>(m * 7 + n + k);
    const std::vector<float> x = random_f32(static_cast<size_t>(m * k), seed, 2.0);
    std::vector<float> gain = random_f32(static_cast<size_t>(k), seed + 1, 0.1);
    for (float& g : gain) g += 1.0f;
    const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(2 * n * k), seed + 2);  // [2n, k]: gate | up
    const std::vector<float> wv = bf16_values(w);
    // Host replica of the staged rows: bf16(x * inv * gain).
    std::vector<float> h(static_cast<size_t>(m * k));
    for (int64_t r = 0; r < m; ++r) {
      double ss = 0;
      for (int64_t c = 0; c < k; ++c) ss += static_cast<double>(x[r * k + c]) * x[r * k + c];
      const auto inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(k) + kEps));
      for (int64_t c = 0; c < k; ++c)
        h[r * k + c] = bf16_to_float(float_to_bf16(x[r * k + c] * inv * gain[c]));
    }
    // sums[r][j] and sum |terms| of the staged rows against W row j (j < 2n).
    auto dots = [&](const std::vector<float>& rows, std::vector<double>& sums, std::vector<double>& terms) {
      sums.assign(static_cast<size_t>(m * 2 * n), 0.0);
      terms.assign(sums.size(), 0.0);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < 2 * n; ++j)
          for (int64_t c = 0; c < k; ++c) {
            const double t = static_cast<double>(rows[r * k + c]) * wv[j * k + c];
            sums[r * 2 * n + j] += t, terms[r * 2 * n + j] += std::fabs(t);
          }
    };
    std::vector<double> sums, terms;
    dots(h, sums, terms);
    auto first_n = [&](const std::vector<double>& v) {  // columns 0..n-1 of [m, 2n]
      std::vector<double> out(static_cast<size_t>(m * n));
      for (int64_t r = 0; r < m; ++r) std::copy_n(v.begin() + r * 2 * n, n, out.begin() + r * n);
      return out;
    };
    const std::vector<double> ref = first_n(sums), floors = first_n(terms);
    OwnedTensor x_dev = upload(x), gain_dev = upload(gain), w_dev = upload(w);

    OwnedTensor f32_out = poisoned<float>(static_cast<size_t>(m * n));
    cuda::norm_gemv(DType::f32, ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                    ptr<float>(f32_out));
    const std::vector<float> first = download<float>(*f32_out);
    expect_values_close("norm_gemv f32", first, ref, 2e-4, 0, &floors);
    cuda::norm_gemv(DType::f32, ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                    ptr<float>(f32_out));
    EXPECT_EQ(std::memcmp(first.data(), download<float>(*f32_out).data(), first.size() * sizeof(float)), 0)
        << "norm_gemv is not bitwise repeatable";

    OwnedTensor bf16_out = poisoned<uint16_t>(static_cast<size_t>(m * n));
    cuda::norm_gemv(DType::bf16, ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                    ptr<uint16_t>(bf16_out));
    expect_bf16_close("norm_gemv bf16", download<uint16_t>(*bf16_out), ref, kBf16Tol, 0, &floors);

    // x0 [m, n] += bf16(a W^T), a bf16 rows (the attention output or SwiGLU activation).
    const std::vector<uint16_t> a = to_bf16(h);
    const std::vector<float> x0 = random_f32(static_cast<size_t>(m * n), seed + 3);
    OwnedTensor a_dev = upload(a), residual = upload(x0);
    cuda::gemv_add_residual(ptr<uint16_t>(a_dev), m, k, ptr<uint16_t>(w_dev), n, ptr<float>(residual));
    std::vector<double> added(ref.size()), added_floors(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) added[i] = x0[i] + ref[i], added_floors[i] = std::fabs(x0[i]) + floors[i];
    expect_values_close("gemv_add_residual", download<float>(*residual), added, kBf16Tol, 0, &added_floors);

    // SwiGLU of gate | up: W rows j and n + j.
    OwnedTensor act = poisoned<uint16_t>(static_cast<size_t>(m * n));
    cuda::norm_gemv_swiglu(ptr<float>(x_dev), ptr<float>(gain_dev), kEps, m, k, ptr<uint16_t>(w_dev), n,
                           ptr<uint16_t>(act));
    std::vector<double> act_ref(ref.size()), act_floors(ref.size());
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) {
        const size_t gi = static_cast<size_t>(r * 2 * n + j), ui = gi + static_cast<size_t>(n);
        const double g = sums[gi], u = sums[ui];
        act_ref[static_cast<size_t>(r * n + j)] = g / (1.0 + std::exp(-g)) * u;
        act_floors[static_cast<size_t>(r * n + j)] =
            std::fabs(g * u) + 1e-3 * (terms[gi] * std::fabs(u) + terms[ui] * std::fabs(g));
      }
    expect_bf16_close("norm_gemv_swiglu", download<uint16_t>(*act), act_ref, 2e-2, 0, &act_floors);
  }
}

// A chunk of more than 2^31 logits (32769 rows of 65536): offsets past 2^31 must not wrap.
// Rows repeat 8 patterns (doubling device copies), so the reference is cheap; the first
// and last rows are checked in full and every row's stats.
TEST_F(Bf16Kernels, CrossEntropyRowsBeyond2To31Logits) {
  const int64_t vocab = 65536, rows = 32769, patterns = 8;
  const size_t bytes_needed = static_cast<size_t>(rows * vocab) * (sizeof(float) + sizeof(uint16_t));
  size_t free_bytes = 0, total_bytes = 0;
  cuda_memory_info(&free_bytes, &total_bytes);
  if (free_bytes < bytes_needed + (size_t{1} << 30)) GTEST_SKIP() << "needs " << bytes_needed << " bytes of GPU memory";
  const CeOptions o{1e-4f, 1.0f / 1000, 30};

  const std::vector<float> base = random_f32(static_cast<size_t>(patterns * vocab), 123, 2.5);
  OwnedTensor logits_dev(DType::f32, Device::cuda, Shape{rows, vocab});
  float* logits = ptr<float>(logits_dev);
  device_copy(logits, Device::cuda, base.data(), Device::cpu, base.size() * sizeof(float));
  for (int64_t done = patterns; done < rows; done *= 2) {  // row r holds pattern r % 8
    const int64_t count = std::min(done, rows - done);
    device_copy(logits + done * vocab, Device::cuda, logits, Device::cuda, static_cast<size_t>(count * vocab) * 4);
  }
  std::vector<int32_t> targets(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    targets[static_cast<size_t>(r)] = r % 5 == 2 ? -1 : static_cast<int32_t>((r * 7919 + 13) % vocab);
  ASSERT_GE(targets.back(), 0);  // the last row, past 2^31, has a target
  OwnedTensor targets_dev = upload(targets), stats_dev = poisoned<double>(static_cast<size_t>(2 * rows));
  OwnedTensor grad_dev(DType::bf16, Device::cuda, Shape{rows, vocab});
  uint16_t* grad = ptr<uint16_t>(grad_dev);
  // Poison the rows that are checked in full: the first, and the last three (one ignored).
  const std::vector<int64_t> checked = {0, rows - 3, rows - 2, rows - 1};
  const std::vector<uint16_t> poison_row(static_cast<size_t>(vocab), 0xFFFFu);
  for (int64_t r : checked)
    device_copy(grad + r * vocab, Device::cuda, poison_row.data(), Device::cpu, poison_row.size() * 2);

  cuda::cross_entropy_rows_to_bf16(logits, ptr<int32_t>(targets_dev), rows, vocab, o.z_loss, o.loss_scale, o.softcap,
                                   true, ptr<double>(stats_dev), grad);

  std::vector<double> lse(static_cast<size_t>(patterns));
  for (int64_t p = 0; p < patterns; ++p) lse[static_cast<size_t>(p)] = ce_lse(base.data() + p * vocab, vocab, o.softcap);
  const std::vector<double> stats = download<double>(*stats_dev);
  std::vector<double> stats_ref(stats.size()), stats_floor(stats.size());
  for (int64_t r = 0; r < rows; ++r) {
    const CeRow ref = ce_reference(base.data() + r % patterns * vocab, vocab, targets[static_cast<size_t>(r)], o, false,
                                   lse[static_cast<size_t>(r % patterns)]);
    stats_ref[static_cast<size_t>(2 * r)] = ref.loss;
    stats_ref[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
    stats_floor[static_cast<size_t>(2 * r)] = ref.loss_floor;
    stats_floor[static_cast<size_t>(2 * r + 1)] = ref.lse_sq;
  }
  expect_values_close("row_stats", std::vector<float>(stats.begin(), stats.end()), stats_ref, kStatsTol, 0, &stats_floor);

  for (int64_t r : checked) {
    SCOPED_TRACE(fmt::format("row {}", r));
    std::vector<uint16_t> got(static_cast<size_t>(vocab));
    device_copy(got.data(), Device::cpu, grad + r * vocab, Device::cuda, got.size() * 2);
    const CeRow ref = ce_reference(base.data() + r % patterns * vocab, vocab, targets[static_cast<size_t>(r)], o, true,
                                   lse[static_cast<size_t>(r % patterns)]);
    expect_bf16_close("grad", got, ref.grad, kBf16Tol, 0, &ref.floors);
  }
}

}  // namespace
}  // namespace kiln
