// CUDA kernels behind ops/elementwise/elementwise.h: residual adds, scaling, dtype casts
// and the deterministic reductions of gradient norms and finiteness checks. They launch on
// the stream of the context they are given and trust their inputs.
#pragma once

#include "core/exec_context.h"
#include "ops/mixed_precision.h"

#include <cstddef>
#include <cstdint>

namespace kiln::cuda {

void add_f32(const ExecContext& ctx, const float* a, const float* b, int64_t n, float* out);
void add_inplace_f32(const ExecContext& ctx, float* dst, const float* src, int64_t n);
// dst = bf16(dst + src) in fp32 (one rounding): a bf16 branch added onto another.
void add_inplace_bf16(const ExecContext& ctx, bf16_bits* dst, const bf16_bits* src, int64_t n);
void scale_inplace_f32(const ExecContext& ctx, float* x, int64_t n, float factor);
// out = a + b with a fp32 (residual), b bf16 (branch output), out fp32 (may alias a).
void add_f32_bf16(const ExecContext& ctx, const float* a, const bf16_bits* b, int64_t n, float* out);

// dst = bf16(src), round to nearest even (weights' compute copies, fp32 -> bf16 grads).
void cast_f32_to_bf16(const ExecContext& ctx, const float* src, int64_t n, bf16_bits* dst);
void cast_bf16_to_f32(const ExecContext& ctx, const bf16_bits* src, int64_t n, float* dst);
// bytes of dst zeroed on the context's stream.
void zero_bytes(const ExecContext& ctx, void* dst, size_t bytes);
// bytes of src into dst, device to device, on the context's stream (a same-dtype convert).
void copy_bytes(const ExecContext& ctx, const void* src, size_t bytes, void* dst);

// Deterministic: fixed per-block partials summed in order. Synchronizes (returns to host).
double sum_squares_f32(const ExecContext& ctx, const float* x, int64_t n);
// The same sum (the same partials, the same order: the same bits) written to device
// memory `out` instead: no synchronization, so a captured step can read it.
void sum_squares_to_device_f32(const ExecContext& ctx, const float* x, int64_t n, double* out);
bool all_finite_f32(const ExecContext& ctx, const float* x, int64_t n);

}  // namespace kiln::cuda
