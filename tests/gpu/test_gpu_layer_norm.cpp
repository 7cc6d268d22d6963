// LayerNorm on the GPU through the ops:: front end, against the f64 CPU reference run on
// the same inputs: the fp32 path (x, y, dy, dx fp32) and the mixed path (x fp32 or bf16,
// y and dy bf16, dx of x's dtype, its bf16 copy), with every combination of gain and
// bias. Inputs read as bf16 are rounded to bf16 first, so both sides read identical
// numbers. Outputs are poisoned (NaN bytes) before each run and NaN/Inf never pass; every
// backward runs twice from the same state and must give the same bytes (dw and db are
// summed in a fixed order). Rows have means far from zero (the mean subtraction matters).
//
// Tolerances: max over elements of |gpu - ref| / max(|ref|, floor), the floor 1% of the
// output's scale (its largest |ref|, or the size of its terms where a row says so):
//   output                       tolerance  why
//   fp32 y                       1e-6 of    y = (x - mean) r w + b: an fp32 mean is off by a few
//                                the terms  ulps of |x|, not of |x - mean|, so with means of up to
//                                           ~10 std (as here) fp32 cannot do better than ~1e-5 of y
//                                           itself (measured: 7.6e-5 at 7 columns); judged instead
//                                           against the size of the terms max |x| r |w| + |b|
//                                           (measured on the H200: 1.2e-7); a wrong element is
//                                           off by O(1)
//   fp32 mean, rstd              1e-5       fp32 row sums of <= 16384 terms (mean against |x|)
//   fp32 dx                      1e-4       a row dot that cancels; floor from the terms'
//                                           size r (|g| + |mean g| + |xhat mean(g xhat)|) + |old|
//   dw, db (fp32, both paths)    1e-4       column sums over up to 70001 rows; floor from
//                                           |initial| + sum |terms|
//   bf16 y, bf16 dx              1e-2       one bf16 rounding (<= 2^-8 relative) over fp32 math
//   mixed mean, rstd, fp32 dx    as fp32    the same fp32 arithmetic on the same values
// Measured on the H200 (worst case of each): fp32 mean 2.6e-7, rstd 1.7e-7, dx 4.6e-6,
// dw 4.5e-6, db 2.9e-6; bf16 y and dx 3.9e-3 (= 2^-8, one rounding).
#include "core/device_memory.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "ops/elementwise/elementwise.h"
#include "ops/layer_norm/layer_norm.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

constexpr double kEps = 1e-5;
constexpr double kBf16Tol = 1e-2;
constexpr double kF32YTol = 1e-6;  // of the terms' size (see the top)

enum class Affine { none, gain, bias, gain_bias };
const auto kAffine = ::testing::Values(Affine::none, Affine::gain, Affine::bias, Affine::gain_bias);
const char* affine_name(Affine a) {
  switch (a) {
    case Affine::none: return "plain";
    case Affine::gain: return "gain";
    case Affine::bias: return "bias";
    case Affine::gain_bias: return "gainbias";
  }
  return "?";
}
bool has_gain(Affine a) { return a == Affine::gain || a == Affine::gain_bias; }
bool has_bias(Affine a) { return a == Affine::bias || a == Affine::gain_bias; }

uint64_t seed_of(int64_t rows, int64_t cols, int salt) {
  return static_cast<uint64_t>(rows) * 1000003ull + static_cast<uint64_t>(cols) * 7919ull + static_cast<uint64_t>(salt);
}

// The inputs of one case as f32 host tensors (gain and bias empty when absent): x has a
// per-row mean offset of N(0, 3) under unit noise. With bf16 = true, x and the other
// values the kernel reads in bf16 are rounded to bf16 first.
struct Inputs {
  int64_t rows, cols;
  OwnedTensor x, w, b;
  Inputs(int64_t r, int64_t c, Affine affine, bool x_bf16, uint64_t seed) : rows(r), cols(c) {
    x = test::random_tensor(DType::f32, Shape{rows, cols}, seed);
    Rng rng(seed ^ 0xabcdefull);
    for (int64_t i = 0; i < rows; ++i) {
      const float offset = static_cast<float>(3 * rng.normal());
      for (int64_t j = 0; j < cols; ++j) x->data<float>()[i * cols + j] += offset;
    }
    if (x_bf16) round_to_bf16(*x);
    if (has_gain(affine)) {
      w = test::random_tensor(DType::f32, Shape{cols}, seed + 1, 0.5);
      for (int64_t j = 0; j < cols; ++j) w->data<float>()[j] += 1.0f;
    }
    if (has_bias(affine)) b = test::random_tensor(DType::f32, Shape{cols}, seed + 2);
  }
  Shape shape() const { return Shape{rows, cols}; }
};

