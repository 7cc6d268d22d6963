// CUDA kernels against the CPU reference: each case runs one op through the ops:: front end
// on Device::cuda in fp32 and on Device::cpu in fp64 from the same fp32 inputs, and
// compares by max relative error under a per-output tolerance. GPU outputs are poisoned
// with NaN bytes before each run so an unwritten element fails; NaN/Inf never pass.
// Without a CUDA device every test skips (scripts/gpu_check.sh counts a skip as failure).
#include "core/device_memory.h"
#include "core/tensor.h"
#include "ops/rms_norm/rms_norm.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace kiln {
namespace {

// ---- harness ---------------------------------------------------------------------------

// Tolerances for fp32 kernels against an fp64 reference, by output.
struct Tolerance {
  double forward = 1e-5;   // y, rstd: a row sum, then elementwise products
  double backward = 1e-4;  // dx (cancellation in g - x*coef), dw (long column sums)
};
constexpr Tolerance kF32;
// Elements smaller than this fraction of the output's scale are judged against it (an
// absolute error scaled to the magnitudes the kernel computes with), so rounding near
// zero crossings and in cancelling differences does not count as relative error, while a
// wrong element (off by O(scale)) still fails by orders of magnitude. The scale is the
// largest |ref| unless an op knows its terms are larger (a sum's sum of |terms|).
constexpr double kFloorFraction = 1e-2;

OwnedTensor to_device(const Tensor& host) {
  OwnedTensor dev(host.dtype(), Device::cuda, host.shape());
  copy_tensor(host, *dev);
  return dev;
}

OwnedTensor to_host(const Tensor& dev) {
  OwnedTensor host(dev.dtype(), Device::cpu, dev.shape());
  copy_tensor(dev, *host);
  return host;
}

// Fills a device tensor with 0xFF bytes (a NaN in every float).
void poison(const Tensor& dev) {
  std::vector<unsigned char> bytes(dev.nbytes(), 0xFF);
  copy_tensor(Tensor(bytes.data(), dev.dtype(), Device::cpu, dev.shape()), dev);
}

OwnedTensor to_f64(const Tensor& f32) {
  OwnedTensor out(DType::f64, Device::cpu, f32.shape());
  for (int64_t i = 0; i < f32.numel(); ++i) out->data<double>()[i] = f32.data<float>()[i];
  return out;
}

OwnedTensor to_f32(const Tensor& f64) {
  OwnedTensor out(DType::f32, Device::cpu, f64.shape());
  for (int64_t i = 0; i < f64.numel(); ++i) out->data<float>()[i] = static_cast<float>(f64.data<double>()[i]);
  return out;
}

// Checks a GPU result (copied to the host, f32) against an f64 reference; `scale` (when
// larger than the largest |ref|) sets the floor of the relative error's denominator.
void expect_close(const char* name, const Tensor& gpu_f32, const Tensor& ref_f64, double tolerance,
                  double scale = 0) {
  ASSERT_EQ(gpu_f32.numel(), ref_f64.numel()) << name;
  const float* a = gpu_f32.data<float>();
  const double* b = ref_f64.data<double>();
  const int64_t n = ref_f64.numel();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(b[i])) << name << ": reference is not finite at " << i;
    scale = std::max(scale, std::fabs(b[i]));
  }
  const double floor = std::max(kFloorFraction * scale, 1e-30);
  double worst = 0;
  int64_t worst_at = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(a[i])) << name << "[" << i << "] = " << a[i] << " (unwritten or overflow), ref "
                                     << b[i];
    const double err = std::fabs(a[i] - b[i]) / std::max(std::fabs(b[i]), floor);
    if (err > worst) worst = err, worst_at = i;
  }
  EXPECT_LE(worst, tolerance) << name << ": max relative error " << worst << " at " << worst_at << " (gpu "
                              << a[worst_at] << ", ref " << b[worst_at] << ")";
  ::testing::Test::RecordProperty(std::string(name) + "_max_rel_err", fmt::format("{:.3e}", worst));
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Awkward sizes: one row, odd counts, rows not a multiple of a block's rows; columns
// below a warp, odd (scalar path), multiples of 4 (float4 path), above the warp-per-row
// limit (block per row).
const auto kRows = ::testing::Values<int64_t>(1, 3, 37, 1000);
const auto kCols = ::testing::Values<int64_t>(1, 7, 64, 100, 1536, 4099);
constexpr double kEps = 1e-6;

