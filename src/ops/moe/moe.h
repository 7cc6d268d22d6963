// Mixture-of-experts dispatch: T tokens, each with k route slots (pair p = t k + j: token
// t's j-th slot) naming one of E experts or none (-1: a router with a variable count per
// token leaves slots empty), computed as one grouped layout of at most R rows in which
// expert e owns the contiguous rows [offsets[e], offsets[e + 1]); offsets[E] <= R rows are
// live, the rest are zero (gather) and read by no one.
//
//   dispatch  experts i32 [T, k] -> counts [E] (every pair routed to e), offsets [E + 1]
//             (the rows kept: at most `capacity` per expert when it is set, the first
//             ones in pair order, as Switch / GShard drop by position), the permutation
//             (rows are ordered by expert, and within an expert by pair: stable, so
//             results do not depend on the order of the work); an empty or dropped pair
//             has row -1 and contributes nothing
//   gather    x [T, d] -> grouped [R, d]: row r = x[token of pair_of_row[r]]
//   grouped_linear  per expert, grouped rows [n_e, in] x W_e^T -> [n_e, out], W = [E out, in]
//             (expert e's weight is rows [e out, (e + 1) out) of one matrix)
//   combine   out[t] = sum over token t's kept pairs j of weights[t, j] y[row_of_pair[t k + j]]
//
// Every op's CPU reference runs with the sizes on the host; on the GPU the sizes stay on the
// device (no synchronization), so a step with experts can be captured as a CUDA graph.
// Backwards write input gradients with = (or += where asked) and accumulate weight
// gradients with +=, as every op does. On the GPU token rows are f32, or bf16 on the mixed
// path, where the experts' weight gradients and the routing weights (and their gradient)
// are fp32; every GPU result is the same bits run to run (fixed-order sums, no atomics on
// floats; the grouped products as grouped_gemm_cuda.h says).
#pragma once

#include "core/arena.h"
#include "core/exec_context.h"
#include "core/tensor.h"

#include <cstddef>

namespace kiln::ops {

struct MoeDispatch {
  int64_t experts = 0;
  int64_t top_k = 0;     // route slots per token (k; E for the routers that give a token any number)
  int64_t capacity = 0;  // rows an expert keeps at most (0: every pair routed to it)
  Tensor counts;         // i32 [E]: pairs routed to each expert (before any drop)
  Tensor offsets;        // i32 [E + 1]: offsets[0] = 0, offsets[E] = the live rows <= R
  Tensor pair_of_row;    // i32 [R]: R = its length, the grouped layout's rows
  Tensor row_of_pair;    // i32 [T k]: -1 for an empty or dropped pair
  Tensor dropped;        // i32 [1] (+=): pairs dropped by the capacity; undefined: not counted
};

// experts i32 [T, k] (every id in [0, E), or -1: empty) -> counts, offsets and the
// permutation (=), dropped (+=). The live rows must fit in R (an error on the CPU; a trap
// on the GPU, which cannot read them).
void moe_dispatch(const ExecContext& ctx, const Tensor& experts, const MoeDispatch& out);

// x [T, d] -> grouped [R, d] (=; rows past the live ones zero).
void moe_gather(const ExecContext& ctx, const Tensor& x, const MoeDispatch& dispatch, const Tensor& grouped);
// dgrouped [R, d] -> dx [T, d]: the sum of each token's kept rows, in slot order (= or +=).
void moe_gather_backward(const ExecContext& ctx, const Tensor& dgrouped, const MoeDispatch& dispatch, const Tensor& dx, bool accumulate);

// x [R, in], w [E out, in] -> y [R, out] (=): expert e's rows times its weight (rows past
// the live ones untouched).
void moe_grouped_linear_forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const MoeDispatch& dispatch, const Tensor& y);
// dy [R, out] -> dx [R, in] (=; skipped if undefined) and dw [E out, in] (+=; skipped if
// undefined).
void moe_grouped_linear_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy, const MoeDispatch& dispatch,
                                 const Tensor& dx, const Tensor& dw);

// The same two ops in tensorwise FP8 (train.fp8_experts under fp8_tensorwise; moe_fp8.cpp,
// docs/fp8.md): forward y_e = Q4(x) Q4(W_e)^T, input gradient dx_e = Q5(dy) Q4(W_e), weight
// gradient dW_e += Q5(dy)_e^T Q4(x)_e, where Q4(x) / Q5(dy) quantize the live grouped rows
// [0, offsets[E]) as one tensor (one scale; e4m3 / e5m2) and Q4(W_e) each expert's weight
// with its own scale. CPU (f32): the emulation, bit for bit quantize_dequantize_tensorwise
// and fp32 products summed in ascending k (fp8_linear_cpu.h). GPU (bf16, dW f32): the
// quantize kernels and CUTLASS's FP8 grouped GEMM on sm_90a; a call whose widths are not
// multiples of 16, whose bases are not 16-byte aligned or that has no such kernel runs the
// bf16 ops above instead (decided on the host, never from the routed rows). Scratch comes
// from the workspace's gemm level: moe_grouped_linear_fp8_scratch_bytes per call.
size_t moe_grouped_linear_fp8_scratch_bytes(Device device, int64_t rows, int64_t experts, int64_t in, int64_t out,
                                            bool training);
void moe_grouped_linear_fp8_forward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                    const MoeDispatch& dispatch, const Tensor& y);
void moe_grouped_linear_fp8_backward(const ExecContext& ctx, Workspace& workspace, const Tensor& x, const Tensor& w,
                                     const Tensor& dy, const MoeDispatch& dispatch, const Tensor& dx, const Tensor& dw);
// Whether a GPU call with these widths and bases would run FP8 (the CPU always does).
bool moe_grouped_linear_fp8_runs_fp8(Device device, int64_t in, int64_t out);

// y [R, d], weights [T, k] (wide: the rows' dtype on the CPU, fp32 on the GPU) -> out [T, d] (=).
void moe_combine(const ExecContext& ctx, const Tensor& y, const Tensor& weights, const MoeDispatch& dispatch, const Tensor& out);
// dout [T, d] -> dy [R, d] (= weights x dout on the live rows) and dweights [T, k] (= dout
// . y, wide; 0 for an empty or dropped pair).
void moe_combine_backward(const ExecContext& ctx, const Tensor& y, const Tensor& weights, const Tensor& dout, const MoeDispatch& dispatch,
                          const Tensor& dy, const Tensor& dweights);

// The experts' SwiGLU backward with the routing weights taken off their outputs (SonicMoE's
// form, model.moe.save_outputs = false): the block then keeps no output rows [R, d] for the
// weights' gradient. Live row r of pair p computes y_r = w_p act_r W_e^T with act =
// SwiGLU(gate_up). du [R, F] is the gradient of the unweighted output times W_e (the grouped
// dout rows through the down projection's input gradient), so that:
//   dweights[p]  = du_r . act_r             (= dout_t . y_r / w_p; 0 for an empty or dropped pair)
//   dgate_up_r   = SwiGLU'(gate_up_r)^T (w_p du_r)
//   weighted_act_r = w_p act_r              (the down projection's weight-gradient operand)
// Rows past the live ones: zero dgate_up and weighted_act (du's are not read).
// weighted_act may be du itself (each element is read before it is written); dweights is
// [T, k] (wide, as combine's). The sums run in a fixed order on both devices.
void moe_swiglu_backward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& du, const Tensor& weights,
                         const MoeDispatch& dispatch, const Tensor& dgate_up, const Tensor& weighted_act,
                         const Tensor& dweights);

}  // namespace kiln::ops