// An optional host tensor's f64 copy / device copy (empty stays empty).
OwnedTensor f64_or_none(const OwnedTensor& t) { return t->defined() ? to_f64(*t) : OwnedTensor(); }
OwnedTensor device_or_none(const OwnedTensor& t) { return t->defined() ? to_device(*t) : OwnedTensor(); }

OwnedTensor host_copy(const Tensor& t) {
  OwnedTensor c(t.dtype(), Device::cpu, t.shape());
  copy_tensor(t, *c);
  return c;
}

// The size of the terms the forward rounds: max over elements of |x| r |w|, plus max |b|
// (w, b empty: 1 and 0), with r each row's rstd.
double terms_scale(const Inputs& in, const Tensor& rstd64) {
  double w_max = 1, b_max = 0, scale = 0;
  if (in.w->defined()) {
    w_max = 0;
    for (int64_t c = 0; c < in.cols; ++c) w_max = std::max(w_max, std::fabs(static_cast<double>(in.w->data<float>()[c])));
  }
  if (in.b->defined())
    for (int64_t c = 0; c < in.cols; ++c) b_max = std::max(b_max, std::fabs(static_cast<double>(in.b->data<float>()[c])));
  for (int64_t r = 0; r < in.rows; ++r)
    for (int64_t c = 0; c < in.cols; ++c)
      scale = std::max(scale, std::fabs(static_cast<double>(in.x->data<float>()[r * in.cols + c])) *
                                  rstd64.data<double>()[r] * w_max);
  return scale + b_max;
}

// Checks an fp32 y against the size of its terms, a bf16 y against its own values.
void expect_y_close(const char* name, const Tensor& gpu_y, const Tensor& y64, bool bf16, double terms) {
  if (bf16) expect_close(name, gpu_y, y64, kBf16Tol);
  else expect_close(name, gpu_y, y64, kF32YTol, terms, 1.0);
}

double max_abs(const Tensor& f32) {
  double m = 0;
  for (int64_t i = 0; i < f32.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(f32.data<float>()[i])));
  return m;
}

// ---- forward ----------------------------------------------------------------------------

// rows, cols, affine, x dtype, y dtype (f32/f32: the fp32 path; y bf16: the mixed path).
using ForwardParam = std::tuple<int64_t, int64_t, Affine, DType, DType>;

void check_forward(const ForwardParam& p) {
  const auto [rows, cols, affine, x_dtype, y_dtype] = p;
  const Inputs in(rows, cols, affine, x_dtype == DType::bf16, seed_of(rows, cols, 1));
  OwnedTensor x64 = to_f64(*in.x), w64 = f64_or_none(in.w), b64 = f64_or_none(in.b);
  OwnedTensor y64(DType::f64, Device::cpu, in.shape()), mean64(DType::f64, Device::cpu, Shape{rows}),
      rstd64(DType::f64, Device::cpu, Shape{rows});
  ops::layer_norm_forward(process_exec(), *x64, w64.tensor, b64.tensor, kEps, *y64, *mean64, *rstd64);

  OwnedTensor xd = upload(*in.x, x_dtype), wd = device_or_none(in.w), bd = device_or_none(in.b);
  OwnedTensor yd = poisoned(y_dtype, in.shape()), meand = poisoned(DType::f32, Shape{rows}),
              rstdd = poisoned(DType::f32, Shape{rows});
  ops::layer_norm_forward(process_exec(), *xd, wd.tensor, bd.tensor, kEps, *yd, *meand, *rstdd);

  expect_y_close("y", *download_f32(*yd), *y64, y_dtype == DType::bf16, terms_scale(in, *rstd64));
  expect_close("mean", *to_host(*meand), *mean64, kF32.forward, max_abs(*in.x));  // judged against |x|
  expect_close("rstd", *to_host(*rstdd), *rstd64, kF32.forward);
}