uint64_t seed_of(int64_t rows, int64_t cols, int salt) {
  return static_cast<uint64_t>(rows) * 1000003ull + static_cast<uint64_t>(cols) * 7919ull + salt;
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device (kiln built with CUDA, but none is visible)";
  }
};

// ---- rms_norm ----------------------------------------------------------------------------

using ForwardParam = std::tuple<int64_t, int64_t, bool>;  // rows, cols, gain

class RmsNormForward : public GpuTest, public ::testing::WithParamInterface<ForwardParam> {};

TEST_P(RmsNormForward, MatchesReference) {
  const auto [rows, cols, gain] = GetParam();
  const Shape xs{rows, cols};
  OwnedTensor x = test::random_tensor(DType::f32, xs, seed_of(rows, cols, 1));
  OwnedTensor w = gain ? test::random_tensor(DType::f32, Shape{cols}, seed_of(rows, cols, 2)) : OwnedTensor();

  // Reference in f64 on the CPU.
  OwnedTensor x64 = to_f64(*x), w64 = gain ? to_f64(*w) : OwnedTensor();
  OwnedTensor y64(DType::f64, Device::cpu, xs), rstd64(DType::f64, Device::cpu, Shape{rows});
  ops::rms_norm_forward(*x64, w64.tensor, kEps, *y64, *rstd64);

  // fp32 on the GPU.
  OwnedTensor xd = to_device(*x), wd = gain ? to_device(*w) : OwnedTensor();
  OwnedTensor yd(DType::f32, Device::cuda, xs), rstdd(DType::f32, Device::cuda, Shape{rows});
  poison(*yd);
  poison(*rstdd);
  ops::rms_norm_forward(*xd, wd.tensor, kEps, *yd, *rstdd);
  OwnedTensor y = to_host(*yd), rstd = to_host(*rstdd);

  expect_close("y", *y, *y64, kF32.forward);
  expect_close("rstd", *rstd, *rstd64, kF32.forward);
}

std::string forward_name(const ::testing::TestParamInfo<ForwardParam>& info) {
  const auto& [rows, cols, gain] = info.param;
  return fmt::format("r{}_c{}_{}", rows, cols, gain ? "gain" : "nogain");
}
INSTANTIATE_TEST_SUITE_P(Sizes, RmsNormForward, ::testing::Combine(kRows, kCols, ::testing::Bool()), forward_name);

using BackwardParam = std::tuple<int64_t, int64_t, bool, bool>;  // rows, cols, gain, accumulate_dx

class RmsNormBackward : public GpuTest, public ::testing::WithParamInterface<BackwardParam> {};

