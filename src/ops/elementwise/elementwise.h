// Elementwise helpers of the residual stream.
#pragma once

#include "core/tensor.h"

namespace kiln::ops {

// dst += src (same shape).
void add_inplace(const Tensor& dst, const Tensor& src);
// out = a + b.
void add(const Tensor& a, const Tensor& b, const Tensor& out);
// Sum of squares of all elements, accumulated in double (for gradient norms).
double sum_squares(const Tensor& x);
// x *= factor.
void scale_inplace(const Tensor& x, double factor);
// True if every element is finite.
bool all_finite(const Tensor& x);

}  // namespace kiln::ops