std::string forward_name(const ::testing::TestParamInfo<ForwardParam>& info) {
  const auto& [rows, cols, affine, x_dtype, y_dtype] = info.param;
  return fmt::format("r{}_c{}_{}_x{}_y{}", rows, cols, affine_name(affine), dtype_name(x_dtype), dtype_name(y_dtype));
}

class LayerNormForward : public GpuTest, public ::testing::WithParamInterface<ForwardParam> {};
TEST_P(LayerNormForward, MatchesReference) { check_forward(GetParam()); }

// Awkward sizes: one row, odd counts, rows not a multiple of a block's rows; columns: 1
// (zero variance), 7 and 1001 and 4099 (scalar path, 8 threads / a block per row), 64 and
// 100 (8 and 16 threads per row), 768 and 1024 (warp per row), 2048 (block per row).
const auto kRows = ::testing::Values<int64_t>(1, 3, 37, 1000);
const auto kCols = ::testing::Values<int64_t>(1, 7, 64, 100, 768, 1001, 1024, 2048, 4099);
const auto kMixedRows = ::testing::Values<int64_t>(1, 37, 1000);
const auto kMixedCols = ::testing::Values<int64_t>(7, 64, 100, 768, 1001, 1024, 4099);

INSTANTIATE_TEST_SUITE_P(F32, LayerNormForward,
                         ::testing::Combine(kRows, kCols, kAffine, ::testing::Values(DType::f32),
                                            ::testing::Values(DType::f32)),
                         forward_name);
INSTANTIATE_TEST_SUITE_P(Mixed, LayerNormForward,
                         ::testing::Combine(kMixedRows, kMixedCols, kAffine, ::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(DType::bf16)),
                         forward_name);

// ---- backward ---------------------------------------------------------------------------

// rows, cols, affine, x dtype, y dtype (as ForwardParam), accumulate dx.
using BackwardParam = std::tuple<int64_t, int64_t, Affine, DType, DType, bool>;

