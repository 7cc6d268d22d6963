// CUDA kernels against the CPU reference: each case runs one op through the ops:: front end
// on Device::cuda in fp32 and on Device::cpu in fp64 from the same fp32 inputs, and
// compares by max relative error under a per-output tolerance. GPU outputs are poisoned
// with NaN bytes before each run so an unwritten element fails; NaN/Inf never pass.
// Without a CUDA device every test skips (scripts/gpu_check.sh counts a skip as failure).
#include "core/device_memory.h"
#include "core/tensor.h"
#include "ops/rms_norm/rms_norm.h"
#include "gpu/gpu_harness.h"
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

using namespace gpu_test;

// Awkward sizes: one row, odd counts, rows not a multiple of a block's rows; columns
// below a warp, odd (scalar path), multiples of 4 (float4 path), above the warp-per-row
// limit (block per row).
const auto kRows = ::testing::Values<int64_t>(1, 3, 37, 1000);
const auto kCols = ::testing::Values<int64_t>(1, 7, 64, 100, 1536, 4099);
constexpr double kEps = 1e-6;

uint64_t seed_of(int64_t rows, int64_t cols, int salt) {
  return static_cast<uint64_t>(rows) * 1000003ull + static_cast<uint64_t>(cols) * 7919ull + salt;
}

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
