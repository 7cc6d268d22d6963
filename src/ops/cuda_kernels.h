// fp32 CUDA kernels behind the op front ends (RMSNorm has its own header). The front
// end validates shapes and dtypes and calls these only for Device::cuda tensors in a
// KILN_WITH_CUDA build; they launch on kiln::cuda::stream() and trust their inputs.
#pragma once

#include "core/dtype.h"

#include <cstdint>

namespace kiln::cuda {

// Row-major C [m, n] = alpha op(A) op(B) + beta C through cuBLASLt with fp32 accumulation.
// A and B share ab_dtype (bf16 or f32); C is bf16 or f32 (bf16 operands may write fp32,
// e.g. logits or weight gradients accumulated with beta = 1). f32 x f32 is pedantic fp32.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a, int64_t lda,
          const void* b, int64_t ldb, DType ab_dtype, float beta, void* c, int64_t ldc, DType c_dtype);

// Row-major C [m, n] = alpha op(A) op(B) + beta C in fp32 (A is [m, k] after op, B [k, n]),
// the same contract as ops::cpu_gemm (cuBLAS, pedantic fp32).
void gemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// linear: y = x w^T (+ bias). x, w, y, dy, dx share `dtype` (f32, or bf16 on the mixed
// path); bias and dbias are fp32; dw (+=) is fp32 or `dtype` (dw_dtype).
void linear_forward(const void* x, const void* w, DType dtype, const float* bias, int64_t n, int64_t in,
                    int64_t out, void* y);
void linear_backward(const void* x, const void* w, const void* dy, DType dtype, int64_t n, int64_t in, int64_t out,
                     void* dx, bool accumulate_dx, void* dw, DType dw_dtype, float* dbias);

void embedding_forward_f32(const int32_t* tokens, const float* table, int64_t n, int64_t dim, float* out);
// Accumulates with atomics: fast, but the order of repeated ids is not fixed.
void embedding_backward_f32(const int32_t* tokens, const float* dout, int64_t n, int64_t dim, float* dtable);
// One block per group of equal ids: each table row's gradient summed in a fixed order.
void embedding_backward_grouped_f32(const int32_t* order, const int32_t* group_tokens, const int32_t* group_starts,
                                    int64_t groups, const float* dout, int64_t dim, float* dtable);

void rope_apply_f32(float* x, const int32_t* positions, const float* cos, const float* sin, int64_t n, int64_t heads,
                    int64_t half, bool inverse);

// Attention input preparation (ops/attention/qkv_prepare.h) on fp32 data, or bf16 data
// (`bf16`) with fp32 gains and tables. Gains null: no q/k norm; cos null: no rotation.
struct QkvPrepareArgs {
  int64_t tokens, q_heads, kv_heads, head_dim;
  const float* q_gain;
  const float* k_gain;
  float eps;
  const int32_t* positions;  // device, [tokens]
  const float* cos;          // [positions, head_dim / 2]
  const float* sin;
  bool bf16;
};
void qkv_prepare_forward(const QkvPrepareArgs& a, const void* qkv, void* q, void* k, void* v);
// Gain gradients (+=) in a fixed order; null (or no gains): not computed.
void qkv_prepare_backward(const QkvPrepareArgs& a, const void* qkv, const void* dq, const void* dk, const void* dv,
                          void* dqkv, float* q_gain_grad, float* k_gain_grad);

void qkv_shuffle_f32(float* fused, float* q, float* k, float* v, int64_t n, int64_t q_cols, int64_t kv_cols,
                     bool to_parts);

struct AttentionArgs {
  int64_t tokens, q_heads, kv_heads, head_dim, num_seqs;
  const int32_t* cu_seqlens;  // device
  float scale;
  int64_t window;
  float softcap;
  bool deterministic = true;  // false: the cuDNN backward may accumulate dQ with atomics
  // Every sequence holds exactly max_seqlen rows (tokens = num_seqs * max_seqlen): the bf16
  // (cuDNN) path then runs a plain, faster graph. Ignored by the fp32 kernels.
  bool uniform = false;
};
void attention_forward_f32(const AttentionArgs& a, const float* q, const float* k, const float* v, float* out,
                           float* lse);