void check_backward(const BackwardParam& p) {
  const auto [rows, cols, affine, x_dtype, y_dtype, accumulate] = p;
  const bool mixed = y_dtype == DType::bf16;
  const Inputs in(rows, cols, affine, x_dtype == DType::bf16, seed_of(rows, cols, 11));
  const Shape xs = in.shape();
  OwnedTensor dy = test::random_tensor(DType::f32, xs, seed_of(rows, cols, 12));
  OwnedTensor dx_init = test::random_tensor(DType::f32, xs, seed_of(rows, cols, 13));
  OwnedTensor dw_init = test::random_tensor(DType::f32, Shape{cols}, seed_of(rows, cols, 14));
  OwnedTensor db_init = test::random_tensor(DType::f32, Shape{cols}, seed_of(rows, cols, 15));
  if (mixed) round_to_bf16(*dy);
  if (x_dtype == DType::bf16) round_to_bf16(*dx_init);

  // mean and rstd from an f64 forward, rounded to f32 so both sides read the same values.
  OwnedTensor x64 = to_f64(*in.x), w64 = f64_or_none(in.w), b64 = f64_or_none(in.b);
  OwnedTensor y64(DType::f64, Device::cpu, xs), mean64(DType::f64, Device::cpu, Shape{rows}),
      rstd64(DType::f64, Device::cpu, Shape{rows});
  ops::layer_norm_forward(process_exec(), *x64, w64.tensor, b64.tensor, kEps, *y64, *mean64, *rstd64);
  OwnedTensor mean = to_f32(*mean64), rstd = to_f32(*rstd64);
  mean64 = to_f64(*mean);
  rstd64 = to_f64(*rstd);

  // Reference in f64.
  const bool gain = has_gain(affine), bias = has_bias(affine);
  OwnedTensor dy64 = to_f64(*dy);
  OwnedTensor dx64 = accumulate ? to_f64(*dx_init) : OwnedTensor(DType::f64, Device::cpu, xs);
  OwnedTensor dw64 = gain ? to_f64(*dw_init) : OwnedTensor(), db64 = bias ? to_f64(*db_init) : OwnedTensor();
  ops::layer_norm_backward(process_exec(), *x64, w64.tensor, *mean64, *rstd64, *dy64, *dx64, dw64.tensor, db64.tensor, accumulate);

  // The GPU twice from the same state; the second run also writes dx's bf16 copy (mixed).
  OwnedTensor xd = upload(*in.x, x_dtype), wd = device_or_none(in.w), dyd = upload(*dy, y_dtype);
  OwnedTensor meand = to_device(*mean), rstdd = to_device(*rstd);
  OwnedTensor dxd(x_dtype, Device::cuda, xs), dwd(DType::f32, Device::cuda, Shape{cols}),
      dbd(DType::f32, Device::cuda, Shape{cols});
  OwnedTensor copyd = mixed ? poisoned(DType::bf16, xs) : OwnedTensor();
  OwnedTensor dx_runs[2], dw_runs[2], db_runs[2];
  for (int run = 0; run < 2; ++run) {
    if (accumulate) copy_tensor(*upload(*dx_init, x_dtype), *dxd);
    else poison(*dxd);
    copy_tensor(*dw_init, *dwd);
    copy_tensor(*db_init, *dbd);
    const Tensor copy = run == 1 && mixed ? copyd.tensor : Tensor();
    ops::layer_norm_backward(process_exec(), *xd, wd.tensor, *meand, *rstdd, *dyd, *dxd, gain ? dwd.tensor : Tensor(),
                             bias ? dbd.tensor : Tensor(), accumulate, copy);
    dx_runs[run] = to_host(*dxd);
    dw_runs[run] = to_host(*dwd);
    db_runs[run] = to_host(*dbd);
  }
  if (mixed) {
    const OwnedTensor dx_f32 = x_dtype == DType::bf16 ? f32_of_bf16(*dx_runs[1]) : host_copy(*dx_runs[1]);
    EXPECT_TRUE(same_bytes(*to_host(*copyd), *bf16_of(*dx_f32))) << "dx_copy is not dx rounded to bf16";
  }

  // Scales: dx's terms r (|g| + |mean g| + |xhat mean(g xhat)|) (+ |old|); dw and db are
  // column sums, whose rounding scales with the sums of |terms| (+ |initial|).
  double dx_scale = 0, dw_scale = 0, db_scale = 0;
  {
    const double *x_ = x64->data<double>(), *dy_ = dy64->data<double>();
    const double *mu_ = mean64->data<double>(), *r_ = rstd64->data<double>();
    const double* w_ = gain ? w64->data<double>() : nullptr;
    std::vector<double> dw_abs(static_cast<size_t>(cols), 0.0), db_abs(static_cast<size_t>(cols), 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      double sum_g = 0, sum_gx = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double g = dy_[i * cols + c] * (w_ ? w_[c] : 1.0), xhat = (x_[i * cols + c] - mu_[i]) * r_[i];
        sum_g += g, sum_gx += g * xhat;
      }
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t k = i * cols + c;
        const double g = dy_[k] * (w_ ? w_[c] : 1.0), xhat = (x_[k] - mu_[i]) * r_[i];
        const double terms = r_[i] * (std::fabs(g) + std::fabs(sum_g / cols) + std::fabs(xhat * sum_gx / cols));
        dx_scale = std::max(dx_scale, terms + (accumulate ? std::fabs(dx_init->data<float>()[k]) : 0.0));
        dw_abs[static_cast<size_t>(c)] += std::fabs(dy_[k] * xhat);
        db_abs[static_cast<size_t>(c)] += std::fabs(dy_[k]);
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      dw_scale = std::max(dw_scale, std::fabs(dw_init->data<float>()[c]) + dw_abs[static_cast<size_t>(c)]);
      db_scale = std::max(db_scale, std::fabs(db_init->data<float>()[c]) + db_abs[static_cast<size_t>(c)]);
    }
  }
  const OwnedTensor dx0 = x_dtype == DType::bf16 ? f32_of_bf16(*dx_runs[0]) : host_copy(*dx_runs[0]);
  expect_close("dx", *dx0, *dx64, x_dtype == DType::bf16 ? kBf16Tol : kF32.backward, dx_scale);
  EXPECT_TRUE(same_bytes(*dx_runs[0], *dx_runs[1])) << "dx differs between two identical runs";
  if (gain) {
    expect_close("dw", *dw_runs[0], *dw64, kF32.backward, dw_scale);
    EXPECT_TRUE(same_bytes(*dw_runs[0], *dw_runs[1])) << "dw differs between two identical runs";
  } else {
    EXPECT_TRUE(same_bytes(*dw_runs[0], *dw_init)) << "dw written for a norm without gain";
  }
  if (bias) {
    expect_close("db", *db_runs[0], *db64, kF32.backward, db_scale);
    EXPECT_TRUE(same_bytes(*db_runs[0], *db_runs[1])) << "db differs between two identical runs";
  } else {
    EXPECT_TRUE(same_bytes(*db_runs[0], *db_init)) << "db written without a bias gradient";
  }
}

