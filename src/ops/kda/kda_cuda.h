// CUDA kernels behind ops/kda/kda.h and kda_gate.h (kda_cuda.cu): the token-by-token
// recurrence, forward and backward, and the decay gate. The correctness-first GPU path:
// the chunked kernel comes later.
//
// Layout as the CPU op: q, k, g [N, H, d_k], v, o [N, H, d_v], beta [N, H] of `dtype`
// (f32 or bf16: bf16 read, fp32 math, outputs stored in `dtype`); cu_seqlens i32 [S+1] on
// the device; states [S, H, d_k, d_v] fp32. d_k <= 256, any d_v. The front ends validate
// shapes and dtypes; these trust their inputs. Everything launches on cuda::stream(ctx),
// uses no module-level scratch, no atomics, and gives the same bits every run.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

struct KdaArgs {
  int64_t tokens, heads, dk, dv, num_seqs;
  const int32_t* cu_seqlens;  // device
  float scale;
  DType dtype;  // of q, k, v, g, beta, out and their gradients
  int slice = 0;  // the chunked kernels' sequential slice (ops::KdaOptions::gpu_slice); 0 = chosen
  bool tensor_cores = true;  // ops::KdaOptions::gpu_tensor_cores
  bool bf16_grads = false;   // ops::KdaOptions::gpu_bf16_grads
};

// h0, ht null: zero start / not written.
void kda_recurrent_forward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                           const void* g, const void* beta, const float* h0, void* out, float* ht);

// f32 elements of the backward's workspace: the state every 64 tokens of each document
// ((N / 64 + S) slots of [H, d_k, d_v]) and per-slice partial sums of dq, dk, dg, dbeta
// over the d_v slices of the kernel (slices x N x H x (3 d_k + 1)). Shapes only.
int64_t kda_backward_workspace_elems(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs);

// dht, dh0 null: zero / not written. workspace: kda_backward_workspace_elems floats.
void kda_recurrent_backward(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                            const void* g, const void* beta, const float* h0, const void* dout, const float* dht,
                            void* dq, void* dk, void* dv, void* dg, void* dbeta, float* dh0, float* workspace);

// raw, g [N, H, d_k] of dtype; A_log [H], dt_bias [H, d_k] fp32 (dt_bias null: zero).
void kda_gate_forward(const ExecContext& ctx, const void* raw, DType dtype, const float* A_log, const float* dt_bias,
                      int64_t tokens, int64_t heads, int64_t dk, void* g);

// draw (=) of dtype; dA_log [H], ddt_bias [H, d_k] fp32, += (null: skipped). One block
// per head sums over tokens and channels in a fixed order.
void kda_gate_backward(const ExecContext& ctx, const void* raw, DType dtype, const float* A_log,
                       const float* dt_bias, const void* dg, int64_t tokens, int64_t heads, int64_t dk, void* draw,
                       float* dA_log, float* ddt_bias);

}  // namespace kiln::cuda
