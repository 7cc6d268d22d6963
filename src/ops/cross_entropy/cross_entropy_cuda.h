// CUDA kernels behind ops/cross_entropy/lm_head_loss.h: cross-entropy rows of a logits
// chunk (fp32 in cross_entropy_cuda.cu; the mixed path's in cross_entropy_bf16.cu), the
// final-logit softcap, and the loss sums kept on the device. They launch on
// the context's stream and trust their inputs. The loss sums' own storage (sums null) is
// the context's device scratch (core/context_scratch.h).
#pragma once

#include "core/exec_context.h"
#include "ops/mixed_precision.h"

#include <cstdint>

namespace kiln::cuda {

// The scale of the loss gradient: a value fixed at launch, or (device != null) a float the
// kernel reads from device memory when it runs, so a captured CUDA graph can be replayed
// for steps with other target counts, times the loss's weight in the objective.
struct LossScale {
  float value = 1.0f;
  const float* device = nullptr;
  float weight = 1.0f;  // applied to the device value (value already includes it)
  LossScale(float v) : value(v) {}  // NOLINT: a plain float is the common case
  LossScale(float v, const float* on_device, float w = 1.0f) : value(v), device(on_device), weight(w) {}
#ifdef __CUDACC__
  __device__ float get() const { return device != nullptr ? *device * weight : value; }
#endif
};

// Cross-entropy rows of a logits chunk in place: `rows` rows of `vocab` logits, row r at
// logits + r * stride (stride >= vocab: the LM head pads its rows to 16 bytes,
// ops::lm_head_logits_cols; the padding columns are never read as logits and may be
// overwritten with zeros when grad is set). With grad, each row becomes
// loss_scale * d(objective)/dlogits (zero for ignored targets); row_stats [rows, 2] (f64)
// receives each row's loss and logsumexp^2.
void cross_entropy_rows_f32(const ExecContext& ctx, float* logits, int64_t stride, const int32_t* targets, int64_t rows,
                            int64_t vocab, float z_loss, LossScale loss_scale, float softcap, bool grad, double* row_stats);

// Cross-entropy rows of an fp32 logits chunk (the LM head GEMM writes fp32 logits from
// bf16 operands), rows `stride` apart as in cross_entropy_rows_f32. With grad, grad_out
// (bf16, the same row stride) receives loss_scale * d(objective)/dlogits (zero rows for
// ignored targets), ready for the two backward GEMMs; logits are left as they were.
// row_stats as cross_entropy_rows_f32. With a stride that is a multiple of 8 (and 16-byte
// aligned pointers) the kernel moves 8 logits at a time whatever vocab is, writing zeros
// into grad_out's padding columns.
void cross_entropy_rows_to_bf16(const ExecContext& ctx, const float* logits, int64_t stride, const int32_t* targets,
                                int64_t rows, int64_t vocab, float z_loss, LossScale loss_scale, float softcap, bool grad,
                                double* row_stats, bf16_bits* grad_out);

// The same on a bf16 logits chunk, in place: with grad, each row of `logits` becomes its
// bf16 gradient (the LM head's mixed path keeps logits in bf16, as autocast does).
void cross_entropy_rows_bf16(const ExecContext& ctx, bf16_bits* logits, int64_t stride, const int32_t* targets, int64_t rows,
                             int64_t vocab, float z_loss, LossScale loss_scale, float softcap, bool grad, double* row_stats);

// x = cap * tanh(x / cap), in place (the sampled rows' logits).
void softcap_f32(const ExecContext& ctx, float* x, int64_t n, float cap);

// Loss sums (loss, z, count: three doubles in device memory) accumulated in row order:
// reset, accumulate each chunk's row_stats, then read (synchronizes). `sums` null: the
// process's own three (one lm_head_loss call at a time); a caller's array lets a step
// accumulate over its micro-batches on the device and read once.
void loss_sums_reset(const ExecContext& ctx, double* sums);
void loss_sums_accumulate(const ExecContext& ctx, double* sums, const double* row_stats, const int32_t* targets, int64_t rows);
void loss_sums_read(const ExecContext& ctx, const double* sums, double* loss, double* z, int64_t* count);

}  // namespace kiln::cuda
