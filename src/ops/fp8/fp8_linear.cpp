#include "ops/fp8/fp8_linear.h"

#include "core/error.h"
#include "core/op_profiler.h"
#include "ops/fp8/fp8_linear_cpu.h"
#include "ops/fp8/fp8_operand_checks.h"
#include "ops/linear/linear.h"

#if KILN_WITH_CUDA
#include "ops/fp8/fp8_gemm_cuda.h"
#include "ops/fp8/fp8_quantize_cuda.h"
#include "ops/linear/linear_cuda.h"
#endif

#include <algorithm>
#include <cmath>

namespace kiln::ops::fp8 {

namespace {

constexpr const char* kOp = "fp8_tensorwise";
constexpr int64_t kGemmMultiple = 16;  // cuBLASLt's FP8 rule (fp8_gemm_cuda.h)

size_t bytes(DType dtype, int64_t rows, int64_t cols) { return Workspace::footprint(dtype, Shape{rows, cols}); }

void expect_rows(const char* what, const Tensor& t, int64_t cols, DType dtype, Device device) {
  ops::fp8::expect_rows(kOp, what, t, cols, dtype, device);
}

void expect_kept(const Fp8KeptInput& kept, int64_t rows, int64_t in, Device device) {
  KILN_CHECK(kept.codes.device() == device && kept.codes.dtype() == fp8_kept_input_dtype(device) &&
                 kept.codes.rank() == 1 && kept.codes.numel() >= fp8_kept_input_elements(rows, in) &&
                 kept.scales.dtype() == DType::f32 && kept.scales.numel() == 2,
             kOp, "the kept input holds {} and {}, not {} [{} x {}] and f32 [2]", kept.codes.describe(),
             kept.scales.describe(), dtype_name(fp8_kept_input_dtype(device)), rows, in);
}

void expect_amax(const char* what, const Tensor& amax, Device device) {
  KILN_CHECK(!amax.defined() || (amax.dtype() == DType::f32 && amax.numel() == 1 && amax.device() == device), kOp,
             "{} must be one f32 on the {}, got {}", what, device_name(device), amax.describe());
}

// The CPU's emulation finds its own amax; one handed to it must be that value, which is
// what this checks (so the CPU tests check what a module hands the GPU's quantize).
void expect_amax_of(const char* what, const Tensor& amax, const Tensor& t) {
  if (!amax.defined()) return;
  const float* v = t.data<float>();
  float largest = 0;
  for (int64_t i = 0; i < t.numel(); ++i) largest = std::max(largest, std::fabs(v[i]));
  KILN_CHECK(*amax.data<float>() == largest, kOp, "{} is {}, but max |{}| is {}", what, *amax.data<float>(),
             what[0] == 'x' ? "x" : "dy", largest);
}

// ---- CPU: the emulation on dequantized f32 copies --------------------------------------

// The first `rows` rows of a kept buffer, as a [rows, cols] matrix.
Tensor kept_rows(const Tensor& buffer, int64_t rows, int64_t cols) {
  return buffer.rows(0, rows * cols).view(Shape{rows, cols});
}

void forward_cpu(Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y,
                 const Fp8KeptInput* keep) {
  const int64_t n = x.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  const Tensor xq = keep ? kept_rows(keep->codes, n, in) : scope.take(DType::f32, Shape{n, in});
  const Tensor wt = scope.take(DType::f32, Shape{in, out});
  quantize_dequantize_tensorwise(x.data<float>(), n, in, Format::e4m3, xq.data<float>(), false, "x");
  quantize_dequantize_tensorwise(w.data<float>(), out, in, Format::e4m3, wt.data<float>(), true, "W");
  // y [n, out]: y_ij = sum_p x_ip W_jp, B = W^T [in, out].
  gemm_rounded(n, out, in, xq.data<float>(), in, 1, wt.data<float>(), y.data<float>(), false, nullptr);
  if (bias.defined()) add_bias_rows(y.data<float>(), bias.data<float>(), n, out);
}

void backward_cpu(Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                  bool accumulate_dx, const Tensor& dw, const Fp8KeptInput* kept) {
  const int64_t n = dy.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  // Every operand is quantized before anything is written: dx may be x's place.
  const Tensor dyq = scope.take(DType::f32, Shape{n, out});
  quantize_dequantize_tensorwise(dy.data<float>(), n, out, Format::e5m2, dyq.data<float>(), false, "dy");
  Tensor xq;
  if (dw.defined() && kept) {
    xq = kept_rows(kept->codes, n, in);
  } else if (dw.defined()) {
    xq = scope.take(DType::f32, Shape{n, in});
    quantize_dequantize_tensorwise(x.data<float>(), n, in, Format::e4m3, xq.data<float>(), false, "x");
  }
  if (dx.defined()) {
    const Tensor wq = scope.take(DType::f32, Shape{out, in});
    quantize_dequantize_tensorwise(w.data<float>(), out, in, Format::e4m3, wq.data<float>(), false, "W");
    // dx [n, in] = dy [n, out] W [out, in].
    const Tensor sums = accumulate_dx ? scope.take(DType::f32, Shape{n, in}) : Tensor();
    gemm_rounded(n, in, out, dyq.data<float>(), out, 1, wq.data<float>(), dx.data<float>(), accumulate_dx,
                 sums.data_or_null<float>());
  }
  if (dw.defined()) {
    // dW [out, in] += dy^T [out, n] x [n, in]: A read down dy's columns.
    const Tensor sums = scope.take(DType::f32, Shape{out, in});
    gemm_rounded(out, in, n, dyq.data<float>(), 1, out, xq.data<float>(), dw.data<float>(), true, sums.data<float>());
  }
}

size_t scratch_cpu(int64_t t, int64_t in, int64_t out, bool training) {
  const DType f = DType::f32;
  const size_t forward = bytes(f, t, in) + bytes(f, in, out);
  // dy, x, W, then dx's and dW's sums.
  const size_t backward = bytes(f, t, out) + bytes(f, t, in) + bytes(f, out, in) + bytes(f, t, in) + bytes(f, out, in);
  return std::max(forward, training ? backward : 0);
}

// ---- GPU: quantize kernels and cuBLASLt's FP8 GEMM ----------------------------------------

// Each quantized operand's two device floats: scale_inv first (cuBLASLt wants it 16-byte
// aligned; workspace tensors are 256-byte aligned), then amax.
size_t scale_bytes() { return Workspace::footprint(DType::f32, Shape{2}); }

size_t scratch_cuda(int64_t t, int64_t in, int64_t out, bool training) {
  const DType u8 = DType::u8;
  const size_t forward = bytes(u8, t, in) + bytes(u8, out, in) + 2 * scale_bytes();
  // dy's codes and their transpose, W^T's codes, x^T's codes.
  const size_t backward = 2 * bytes(u8, t, out) + bytes(u8, in, out) + bytes(u8, in, t) + 3 * scale_bytes();
  return std::max(forward, training ? backward : 0);
}

#if KILN_WITH_CUDA

// One operand's codes (row-major and/or transposed, as asked) and scales, from the scope.
struct Quantized {
  Tensor codes, codes_t, scales;
  cuda::Fp8Operand operand(Format format) const {
    return {codes.data<uint8_t>(), format, cuda::kFp8Tensorwise, scales.data<float>()};
  }
  cuda::Fp8Operand operand_t(Format format) const {
    return {codes_t.data<uint8_t>(), format, cuda::kFp8Tensorwise, scales.data<float>()};
  }
};

// Writes q's codes (those defined) and scales from x; with its producer's `amax` given, the
// cast reads that instead of an amax pass over x (scales[1] is then left unwritten).
const Quantized& quantize_into(const ExecContext& ctx, const Tensor& x, Format format, const Quantized& q,
                               const Tensor& amax = Tensor()) {
  KILN_OP_SCOPE("fp8_quantize", x);  // inside fp8_linear's scopes: their quantize share
  float* scales = q.scales.data<float>();
  float* amax_at = amax.defined() ? amax.data<float>() : scales + 1;
  cuda::fp8_quantize_tensorwise(ctx, x.dtype(), x.raw(), x.size(0), x.size(1), format, q.codes.data_or_null<uint8_t>(),
                                q.codes_t.data_or_null<uint8_t>(), amax_at, scales, amax.defined());
  return q;
}

Quantized quantize(const ExecContext& ctx, Workspace::Scope& scope, const Tensor& x, Format format, bool row_major,
                   bool transposed, const Tensor& amax = Tensor()) {
  const int64_t rows = x.size(0), cols = x.size(1);
  Quantized q;
  if (row_major) q.codes = scope.take(DType::u8, Shape{rows, cols});
  if (transposed) q.codes_t = scope.take(DType::u8, Shape{cols, rows});
  q.scales = scope.take(DType::f32, Shape{2});
  return quantize_into(ctx, x, format, q, amax);
}

// x^T's codes and their scales in a kept buffer: x's weight-gradient operand.
Quantized kept_operand(const Fp8KeptInput& kept, int64_t rows, int64_t in) {
  Quantized q;
  q.codes_t = kept_rows(kept.codes, in, rows);
  q.scales = kept.scales;
  return q;
}

void forward_cuda(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& bias,
                  const Tensor& y, const Fp8KeptInput* keep, const Tensor& x_amax) {
  KILN_OP_SCOPE("fp8_linear", x);
  const int64_t n = x.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  Quantized xq;
  if (keep) {  // x's codes and, in the same pass, x^T's for the backward, under one scale
    xq = kept_operand(*keep, n, in);
    xq.codes = scope.take(DType::u8, Shape{n, in});
    quantize_into(ctx, x, Format::e4m3, xq, x_amax);
  } else {
    xq = quantize(ctx, scope, x, Format::e4m3, true, false, x_amax);
  }
  const Quantized wq = quantize(ctx, scope, w, Format::e4m3, true, false);
  if (bias.defined()) cuda::linear_broadcast_bias(ctx, bias.data<float>(), y.dtype(), n, out, y.raw());
  cuda::fp8_gemm(ctx, n, out, in, xq.operand(Format::e4m3), wq.operand(Format::e4m3), y.raw(), y.dtype(),
                 bias.defined());
}

void backward_cuda(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& dy,
                   const Tensor& dx, bool accumulate_dx, const Tensor& dw, const Fp8KeptInput* kept,
                   const Tensor& dy_amax) {
  KILN_OP_SCOPE("fp8_linear_backward", dy);
  const int64_t n = dy.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  // Every operand is quantized before anything is written: dx may be x's place. The
  // K-major operands: dx = dy [n, out] . (W^T) [in, out]^T and dW = (dy^T) [out, n] . (x^T) [in, n]^T.
  const Quantized dyq = quantize(ctx, scope, dy, Format::e5m2, dx.defined(), dw.defined(), dy_amax);
  Quantized xq;
  if (dw.defined()) xq = kept ? kept_operand(*kept, n, in) : quantize(ctx, scope, x, Format::e4m3, false, true);
  if (dx.defined()) {
    const Quantized wq = quantize(ctx, scope, w, Format::e4m3, false, true);
    cuda::fp8_gemm(ctx, n, in, out, dyq.operand(Format::e5m2), wq.operand_t(Format::e4m3), dx.raw(), dx.dtype(),
                   accumulate_dx);
  }
  if (dw.defined())
    cuda::fp8_gemm(ctx, out, in, n, dyq.operand_t(Format::e5m2), xq.operand_t(Format::e4m3), dw.raw(), dw.dtype(),
                   true);
}

#endif

}  // namespace

size_t fp8_linear_scratch_bytes(Device device, int64_t tokens, int64_t in, int64_t out, bool training) {
  return device == Device::cpu ? scratch_cpu(tokens, in, out, training) : scratch_cuda(tokens, in, out, training);
}

DType fp8_kept_input_dtype(Device device) { return device == Device::cpu ? DType::f32 : DType::u8; }

int64_t fp8_kept_input_elements(int64_t tokens, int64_t in) { return tokens * in; }

bool fp8_linear_runs_fp8(Device device, int64_t n, int64_t in, int64_t out) {
  return device == Device::cpu || (n % kGemmMultiple == 0 && in % kGemmMultiple == 0 && out % kGemmMultiple == 0);
}

void fp8_linear_forward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                        const Tensor& bias, const Tensor& y, const Fp8KeptInput* keep, const Tensor& x_amax) {
  const Device device = w.device();
  const DType dtype = fp8_layer_dtype(device);
  const int64_t in = w.size(1), out = w.size(0);
  expect_rows("W", w, in, dtype, device), expect_rows("x", x, in, dtype, device), expect_rows("y", y, out, dtype, device);
  KILN_CHECK(y.size(0) == x.size(0), kOp, "y has {} rows for {} rows of x", y.size(0), x.size(0));
  if (!fp8_linear_runs_fp8(device, x.size(0), in, out)) return ops::linear_forward(ctx, x, w, bias, y);
  if (keep) expect_kept(*keep, x.size(0), in, device);
  expect_amax("x_amax", x_amax, device);
  if (device == Device::cpu) {
    expect_amax_of("x_amax", x_amax, x);
    return forward_cpu(workspace, x, w, bias, y, keep);
  }
#if KILN_WITH_CUDA
  forward_cuda(ctx, workspace, x, w, bias, y, keep, x_amax);
#endif
}

