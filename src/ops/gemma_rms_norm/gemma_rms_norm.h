// Gemma's RMSNorm (transformers' GemmaRMSNorm / Gemma3RMSNorm):
//   y = x * rstd * (1 + w),   rstd = 1 / sqrt(mean(x^2) + eps),
// all in fp32 or wider, with w stored as an offset from one (initialized to zero). It is an
// RMSNorm whose gain is 1 + w, formed in the gain's dtype exactly as transformers forms
// (1.0 + weight.float()); d gain / d w = 1, so w's gradient is the gain's. The front end forms
// the gain into a buffer and runs the RMSNorm kernels (ops/rms_norm) with it.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// gain [C] = 1 + w [C] (same dtype and device; f32 on the GPU).
void gemma_gain(const ExecContext& ctx, const Tensor& w, const Tensor& gain);

// x [R, C], w [C] -> gain [C] (= 1 + w, kept for backward), y [R, C], rstd [R].
void gemma_rms_norm_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, double eps, const Tensor& gain, const Tensor& y,
                            const Tensor& rstd);
// sum = a + b, then the forward of sum (as ops::add_rms_norm_forward).
void add_gemma_rms_norm_forward(const ExecContext& ctx, const Tensor& a, const Tensor& b, const Tensor& w, double eps, const Tensor& gain,
                                const Tensor& sum, const Tensor& y, const Tensor& rstd);
// From the forward's x, gain and rstd: dx = (or +=), dw += (skipped if undefined), dx_copy as
// ops::rms_norm_backward.
void gemma_rms_norm_backward(const ExecContext& ctx, const Tensor& x, const Tensor& gain, const Tensor& rstd, const Tensor& dy,
                             const Tensor& dx, const Tensor& dw, bool accumulate_dx = false,
                             const Tensor& dx_copy = Tensor());

}  // namespace kiln::ops
