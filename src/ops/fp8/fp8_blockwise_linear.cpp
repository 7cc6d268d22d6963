#include "ops/fp8/fp8_blockwise_linear.h"

#include "core/error.h"
#include "core/op_profiler.h"
#include "ops/fp8/fp8_linear_cpu.h"
#include "ops/fp8/fp8_operand_checks.h"
#include "ops/linear/linear.h"

#if KILN_WITH_CUDA
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/fp8/fp8_gemm_cuda.h"
#include "ops/fp8/fp8_quantize_cuda.h"
#include "ops/linear/linear_cuda.h"
#endif

#include <algorithm>

namespace kiln::ops::fp8 {

namespace {

constexpr const char* kOp = "fp8_blockwise";
constexpr int64_t kGemmMultiple = 128;  // every product's K is n, in or out: whole 128-blocks

size_t bytes(DType dtype, int64_t rows, int64_t cols) { return Workspace::footprint(dtype, Shape{rows, cols}); }

// ---- CPU: the emulation on dequantized f32 copies --------------------------------------

constexpr BlockShape kColumnTile{128, 1};  // x's and dy's tiles along the tokens (wgrad's K)

void forward_cpu(Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y) {
  const int64_t n = x.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  const Tensor xq = scope.take(DType::f32, Shape{n, in});
  const Tensor wt = scope.take(DType::f32, Shape{in, out});
  quantize_dequantize_blockwise(x.data<float>(), n, in, kActivationTile, Format::e4m3, xq.data<float>(), false, "x");
  quantize_dequantize_blockwise(w.data<float>(), out, in, kWeightBlock, Format::e4m3, wt.data<float>(), true, "W");
  // y [n, out]: y_ij = sum_p x_ip W_jp, B = W^T [in, out].
  gemm_rounded(n, out, in, xq.data<float>(), in, 1, wt.data<float>(), y.data<float>(), false, nullptr);
  if (bias.defined()) add_bias_rows(y.data<float>(), bias.data<float>(), n, out);
}

void backward_cpu(Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                  bool accumulate_dx, const Tensor& dw) {
  const int64_t n = dy.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  // Every operand is quantized before anything is written: dx may be x's place.
  Tensor dy_tiles, w_blocks, dy_columns, x_columns;
  if (dx.defined()) {
    dy_tiles = scope.take(DType::f32, Shape{n, out});
    w_blocks = scope.take(DType::f32, Shape{out, in});
    quantize_dequantize_blockwise(dy.data<float>(), n, out, kActivationTile, Format::e4m3, dy_tiles.data<float>(),
                                  false, "dy");
    quantize_dequantize_blockwise(w.data<float>(), out, in, kWeightBlock, Format::e4m3, w_blocks.data<float>(), false,
                                  "W");
  }
  if (dw.defined()) {
    dy_columns = scope.take(DType::f32, Shape{n, out});
    x_columns = scope.take(DType::f32, Shape{n, in});
    quantize_dequantize_blockwise(dy.data<float>(), n, out, kColumnTile, Format::e4m3, dy_columns.data<float>(),
                                  false, "dy");
    quantize_dequantize_blockwise(x.data<float>(), n, in, kColumnTile, Format::e4m3, x_columns.data<float>(), false,
                                  "x");
  }
  if (dx.defined()) {
    // dx [n, in] = dy [n, out] W [out, in].
    const Tensor sums = accumulate_dx ? scope.take(DType::f32, Shape{n, in}) : Tensor();
    gemm_rounded(n, in, out, dy_tiles.data<float>(), out, 1, w_blocks.data<float>(), dx.data<float>(), accumulate_dx,
                 sums.data_or_null<float>());
  }
  if (dw.defined()) {
    // dW [out, in] += dy^T [out, n] x [n, in]: A read down dy's columns.
    const Tensor sums = scope.take(DType::f32, Shape{out, in});
    gemm_rounded(out, in, n, dy_columns.data<float>(), 1, out, x_columns.data<float>(), dw.data<float>(), true,
                 sums.data<float>());
  }
}

size_t scratch_cpu(int64_t t, int64_t in, int64_t out, bool training) {
  const DType f = DType::f32;
  const size_t forward = bytes(f, t, in) + bytes(f, in, out);
  // dy's tiles, W's blocks, dy's and x's column tiles, then dx's and dW's sums.
  const size_t backward = 2 * bytes(f, t, out) + 2 * bytes(f, out, in) + 2 * bytes(f, t, in);
  return std::max(forward, training ? backward : 0);
}

// ---- GPU: blockwise quantize kernels and cuBLASLt's blockwise FP8 GEMM ---------------------

#if KILN_WITH_CUDA

size_t scale_bytes(int64_t rows, int64_t cols, BlockShape block) {
  return Workspace::footprint(DType::f32, Shape{cuda::blockwise_scale_count(rows, cols, block)});
}

size_t scratch_cuda(int64_t t, int64_t in, int64_t out, bool training) {
  const DType u8 = DType::u8;
  const size_t forward = bytes(u8, t, in) + scale_bytes(t, in, kActivationTile) + bytes(u8, out, in) +
                         scale_bytes(out, in, kWeightBlock);
  // dy's tiles and transposed column tiles, W^T's blocks (and W's own scales, which the
  // kernel writes beside them), x's transposed column tiles, and the weight gradient's bf16
  // product.
  const size_t backward = bytes(u8, t, out) + scale_bytes(t, out, kActivationTile) + bytes(u8, out, t) +
                          scale_bytes(out, t, kActivationTile) + bytes(u8, in, out) +
                          scale_bytes(in, out, kWeightBlock) + scale_bytes(out, in, kWeightBlock) + bytes(u8, in, t) +
                          scale_bytes(in, t, kActivationTile) + bytes(DType::bf16, out, in);
  return std::max(forward, training ? backward : 0);
}

// One operand's codes [rows, cols] and its scales in cuBLASLt's layout, from the scope.
struct Operand {
  Tensor codes, scales;
  BlockShape block;
  cuda::Fp8Operand gemm() const { return {codes.data<uint8_t>(), Format::e4m3, block, scales.data<float>()}; }
};

Operand take(Workspace::Scope& scope, int64_t rows, int64_t cols, BlockShape block) {
  return {scope.take(DType::u8, Shape{rows, cols}),
          scope.take(DType::f32, Shape{cuda::blockwise_scale_count(rows, cols, block)}), block};
}

void forward_cuda(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& bias,
                  const Tensor& y, bool vector) {
  KILN_OP_SCOPE("fp8_blockwise_linear", x);
  const int64_t n = x.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  const Operand xq = take(scope, n, in, kActivationTile), wq = take(scope, out, in, kWeightBlock);
  {
    KILN_OP_SCOPE("fp8_quantize", x);
    cuda::fp8_quantize_blockwise(ctx, x.dtype(), x.raw(), n, in, kActivationTile, Format::e4m3,
                                 xq.codes.data<uint8_t>(), xq.scales.data<float>(), nullptr, nullptr, vector);
    cuda::fp8_quantize_blockwise(ctx, w.dtype(), w.raw(), out, in, kWeightBlock, Format::e4m3,
                                 wq.codes.data<uint8_t>(), wq.scales.data<float>(), nullptr, nullptr, vector);
  }
  if (bias.defined()) cuda::linear_broadcast_bias(ctx, bias.data<float>(), y.dtype(), n, out, y.raw());
  cuda::fp8_gemm(ctx, n, out, in, xq.gemm(), wq.gemm(), y.raw(), y.dtype(), bias.defined());
}

void backward_cuda(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w, const Tensor& dy,
                   const Tensor& dx, bool accumulate_dx, const Tensor& dw, bool vector) {
  KILN_OP_SCOPE("fp8_blockwise_linear_backward", dy);
  const int64_t n = dy.size(0), in = w.size(1), out = w.size(0);
  Workspace::Scope scope(workspace);
  // The K-major operands: dx = dy [n, out] . (W^T) [in, out]^T, K = out; dW = (dy^T) [out, n]
  // . (x^T) [in, n]^T, K = n. Every operand is quantized before anything is written (dx may
  // be x's place).
  Operand dy_tiles, wt_blocks, dyt_tiles, xt_tiles;
  if (dx.defined()) dy_tiles = take(scope, n, out, kActivationTile), wt_blocks = take(scope, in, out, kWeightBlock);
  if (dw.defined()) dyt_tiles = take(scope, out, n, kActivationTile), xt_tiles = take(scope, in, n, kActivationTile);
  {
    KILN_OP_SCOPE("fp8_quantize", dy);
    // dy's own tiles and its transposed column tiles in one call (one read of dy: bf16 in
    // whole 128 x 128 tiles, as here, takes the kernel that writes both).
    cuda::fp8_quantize_blockwise(ctx, dy.dtype(), dy.raw(), n, out, kActivationTile, Format::e4m3,
                                 dy_tiles.codes.data_or_null<uint8_t>(), dy_tiles.scales.data_or_null<float>(),
                                 dyt_tiles.codes.data_or_null<uint8_t>(), dyt_tiles.scales.data_or_null<float>(),
                                 vector);
    if (dw.defined())
      cuda::fp8_quantize_blockwise(ctx, x.dtype(), x.raw(), n, in, kActivationTile, Format::e4m3, nullptr, nullptr,
                                   xt_tiles.codes.data<uint8_t>(), xt_tiles.scales.data<float>(), vector);
    if (dx.defined()) {
      // W's blocks transposed (the same scales); W's own codes are not needed here.
      const Tensor w_scales = scope.take(DType::f32, Shape{cuda::blockwise_scale_count(out, in, kWeightBlock)});
      cuda::fp8_quantize_blockwise(ctx, w.dtype(), w.raw(), out, in, kWeightBlock, Format::e4m3, nullptr,
                                   w_scales.data<float>(), wt_blocks.codes.data<uint8_t>(),
                                   wt_blocks.scales.data<float>(), vector);
    }
  }
  if (dx.defined())
    cuda::fp8_gemm(ctx, n, in, out, dy_tiles.gemm(), wt_blocks.gemm(), dx.raw(), dx.dtype(), accumulate_dx);
  if (!dw.defined()) return;
  if (dw.dtype() == DType::bf16) {
    cuda::fp8_gemm(ctx, out, in, n, dyt_tiles.gemm(), xt_tiles.gemm(), dw.raw(), DType::bf16, true);
    return;
  }
  // cuBLASLt's blockwise GEMM writes bf16 only: the product, then dW += it in f32.
  const Tensor product = scope.take(DType::bf16, Shape{out, in});
  cuda::fp8_gemm(ctx, out, in, n, dyt_tiles.gemm(), xt_tiles.gemm(), product.raw(), DType::bf16, false);
  cuda::add_f32_bf16(ctx, dw.data<float>(), static_cast<const cuda::bf16_bits*>(product.raw()), out * in,
                     dw.data<float>());
}

#endif

// x and dx [n, in], y and dy [n, out] (those defined) and W [out, in] in the layer's dtype.
void check_shapes(const Tensor& w, const Tensor& x, const char* out_name, const Tensor& y_or_dy,
                  const Tensor& dx = Tensor()) {
  const Device device = w.device();
  const DType dtype = fp8_layer_dtype(device);
  const int64_t in = w.size(1), out = w.size(0);
  expect_rows(kOp, "W", w, in, dtype, device);
  if (x.defined()) expect_rows(kOp, "x", x, in, dtype, device);
  if (dx.defined()) expect_rows(kOp, "dx", dx, in, dtype, device);
  expect_rows(kOp, out_name, y_or_dy, out, dtype, device);
}

}  // namespace

size_t fp8_blockwise_linear_scratch_bytes(Device device, int64_t tokens, int64_t in, int64_t out, bool training) {
  if (device == Device::cpu) return scratch_cpu(tokens, in, out, training);
#if KILN_WITH_CUDA
  return scratch_cuda(tokens, in, out, training);
#else
  return 0;  // no GPU in this build: nothing runs there
#endif
}

bool fp8_blockwise_linear_runs_fp8(Device device, int64_t n, int64_t in, int64_t out) {
  return device == Device::cpu || (n % kGemmMultiple == 0 && in % kGemmMultiple == 0 && out % kGemmMultiple == 0);
}

void fp8_blockwise_linear_forward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                  const Tensor& bias, const Tensor& y, [[maybe_unused]] bool vector_kernels) {
  check_shapes(w, x, "y", y);
  KILN_CHECK(y.size(0) == x.size(0), kOp, "y has {} rows for {} rows of x", y.size(0), x.size(0));
  if (!fp8_blockwise_linear_runs_fp8(w.device(), x.size(0), w.size(1), w.size(0)))
    return ops::linear_forward(ctx, x, w, bias, y);
  if (w.device() == Device::cpu) return forward_cpu(workspace, x, w, bias, y);
#if KILN_WITH_CUDA
  forward_cuda(ctx, workspace, x, w, bias, y, vector_kernels);
#endif
}

void fp8_blockwise_linear_backward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                   const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dw,
                                   const Tensor& dbias, [[maybe_unused]] bool vector_kernels) {
  check_shapes(w, x, "dy", dy, dx);
  const Tensor weight_grad = x.defined() ? dw : Tensor();
  if (!fp8_blockwise_linear_runs_fp8(w.device(), dy.size(0), w.size(1), w.size(0)))
    return ops::linear_backward(ctx, x.defined() ? x : dx, w, dy, dx, weight_grad, x.defined() ? dbias : Tensor(),
                                accumulate_dx);
  if (w.device() == Device::cpu) {
    backward_cpu(workspace, x, w, dy, dx, accumulate_dx, weight_grad);
  } else {
#if KILN_WITH_CUDA
    backward_cuda(ctx, workspace, x, w, dy, dx, accumulate_dx, weight_grad, vector_kernels);
#endif
  }
  // The bias's gradient from the unquantized dy, as the bf16 and f32 paths sum it.
  if (x.defined() && dbias.defined()) ops::linear_backward(ctx, x, w, dy, Tensor(), Tensor(), dbias);
}

}  // namespace kiln::ops::fp8