std::string backward_name(const ::testing::TestParamInfo<BackwardParam>& info) {
  const auto& [rows, cols, affine, x_dtype, y_dtype, accumulate] = info.param;
  return fmt::format("r{}_c{}_{}_x{}_y{}_{}", rows, cols, affine_name(affine), dtype_name(x_dtype),
                     dtype_name(y_dtype), accumulate ? "acc" : "set");
}

class LayerNormBackward : public GpuTest, public ::testing::WithParamInterface<BackwardParam> {};
TEST_P(LayerNormBackward, MatchesReferenceAndIsDeterministic) { check_backward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(F32, LayerNormBackward,
                         ::testing::Combine(kRows, kCols, kAffine, ::testing::Values(DType::f32),
                                            ::testing::Values(DType::f32), ::testing::Bool()),
                         backward_name);
INSTANTIATE_TEST_SUITE_P(Mixed, LayerNormBackward,
                         ::testing::Combine(kMixedRows, kMixedCols, kAffine,
                                            ::testing::Values(DType::f32, DType::bf16), ::testing::Values(DType::bf16),
                                            ::testing::Bool()),
                         backward_name);
// Many rows per block (each block's groups loop over their rows before the partial sums),
// block counts capped by the scratch, a row long enough to need the shared-memory opt-in
// (2 x 16384 fp32 sums), and the db-only layout.
INSTANTIATE_TEST_SUITE_P(
    ManyRows, LayerNormBackward,
    ::testing::Values(BackwardParam{5000, 2048, Affine::gain_bias, DType::f32, DType::bf16, true},
                      BackwardParam{70001, 64, Affine::gain_bias, DType::bf16, DType::bf16, false},
                      BackwardParam{20000, 1024, Affine::gain_bias, DType::f32, DType::bf16, true},
                      BackwardParam{3000, 4096, Affine::bias, DType::f32, DType::f32, true},
                      BackwardParam{3, 16384, Affine::gain_bias, DType::f32, DType::bf16, true},
                      BackwardParam{3, 16384, Affine::gain_bias, DType::f32, DType::f32, false},
                      BackwardParam{2100, 13, Affine::gain, DType::bf16, DType::bf16, true}),
    backward_name);

// ---- the fused residual add, views, refusals ---------------------------------------------

class LayerNormGpu : public GpuTest {};

// sum = a + branch, then the norm: the bits of ops::add followed by layer_norm_forward, on
// both paths (branch f32 with y f32; branch bf16 with y bf16).
TEST_F(LayerNormGpu, FusedAddMatchesAddThenNorm) {
  for (DType y_dtype : {DType::f32, DType::bf16})
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{37, 768}, {300, 1024}, {5, 1001}, {1, 64}}) {
      SCOPED_TRACE(fmt::format("y {} rows={} cols={}", dtype_name(y_dtype), rows, cols));
      const Inputs in(rows, cols, Affine::gain_bias, false, seed_of(rows, cols, 21));
      OwnedTensor branch = test::random_tensor(DType::f32, in.shape(), seed_of(rows, cols, 22));
      OwnedTensor a = to_device(*in.x), bd = upload(*branch, y_dtype), w = to_device(*in.w), b = to_device(*in.b);
      OwnedTensor sum_ref = poisoned(DType::f32, in.shape()), y_ref = poisoned(y_dtype, in.shape());
      OwnedTensor mean_ref = poisoned(DType::f32, Shape{rows}), rstd_ref = poisoned(DType::f32, Shape{rows});
      ops::add(process_exec(), *a, *bd, *sum_ref);
      ops::layer_norm_forward(process_exec(), *sum_ref, *w, *b, kEps, *y_ref, *mean_ref, *rstd_ref);
      OwnedTensor sum = poisoned(DType::f32, in.shape()), y = poisoned(y_dtype, in.shape());
      OwnedTensor mean = poisoned(DType::f32, Shape{rows}), rstd = poisoned(DType::f32, Shape{rows});
      ops::add_layer_norm_forward(process_exec(), *a, *bd, *w, *b, kEps, *sum, *y, *mean, *rstd);
      EXPECT_TRUE(same_bytes(*to_host(*sum), *to_host(*sum_ref))) << "sum differs from ops::add";
      EXPECT_TRUE(same_bytes(*to_host(*y), *to_host(*y_ref))) << "y differs from the unfused norm";
      EXPECT_TRUE(same_bytes(*to_host(*mean), *to_host(*mean_ref))) << "mean differs from the unfused norm";
      EXPECT_TRUE(same_bytes(*to_host(*rstd), *to_host(*rstd_ref))) << "rstd differs from the unfused norm";
    }
}

