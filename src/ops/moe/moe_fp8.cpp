// The routed experts' grouped products in tensorwise FP8 (ops/moe/moe.h's
// moe_grouped_linear_fp8_*; docs/fp8.md). CPU: the emulation on dequantized f32 copies
// (fp8_linear_cpu.h's quantize_dequantize_tensorwise and gemm_rounded, so each output is an
// ascending-k sum of fp32-rounded products, as the dense FP8 layer's). GPU: the quantize
// steps of grouped_gemm_fp8_cuda.h and CUTLASS's FP8 grouped GEMM, or the bf16 ops where
// the host finds that FP8 cannot run (widths, alignment, build or device).
#include "core/error.h"
#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/fp8/fp8_linear_cpu.h"
#include "ops/moe/moe.h"

#if KILN_WITH_CUDA
#include "ops/moe/grouped_gemm_fp8_cuda.h"
#include "ops/moe/grouped_gemm_fp8_sm90.h"
#endif

#include <algorithm>
#include <cstdint>

namespace kiln::ops {

namespace {

constexpr const char* kForward = "moe_grouped_linear_fp8";
constexpr const char* kBackward = "moe_grouped_linear_fp8_backward";
constexpr size_t kAlign = 256;

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
size_t footprint(DType dtype, int64_t rows, int64_t cols) { return Workspace::footprint(dtype, Shape{rows, cols}); }

int64_t expert_out_width(const char* op, const Tensor& x, const Tensor& w, const MoeDispatch& d) {
  expect_rank(op, "x", x, 2);
  expect_rank(op, "w", w, 2);
  expect_same(op, "w", w, x);
  KILN_CHECK(d.experts > 0 && w.size(0) % d.experts == 0 && w.size(1) == x.size(1), op,
             "w {} for {} experts over x {}", w.describe(), d.experts, x.describe());
  expect_shape(op, "offsets", d.offsets, Shape{d.experts + 1});
  KILN_CHECK(d.offsets.device() == x.device() && d.offsets.dtype() == DType::i32, op, "offsets must be i32 on {}, got {}",
             device_name(x.device()), d.offsets.describe());
  return w.size(0) / d.experts;
}

// The GPU scratch, carved from one workspace tensor: the forward's operands first (x's codes
// [R, in], the weights' codes [E out, in] or their transposes, the scalars), then the
// backward's (dy's codes [R, out], the padded transposes of x and dy, the padded offsets).
struct GpuLayout {
  size_t x_codes = 0, w_codes = 0, scalars = 0, w_amax = 0, w_scale_inv = 0, forward_end = 0;
  size_t dy_codes = 0, xt = 0, dyt = 0, padded = 0, end = 0;
  int64_t ld = 0;
  GpuLayout(int64_t rows, int64_t experts, int64_t in, int64_t out) {
    size_t at = 0;
    auto place = [&](size_t bytes) {
      const size_t here = at;
      at = round_up(at + bytes);
      return here;
    };
    const size_t e = static_cast<size_t>(experts);
    x_codes = place(static_cast<size_t>(rows * in));
    w_codes = place(static_cast<size_t>(experts * out * in));
    scalars = place(4 * 16);  // x amax, x scale_inv, dy amax, dy scale_inv: 16 bytes each
    w_amax = place(e * sizeof(float));
    w_scale_inv = place(e * sizeof(float));
    forward_end = at;
    ld = (rows + 15 * experts + 15) / 16 * 16;  // cuda::grouped_fp8_padded_ld
    dy_codes = place(static_cast<size_t>(rows * out));
    xt = place(static_cast<size_t>(in * ld));
    dyt = place(static_cast<size_t>(out * ld));
    padded = place((e + 1) * sizeof(int32_t));
    end = at;
  }
};

// ---- CPU: the emulation ------------------------------------------------------------------

void forward_cpu(Workspace& workspace, const Tensor& x, const Tensor& w, const MoeDispatch& d, int64_t out,
                 const Tensor& y) {
  const int32_t* o = d.offsets.data<int32_t>();
  const int64_t in = x.size(1), live = o[d.experts];
  if (live == 0) return;
  Workspace::Scope scope(workspace);
  const Tensor xq = scope.take(DType::f32, Shape{live, in});
  const Tensor wt = scope.take(DType::f32, Shape{in, out});
  fp8::quantize_dequantize_tensorwise(x.data<float>(), live, in, fp8::Format::e4m3, xq.data<float>(), false, "x");
  for (int64_t e = 0; e < d.experts; ++e) {
    const int64_t n = o[e + 1] - o[e];
    if (n == 0) continue;
    fp8::quantize_dequantize_tensorwise(w.data<float>() + e * out * in, out, in, fp8::Format::e4m3, wt.data<float>(),
                                        true, "W");
    fp8::gemm_rounded(n, out, in, xq.data<float>() + o[e] * in, in, 1, wt.data<float>(), y.data<float>() + o[e] * out,
                      false, nullptr);
  }
}

void backward_cpu(Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& dy, const MoeDispatch& d,
                  int64_t out, const Tensor& dx, const Tensor& dw) {
  const int32_t* o = d.offsets.data<int32_t>();
  const int64_t in = x.size(1), live = o[d.experts];
  if (live == 0) return;
  Workspace::Scope scope(workspace);
  const Tensor dyq = scope.take(DType::f32, Shape{live, out});
  fp8::quantize_dequantize_tensorwise(dy.data<float>(), live, out, fp8::Format::e5m2, dyq.data<float>(), false, "dy");
  // x's copy before dx is written (dx may be x's place).
  Tensor xq;
  if (dw.defined()) {
    xq = scope.take(DType::f32, Shape{live, in});
    fp8::quantize_dequantize_tensorwise(x.data<float>(), live, in, fp8::Format::e4m3, xq.data<float>(), false, "x");
  }
  if (dx.defined()) {
    const Tensor wq = scope.take(DType::f32, Shape{out, in});
    for (int64_t e = 0; e < d.experts; ++e) {
      const int64_t n = o[e + 1] - o[e];
      if (n == 0) continue;
      fp8::quantize_dequantize_tensorwise(w.data<float>() + e * out * in, out, in, fp8::Format::e4m3,
                                          wq.data<float>(), false, "W");
      // dx_e [n, in] = dy_e [n, out] W_e [out, in].
      fp8::gemm_rounded(n, in, out, dyq.data<float>() + o[e] * out, out, 1, wq.data<float>(),
                        dx.data<float>() + o[e] * in, false, nullptr);
    }
  }
  if (dw.defined()) {
    const Tensor sum = scope.take(DType::f32, Shape{out, in});
    for (int64_t e = 0; e < d.experts; ++e) {
      const int64_t n = o[e + 1] - o[e];
      if (n == 0) continue;
      // dW_e [out, in] += dy_e^T [out, n] x_e [n, in]: A read transposed.
      fp8::gemm_rounded(out, in, n, dyq.data<float>() + o[e] * out, 1, out, xq.data<float>() + o[e] * in,
                        dw.data<float>() + e * out * in, true, sum.data<float>());
    }
  }
}

#if KILN_WITH_CUDA
uint8_t* aligned_base(const Tensor& scratch) {
  const auto p = reinterpret_cast<uintptr_t>(scratch.raw());
  return reinterpret_cast<uint8_t*>((p + kAlign - 1) / kAlign * kAlign);
}
#endif

}  // namespace

bool moe_grouped_linear_fp8_runs_fp8(Device device, int64_t in, int64_t out) {
  if (device == Device::cpu) return true;
#if KILN_WITH_CUDA
  return cuda::grouped_fp8_supported(in, out, {});
#else
  (void)in, (void)out;
  return false;
#endif
}

size_t moe_grouped_linear_fp8_scratch_bytes(Device device, int64_t rows, int64_t experts, int64_t in, int64_t out,
                                            bool training) {
  if (device == Device::cpu) {
    // forward: x's copy and one weight's; backward: dy's, x's, one weight's and dW's sum.
    const size_t forward = footprint(DType::f32, rows, in) + footprint(DType::f32, in, out);
    const size_t backward = footprint(DType::f32, rows, out) + footprint(DType::f32, rows, in) +
                            2 * footprint(DType::f32, out, in);
    return training ? std::max(forward, backward) : forward;
  }
  const GpuLayout layout(rows, experts, in, out);
  return Workspace::footprint(DType::u8, Shape{static_cast<int64_t>((training ? layout.end : layout.forward_end) + kAlign)});
}

void moe_grouped_linear_fp8_forward([[maybe_unused]] const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                    const MoeDispatch& d, const Tensor& y) {
  KILN_OP_SCOPE(kForward, x);
  const int64_t out = expert_out_width(kForward, x, w, d), rows = x.size(0);
  expect_same(kForward, "y", y, x);
  expect_shape(kForward, "y", y, Shape{rows, out});
  if (x.device() == Device::cuda) {
#if KILN_WITH_CUDA
    KILN_CHECK(x.dtype() == DType::bf16, kForward, "the GPU's FP8 experts read bf16, got {}", x.describe());
    const int64_t in = x.size(1);
    if (rows == 0) return;
    if (!cuda::grouped_fp8_supported(in, out, {x.raw(), w.raw(), y.raw()}))
      return moe_grouped_linear_forward(ctx, x, w, d, y);
    Workspace::Scope scope(workspace);
    const GpuLayout l(rows, d.experts, in, out);
    const Tensor scratch = scope.take(DType::u8, Shape{static_cast<int64_t>(l.forward_end + kAlign)});
    uint8_t* base = aligned_base(scratch);
    auto* scalars = reinterpret_cast<float*>(base + l.scalars);
    auto* w_amax = reinterpret_cast<float*>(base + l.w_amax);
    auto* w_scale_inv = reinterpret_cast<float*>(base + l.w_scale_inv);
    const int32_t* offsets = d.offsets.data<int32_t>();
    {
      KILN_OP_SCOPE("fp8_quantize", x);
      cuda::grouped_fp8_quantize_rows(ctx, static_cast<const cuda::bf16_bits*>(x.raw()), offsets, d.experts, rows, in,
                                      fp8::Format::e4m3, base + l.x_codes, scalars, scalars + 4);
      cuda::grouped_fp8_quantize_weights(ctx, static_cast<const cuda::bf16_bits*>(w.raw()), d.experts, in, out,
                                         base + l.w_codes, nullptr, w_amax, w_scale_inv);
    }
    cuda::sm90::grouped_fp8_forward(ctx, base + l.x_codes, scalars + 4, base + l.w_codes, w_scale_inv, offsets,
                                    d.experts, in, out, static_cast<cuda::bf16_bits*>(y.raw()));
    return;
#else
    no_cuda_kernel(kForward);
#endif
  }
  KILN_CHECK(x.dtype() == DType::f32, kForward, "the CPU's FP8 emulation reads f32, got {}", x.describe());
  forward_cpu(workspace, x, w, d, out, y);
}

void moe_grouped_linear_fp8_backward([[maybe_unused]] const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                     const Tensor& dy, const MoeDispatch& d, const Tensor& dx, const Tensor& dw) {
  KILN_OP_SCOPE(kBackward, dy);
  const int64_t out = expert_out_width(kBackward, x, w, d), rows = x.size(0);
  expect_same(kBackward, "dy", dy, x);
  expect_shape(kBackward, "dy", dy, Shape{rows, out});
  if (dx.defined()) expect_same(kBackward, "dx", dx, x), expect_shape(kBackward, "dx", dx, x.shape());
  if (dw.defined()) expect_tensor(kBackward, "dw", dw, w.shape(), DType::f32, x.device());
  if (dy.device() == Device::cuda) {
#if KILN_WITH_CUDA
    KILN_CHECK(dy.dtype() == DType::bf16, kBackward, "the GPU's FP8 experts read bf16, got {}", dy.describe());
    const int64_t in = x.size(1);
    if (rows == 0 || (!dx.defined() && !dw.defined())) return;
    if (!cuda::grouped_fp8_supported(in, out, {x.raw(), w.raw(), dy.raw(), dx.defined() ? dx.raw() : nullptr,
                                               dw.defined() ? dw.raw() : nullptr}))
      return moe_grouped_linear_backward(ctx, x, w, dy, d, dx, dw);
    Workspace::Scope scope(workspace);
    const GpuLayout l(rows, d.experts, in, out);
    const Tensor scratch = scope.take(DType::u8, Shape{static_cast<int64_t>(l.end + kAlign)});
    uint8_t* base = aligned_base(scratch);
    auto* scalars = reinterpret_cast<float*>(base + l.scalars);  // [0] x amax, [4] x scale_inv, [8], [12]: dy's
    auto* w_amax = reinterpret_cast<float*>(base + l.w_amax);
    auto* w_scale_inv = reinterpret_cast<float*>(base + l.w_scale_inv);
    auto* padded = reinterpret_cast<int32_t*>(base + l.padded);
    const int32_t* offsets = d.offsets.data<int32_t>();
    {
      KILN_OP_SCOPE("fp8_quantize", dy);
      const auto* dy_bf16 = static_cast<const cuda::bf16_bits*>(dy.raw());
      if (dw.defined()) {
        // Each operand cast once: dy's codes row-major (for dx) and transposed into the padded
        // K-major layout (for dW) from one pass, x's transposed only; x before dx is written
        // (dx may be x's place).
        cuda::grouped_fp8_padded_offsets(ctx, offsets, d.experts, padded);
        cuda::grouped_fp8_quantize_padded(ctx, dy_bf16, offsets, padded, d.experts, rows, out, l.ld, fp8::Format::e5m2,
                                          dx.defined() ? base + l.dy_codes : nullptr, base + l.dyt, scalars + 8,
                                          scalars + 12);
        cuda::grouped_fp8_quantize_padded(ctx, static_cast<const cuda::bf16_bits*>(x.raw()), offsets, padded,
                                          d.experts, rows, in, l.ld, fp8::Format::e4m3, nullptr, base + l.xt, scalars,
                                          scalars + 4);
      } else {
        cuda::grouped_fp8_quantize_rows(ctx, dy_bf16, offsets, d.experts, rows, out, fp8::Format::e5m2,
                                        base + l.dy_codes, scalars + 8, scalars + 12);
      }
      if (dx.defined())
        cuda::grouped_fp8_quantize_weights(ctx, static_cast<const cuda::bf16_bits*>(w.raw()), d.experts, in, out, nullptr,
                                           base + l.w_codes, w_amax, w_scale_inv);
    }
    if (dx.defined())
      cuda::sm90::grouped_fp8_backward_input(ctx, base + l.dy_codes, scalars + 12, base + l.w_codes, w_scale_inv,
                                             offsets, d.experts, in, out, static_cast<cuda::bf16_bits*>(dx.raw()));
    if (dw.defined())
      cuda::sm90::grouped_fp8_backward_weight(ctx, base + l.xt, scalars + 4, base + l.dyt, scalars + 12, offsets, padded,
                                              l.ld, d.experts, in, out, dw.data<float>());
    return;
#else
    no_cuda_kernel(kBackward);
#endif
  }
  KILN_CHECK(dy.dtype() == DType::f32, kBackward, "the CPU's FP8 emulation reads f32, got {}", dy.describe());
  backward_cpu(workspace, x, w, dy, d, out, dx, dw);
}

}  // namespace kiln::ops