void fp8_linear_backward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                         const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dw, const Tensor& dbias,
                         const Fp8KeptInput* kept, const Tensor& dy_amax) {
  const Device device = w.device();
  const DType dtype = fp8_layer_dtype(device);
  const int64_t n = dy.size(0), in = w.size(1), out = w.size(0);
  expect_rows("W", w, in, dtype, device), expect_rows("dy", dy, out, dtype, device);
  const Tensor weight_grad = x.defined() ? dw : Tensor();
  if (x.defined()) expect_rows("x", x, in, dtype, device);
  if (dx.defined()) expect_rows("dx", dx, in, dtype, device);
  if (!fp8_linear_runs_fp8(device, n, in, out))
    return ops::linear_backward(ctx, x.defined() ? x : dx, w, dy, dx, weight_grad, x.defined() ? dbias : Tensor(),
                                accumulate_dx);
  if (kept && weight_grad.defined()) expect_kept(*kept, n, in, device);
  expect_amax("dy_amax", dy_amax, device);
  if (device == Device::cpu) {
    expect_amax_of("dy_amax", dy_amax, dy);
    backward_cpu(workspace, x, w, dy, dx, accumulate_dx, weight_grad, kept);
  } else {
#if KILN_WITH_CUDA
    backward_cuda(ctx, workspace, x, w, dy, dx, accumulate_dx, weight_grad, kept, dy_amax);
#endif
  }
  // The bias's gradient from the unquantized dy, as the bf16 and f32 paths sum it.
  if (x.defined() && dbias.defined()) ops::linear_backward(ctx, x, w, dy, Tensor(), Tensor(), dbias);
}

}  // namespace kiln::ops::fp8
