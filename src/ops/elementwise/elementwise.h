// Elementwise helpers of the residual stream.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// dst += src (same shape).
void add_inplace(const ExecContext& ctx, const Tensor& dst, const Tensor& src);
// t = 0, on the context's stream on the GPU (zero_tensor's cudaMemset is not: a captured
// step zeroes through this).
void zero(const ExecContext& ctx, const Tensor& t);
// out = a + b. On the GPU's mixed path a and out are fp32 (the residual stream), b bf16.
void add(const ExecContext& ctx, const Tensor& a, const Tensor& b, const Tensor& out);
// dst = src converted to dst's dtype (same element count and device): bf16 <-> f32 on
// the GPU, a plain copy when the dtypes agree.
void convert(const ExecContext& ctx, const Tensor& src, const Tensor& dst);
// Sum of squares of all elements, accumulated in double (for gradient norms).
double sum_squares(const ExecContext& ctx, const Tensor& x);
// The same sum (the same bits) into one double in device memory, without waiting for it
// (GPU f32 tensors only): a step that keeps its scalars on the device.
void sum_squares_to_device(const ExecContext& ctx, const Tensor& x, double* out);
// x *= factor.
void scale_inplace(const ExecContext& ctx, const Tensor& x, double factor);
// True if every element is finite.
bool all_finite(const ExecContext& ctx, const Tensor& x);

}  // namespace kiln::ops