void attention_backward_f32(const AttentionArgs& a, const float* q, const float* k, const float* v, const float* out,
                            const float* lse, const float* dout, float* dq, float* dk, float* dv);

void swiglu_forward_f32(const float* gate_up, int64_t n, int64_t f, float* out);
// out (null: skipped; may alias dout) receives the forward's output again.
void swiglu_backward_f32(const float* gate_up, const float* dout, int64_t n, int64_t f, float* dgate_up,
                         float* out);

void add_f32(const float* a, const float* b, int64_t n, float* out);
void add_inplace_f32(float* dst, const float* src, int64_t n);
void scale_inplace_f32(float* x, int64_t n, float factor);
// Deterministic: fixed per-block partials summed in order. Synchronizes (returns to host).
double sum_squares_f32(const float* x, int64_t n);
// The same sum (the same partials, the same order: the same bits) written to device
// memory `out` instead: no synchronization, so a captured step can read it.
void sum_squares_to_device_f32(const float* x, int64_t n, double* out);
bool all_finite_f32(const float* x, int64_t n);

// The scale of the loss gradient: a value fixed at launch, or (device != null) a float the
// kernel reads from device memory when it runs, so a captured CUDA graph can be replayed
// for steps with other target counts.
struct LossScale {
  float value = 1.0f;
  const float* device = nullptr;
  LossScale(float v) : value(v) {}  // NOLINT: a plain float is the common case
  LossScale(float v, const float* on_device) : value(v), device(on_device) {}
#ifdef __CUDACC__
  __device__ float get() const { return device != nullptr ? *device : value; }
#endif
};

// Cross-entropy rows of a logits chunk [rows, vocab] in place: with grad, each row becomes
// loss_scale * d(objective)/dlogits (zero for ignored targets); row_stats [rows, 2] (f64)
// receives each row's loss and logsumexp^2.
void cross_entropy_rows_f32(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float z_loss,
                            LossScale loss_scale, float softcap, bool grad, double* row_stats);
void softcap_f32(float* x, int64_t n, float cap);
// Loss sums (loss, z, count: three doubles in device memory) accumulated in row order:
// reset, accumulate each chunk's row_stats, then read (synchronizes). `sums` null: the
// process's own three (one lm_head_loss call at a time); a caller's array lets a step
// accumulate over its micro-batches on the device and read once.
void loss_sums_reset(double* sums);
void loss_sums_accumulate(double* sums, const double* row_stats, const int32_t* targets, int64_t rows);
void loss_sums_read(const double* sums, double* loss, double* z, int64_t* count);

// One tensor of a multi-tensor AdamW update (fp32 parameter, gradient and state).
struct AdamWTensorF32 {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float weight_decay;
};
// Every tensor in one launch; the same arithmetic as adamw_update_f32.
void adamw_update_many_f32(const AdamWTensorF32* tensors, int64_t count, float lr, float beta1, float beta2, float eps,
                           float bias_correction1, float bias_correction2);

// The scalars of one optimizer update read from device memory when the kernel runs (a
// captured step): lr and bias corrections written by the host before the step, the
// gradient factor (the clip; 1 = none) and the skip flag by the step's guard kernel.
struct DeviceUpdateScalars {
  float lr, bias_correction1, bias_correction2;
  float grad_scale;
  int32_t skip;  // nonzero: parameters and state stay untouched
};
// adamw_update_many_f32 with the scalars above: g * grad_scale in place of g (the bits of
// scaling the gradients first), nothing when skip is set.
void adamw_update_many_device_f32(const AdamWTensorF32* tensors, int64_t count, float beta1, float beta2, float eps,
                                  const DeviceUpdateScalars* scalars);

void adamw_update_f32(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, float bias_correction1, float bias_correction2);

}  // namespace kiln::cuda