// Views one element into their buffers (not 16-byte aligned) take the scalar path with the
// reference's results, and write nothing before their start.
TEST_F(LayerNormGpu, UnalignedViewsTakeTheScalarPath) {
  const int64_t rows = 5, cols = 64, n = rows * cols;
  const Inputs in(rows, cols, Affine::gain_bias, false, 31);
  OwnedTensor x64 = to_f64(*in.x), w64 = to_f64(*in.w), b64 = to_f64(*in.b);
  OwnedTensor y64(DType::f64, Device::cpu, in.shape()), mean64(DType::f64, Device::cpu, Shape{rows}),
      rstd64(DType::f64, Device::cpu, Shape{rows});
  ops::layer_norm_forward(process_exec(), *x64, *w64, *b64, kEps, *y64, *mean64, *rstd64);
  for (DType y_dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(y_dtype));
    OwnedTensor x_buf(DType::f32, Device::cuda, Shape{n + 1});
    copy_tensor(*in.x, Tensor(static_cast<float*>(x_buf->raw()) + 1, DType::f32, Device::cuda, in.shape()));
    OwnedTensor y_buf = poisoned(y_dtype, Shape{n + 1});
    const Tensor x(static_cast<float*>(x_buf->raw()) + 1, DType::f32, Device::cuda, in.shape());
    const Tensor y(static_cast<char*>(y_buf->raw()) + dtype_size(y_dtype), y_dtype, Device::cuda, in.shape());
    OwnedTensor w = to_device(*in.w), b = to_device(*in.b), mean = poisoned(DType::f32, Shape{rows}),
                rstd = poisoned(DType::f32, Shape{rows});
    ops::layer_norm_forward(process_exec(), x, *w, *b, kEps, y, *mean, *rstd);
    OwnedTensor y_host = download_f32(*y_buf);
    EXPECT_TRUE(std::isnan(y_host->data<float>()[0])) << "wrote before the start";
    const Tensor y_values(y_host->data<float>() + 1, DType::f32, Device::cpu, in.shape());
    expect_y_close("y", y_values, *y64, y_dtype == DType::bf16, terms_scale(in, *rstd64));
    expect_close("rstd", *to_host(*rstd), *rstd64, kF32.forward);
  }
}

// What no kernel takes is refused by the front end, naming the op and the operand.
TEST_F(LayerNormGpu, RefusesDtypesWithoutAKernel) {
  const Inputs in(4, 16, Affine::gain_bias, true, 41);
  OwnedTensor x = upload(*in.x, DType::bf16), w = to_device(*in.w), b = to_device(*in.b);
  OwnedTensor y = poisoned(DType::f32, in.shape()), mean = poisoned(DType::f32, Shape{4}),
              rstd = poisoned(DType::f32, Shape{4});
  const std::string e = test::error_of([&] { ops::layer_norm_forward(process_exec(), *x, *w, *b, kEps, *y, *mean, *rstd); });
  EXPECT_EQ(e.rfind("[layer_norm] x must be f32 on the GPU", 0), 0u) << e;
  OwnedTensor w64 = to_device(*to_f64(*in.w));
  OwnedTensor y16 = poisoned(DType::bf16, in.shape());
  const std::string e2 = test::error_of([&] { ops::layer_norm_forward(process_exec(), *x, *w64, *b, kEps, *y16, *mean, *rstd); });
  EXPECT_EQ(e2.rfind("[layer_norm] w must be f32", 0), 0u) << e2;
}

}  // namespace
}  // namespace kiln
