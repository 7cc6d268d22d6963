// Mixture-of-experts dispatch: T tokens, each routed to k of E experts, computed as one
// grouped layout of T x k rows in which expert e owns the contiguous rows
// [offsets[e], offsets[e + 1]).
//
//   dispatch  experts i32 [T, k] -> counts [E], offsets [E + 1], the permutation
//             (pair p = t k + j is token t's j-th choice; rows are ordered by expert, and
//             within an expert by pair: stable, so results do not depend on the order of
//             the work)
//   gather    x [T, d] -> grouped [T k, d]: row r = x[token of pair_of_row[r]]
//   grouped_linear  per expert, grouped rows [n_e, in] x W_e^T -> [n_e, out], W = [E out, in]
//             (expert e's weight is rows [e out, (e + 1) out) of one matrix)
//   combine   out[t] = sum_j weights[t, j] y[row_of_pair[t k + j]]
//
// Every op's CPU reference runs with the sizes on the host; on the GPU the sizes stay on the
// device (no synchronization), so a step with experts can be captured as a CUDA graph.
// Backwards write input gradients with = (or += where asked) and accumulate weight
// gradients with +=, as every op does. On the GPU token rows are f32, or bf16 on the mixed
// path, where the experts' weight gradients and the routing weights (and their gradient)
// are fp32; every GPU result is the same bits run to run (fixed-order sums, no atomics on
// floats; the grouped products as grouped_gemm_cuda.h says).
#pragma once

#include "core/tensor.h"

namespace kiln::ops {

struct MoeDispatch {
  int64_t experts = 0, top_k = 0;
  Tensor counts;       // i32 [E]
  Tensor offsets;      // i32 [E + 1]: offsets[0] = 0, offsets[E] = T k
  Tensor pair_of_row;  // i32 [T k]
  Tensor row_of_pair;  // i32 [T k]
};

// experts i32 [T, k] (every id in [0, E)) -> the dispatch's four tensors (=).
void moe_dispatch(const Tensor& experts, const MoeDispatch& out);

// x [T, d] -> grouped [T k, d] (=).
void moe_gather(const Tensor& x, const MoeDispatch& dispatch, const Tensor& grouped);
// dgrouped [T k, d] -> dx [T, d]: the sum of each token's k rows, in choice order (= or +=).
void moe_gather_backward(const Tensor& dgrouped, const MoeDispatch& dispatch, const Tensor& dx, bool accumulate);

// x [T k, in], w [E out, in] -> y [T k, out] (=): expert e's rows times its weight.
void moe_grouped_linear_forward(const Tensor& x, const Tensor& w, const MoeDispatch& dispatch, const Tensor& y);
// dy [T k, out] -> dx [T k, in] (=; skipped if undefined) and dw [E out, in] (+=; skipped if
// undefined).
void moe_grouped_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const MoeDispatch& dispatch,
                                 const Tensor& dx, const Tensor& dw);

// y [T k, d], weights [T, k] (wide: the rows' dtype on the CPU, fp32 on the GPU) -> out [T, d] (=).
void moe_combine(const Tensor& y, const Tensor& weights, const MoeDispatch& dispatch, const Tensor& out);
// dout [T, d] -> dy [T k, d] (= weights x dout) and dweights [T, k] (= dout . y, wide).
void moe_combine_backward(const Tensor& y, const Tensor& weights, const Tensor& dout, const MoeDispatch& dispatch,
                          const Tensor& dy, const Tensor& dweights);

}  // namespace kiln::ops
