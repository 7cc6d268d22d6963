// A linear layer y = x W^T (+ b) with its GEMMs in tensorwise FP8 (the fp8_tensorwise
// recipe, nn/linear_layer.h): forward y = Q4(x) Q4(W)^T, backward dx = Q5(dy) Q4(W) and
// dW += Q5(dy)^T Q4(x), where Q4 / Q5 quantize a whole tensor to e4m3 / e5m2 with this
// call's amax (Transformer Engine's current scaling) and products are summed in fp32. The
// bias and its gradient stay out of FP8 (the bias gradient sums the unquantized dy).
//
// CPU (f32 tensors): the emulation's bits (ops/fp8/fp8_linear_cpu.h), the recipe's reference.
// GPU (bf16 activations and weights, f32 or bf16 weight gradient): the quantize kernels
// (fp8_quantize_cuda.h; the transposed codes the backward's K-major operands need come from
// the same pass) and cuBLASLt's FP8 GEMM (fp8_gemm_cuda.h), whose dimensions must be
// multiples of 16: a call with n, in or out not a multiple of 16 (a decode step's few rows)
// runs the bf16 GEMM instead, as docs/fp8.md says.
//
// Operand copies are taken from the workspace's gemm level; fp8_linear_scratch_bytes is
// what a layer reserves there. A training forward may also keep x's operand for the
// backward's weight gradient (Fp8KeptInput), so x is quantized once per micro-batch
// instead of in both passes.
#pragma once

#include "core/arena.h"
#include "core/exec_context.h"
#include "core/tensor.h"

#include <cstddef>
#include <cstdint>

namespace kiln::ops::fp8 {

// Workspace bytes one call needs at most (forward, or backward when training) for up to
// `tokens` rows of x.
size_t fp8_linear_scratch_bytes(Device device, int64_t tokens, int64_t in, int64_t out, bool training);

// x's operand for the weight gradient dW += Q5(dy)^T Q4(x), made by the forward's quantize
// pass and read by the backward instead of quantizing x again: the same bits, since both
// come from the same x with the same amax. On the GPU the e4m3 codes of x^T [in, rows] (the
// GEMM's K-major operand, written beside x's own codes in one pass) and their scales
// (scale_inv, amax); on the CPU x's dequantized copy [rows, in] (scales unused). The caller
// owns the buffers: one micro-batch's state, valid from its forward to its backward.
struct Fp8KeptInput {
  Tensor codes;   // 1-D, fp8_kept_input_elements long, of fp8_kept_input_dtype
  Tensor scales;  // f32 [2]
};
DType fp8_kept_input_dtype(Device device);
int64_t fp8_kept_input_elements(int64_t tokens, int64_t in);

// Whether the GPU runs this call's GEMMs in FP8 (every dimension a multiple of 16); the CPU
// always does.
bool fp8_linear_runs_fp8(Device device, int64_t n, int64_t in, int64_t out);

// x [n, in], w [out, in], bias [out] (f32) or undefined -> y [n, out] (written with =).
// `keep`, when given, receives x's weight-gradient operand (nothing when this call runs the
// bf16 GEMM: its backward then reads x, as it will run the bf16 GEMM too). `x_amax` (f32 [1]
// on x's device, or undefined): max |x|, already computed by x's producer (ops::swiglu_*),
// which the GPU's quantize then takes instead of reading x an extra time (the CPU's
// emulation computes its own).
void fp8_linear_forward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                        const Tensor& bias, const Tensor& y, const Fp8KeptInput* keep = nullptr,
                        const Tensor& x_amax = Tensor());

// dy [n, out]. dx [n, in] (= or += when accumulate_dx; skipped if undefined). dw [out, in]
// and dbias [out]: += (skipped if undefined; dw needs x). dx may be x's place. `kept`, when
// given, is what this micro-batch's forward kept: dW reads it instead of quantizing x (x is
// then read only by the bf16 GEMM's fallback and for its shape). `dy_amax`: max |dy|, as
// the forward's x_amax.
void fp8_linear_backward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                         const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dw, const Tensor& dbias,
                         const Fp8KeptInput* kept = nullptr, const Tensor& dy_amax = Tensor());

}  // namespace kiln::ops::fp8
