// The routed experts' grouped GEMMs in tensorwise FP8 on the GPU (train.fp8_experts; the
// front end is ops/moe/moe.h's moe_grouped_linear_fp8_*, the math docs/fp8.md): the
// quantize steps and the three products, each on the context's stream with every size
// that depends on the routing read on the device (graph-safe, no host sync).
//
// Scales: one for the gathered activations x (e4m3) and one for their gradient dy (e5m2),
// each over the live rows [0, offsets[E]) only (rows past them are stale scratch), and
// one per expert weight W_e (e4m3). Products: grouped_gemm_fp8_sm90.h (CUTLASS, sm_90a).
//
// The host decides whether a call runs FP8 (grouped_fp8_supported: the build and device,
// widths multiples of 16, 16-byte aligned bases), never from the row counts; the weight
// gradient's K-major operands are the transposed codes of x and dy with each expert's
// columns starting at a multiple of 16 (padded offsets computed on the device), so no
// expert's row offset needs to be aligned.
#pragma once

#include "core/exec_context.h"
#include "ops/fp8/fp8_format.h"
#include "ops/mixed_precision.h"

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace kiln::cuda {

bool grouped_fp8_supported(int64_t in, int64_t out, std::initializer_list<const void*> bases);

// The leading dimension of the padded transposed codes for `rows` grouped rows over E experts.
int64_t grouped_fp8_padded_ld(int64_t rows, int64_t experts);

// *amax = max |x| over the live rows [0, offsets[E]) of x [rows, cols] (bf16), then the
// codes [rows, cols] of the whole buffer with that scale (rows past the live ones: codes of
// whatever they hold, read by no product) and *scale_inv.
void grouped_fp8_quantize_rows(const ExecContext& ctx, const bf16_bits* x, const int32_t* offsets, int64_t experts,
                               int64_t rows, int64_t cols, ops::fp8::Format format, uint8_t* codes, float* amax,
                               float* scale_inv);
// The weight gradient's K-major operand in one pass over x: *amax and *scale_inv as
// grouped_fp8_quantize_rows computes them, and the same codes, written transposed into
// codes_t [cols, ld] (the live row r of expert e at column padded[e] + r - offsets[e],
// every other column 0) and, when codes is not null, row-major into codes [rows, cols] for
// the live rows only (rows past them are left as they were). padded: from
// grouped_fp8_padded_offsets; ld a multiple of 16, at least grouped_fp8_padded_ld(rows, E);
// cols a multiple of 8; x, codes and codes_t 16-byte aligned (grouped_fp8_supported's
// shapes).
void grouped_fp8_quantize_padded(const ExecContext& ctx, const bf16_bits* x, const int32_t* offsets,
                                 const int32_t* padded, int64_t experts, int64_t rows, int64_t cols, int64_t ld,
                                 ops::fp8::Format format, uint8_t* codes, uint8_t* codes_t, float* amax,
                                 float* scale_inv);
// Each expert's weight W_e [out, in] of w [E out, in] (bf16) with its own scale: codes
// [E out, in] and/or the transposed codes [E in, out] (either may be null, not both);
// amax, scale_inv: [E].
void grouped_fp8_quantize_weights(const ExecContext& ctx, const bf16_bits* w, int64_t experts, int64_t in, int64_t out,
                                  uint8_t* codes, uint8_t* codes_t, float* amax, float* scale_inv);
// padded [E + 1]: padded[0] = 0, padded[e + 1] = padded[e] + round_up(n_e, 16).
void grouped_fp8_padded_offsets(const ExecContext& ctx, const int32_t* offsets, int64_t experts, int32_t* padded);

}  // namespace kiln::cuda