TEST_P(RmsNormBackward, MatchesReferenceAndIsDeterministic) {
  const auto [rows, cols, gain, accumulate] = GetParam();
  const Shape xs{rows, cols};
  OwnedTensor x = test::random_tensor(DType::f32, xs, seed_of(rows, cols, 11));
  OwnedTensor dy = test::random_tensor(DType::f32, xs, seed_of(rows, cols, 12));
  OwnedTensor w = gain ? test::random_tensor(DType::f32, Shape{cols}, seed_of(rows, cols, 13)) : OwnedTensor();
  // Existing gradients: dx is added to when accumulating, dw always.
  OwnedTensor dx_init = test::random_tensor(DType::f32, xs, seed_of(rows, cols, 14));
  OwnedTensor dw_init = gain ? test::random_tensor(DType::f32, Shape{cols}, seed_of(rows, cols, 15)) : OwnedTensor();

  // rstd from an f64 forward, rounded to f32 so both sides read the same saved value.
  OwnedTensor x64 = to_f64(*x), w64 = gain ? to_f64(*w) : OwnedTensor();
  OwnedTensor y64(DType::f64, Device::cpu, xs), rstd64(DType::f64, Device::cpu, Shape{rows});
  ops::rms_norm_forward(*x64, w64.tensor, kEps, *y64, *rstd64);
  OwnedTensor rstd = to_f32(*rstd64);
  rstd64 = to_f64(*rstd);

  // Reference in f64 on the CPU.
  OwnedTensor dy64 = to_f64(*dy);
  OwnedTensor dx64 = accumulate ? to_f64(*dx_init) : OwnedTensor(DType::f64, Device::cpu, xs);
  OwnedTensor dw64 = gain ? to_f64(*dw_init) : OwnedTensor();
  ops::rms_norm_backward(*x64, w64.tensor, *rstd64, *dy64, *dx64, dw64.tensor, accumulate);

  // fp32 on the GPU, twice from the same state: results must match bit for bit.
  OwnedTensor xd = to_device(*x), dyd = to_device(*dy), rstdd = to_device(*rstd);
  OwnedTensor wd = gain ? to_device(*w) : OwnedTensor();
  OwnedTensor dxd(DType::f32, Device::cuda, xs), dwd = gain ? to_device(*dw_init) : OwnedTensor();
  OwnedTensor dx_runs[2], dw_runs[2];
  for (int run = 0; run < 2; ++run) {
    if (accumulate) copy_tensor(*dx_init, *dxd);
    else poison(*dxd);
    if (gain) copy_tensor(*dw_init, *dwd);
    ops::rms_norm_backward(*xd, wd.tensor, *rstdd, *dyd, *dxd, dwd.tensor, accumulate);
    dx_runs[run] = to_host(*dxd);
    if (gain) dw_runs[run] = to_host(*dwd);
  }

  // Scales: dx = r * (g - x * coef) + old cancels (fully when cols == 1), so its terms'
  // size is |old| + |r * g|; dw is a column sum, whose rounding scales with sum |terms|.
  double dx_scale = 0, dw_scale = 0;
  {
    const double *x_ = x64->data<double>(), *dy_ = dy64->data<double>(), *r_ = rstd64->data<double>();
    const double* w_ = gain ? w64->data<double>() : nullptr;
    const float* old_ = dx_init->data<float>();
    std::vector<double> column_abs(static_cast<size_t>(cols), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        const double g = dy_[i] * (w_ ? w_[c] : 1.0);
        dx_scale = std::max(dx_scale, std::fabs(r_[r] * g) + (accumulate ? std::fabs(old_[i]) : 0.0));
        column_abs[static_cast<size_t>(c)] += std::fabs(dy_[i] * x_[i] * r_[r]);
      }
    }
    for (int64_t c = 0; c < cols && gain; ++c)
      dw_scale = std::max(dw_scale, std::fabs(dw_init->data<float>()[c]) + column_abs[static_cast<size_t>(c)]);
  }

  expect_close("dx", *dx_runs[0], *dx64, kF32.backward, dx_scale);
  EXPECT_TRUE(same_bytes(*dx_runs[0], *dx_runs[1])) << "dx differs between two identical runs";
  if (gain) {
    expect_close("dw", *dw_runs[0], *dw64, kF32.backward, dw_scale);
    EXPECT_TRUE(same_bytes(*dw_runs[0], *dw_runs[1])) << "dw differs between two identical runs";
  }
}

std::string backward_name(const ::testing::TestParamInfo<BackwardParam>& info) {
  const auto& [rows, cols, gain, accumulate] = info.param;
  return fmt::format("r{}_c{}_{}_{}", rows, cols, gain ? "gain" : "nogain", accumulate ? "acc" : "set");
}
INSTANTIATE_TEST_SUITE_P(Sizes, RmsNormBackward,
                         ::testing::Combine(kRows, kCols, ::testing::Bool(), ::testing::Bool()), backward_name);

// A launch on a long row keeps working after many calls (no per-call allocation or state).
TEST_F(GpuTest, RmsNormRepeatedCallsAreStable) {
  const Shape xs{64, 8192};
  OwnedTensor x = test::random_tensor(DType::f32, xs, 99);
  OwnedTensor xd = to_device(*x), yd(DType::f32, Device::cuda, xs), rstdd(DType::f32, Device::cuda, Shape{64});
  ops::rms_norm_forward(*xd, Tensor(), kEps, *yd, *rstdd);
  OwnedTensor first = to_host(*yd);
  for (int i = 0; i < 100; ++i) ops::rms_norm_forward(*xd, Tensor(), kEps, *yd, *rstdd);
  OwnedTensor last = to_host(*yd);
  EXPECT_TRUE(same_bytes(*first, *last));
}

}  // namespace
}  // namespace kiln
