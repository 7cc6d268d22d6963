// Routers' math: from router logits [T, E] (wide: fp32, or f64 on the CPU reference) to
// each token's k experts (i32 [T, k]) and their weights (wide [T, k]), and back. The
// choice itself has no gradient: backwards hold it fixed (what every MoE trainer does and
// what the finite-difference tests check, with logits away from ties).
//
// Ties between equal scores go to the lower expert id (as a stable sort would give).
#pragma once

#include "core/tensor.h"

namespace kiln::ops {

struct Routes {
  Tensor experts;  // i32 [T, k]
  Tensor weights;  // wide [T, k]
};

// softmax_topk (Qwen3-MoE): p = softmax(logits) over all experts (probs [T, E], =); the k
// largest; weights = p at them, divided by their sum when `normalize` (norm_topk_prob).
void softmax_topk_forward(const Tensor& logits, bool normalize, const Tensor& probs, const Routes& out);
// dweights [T, k], and dprobs [T, E] (a gradient wrt probs from elsewhere, e.g. the
// balance loss; undefined: none) -> dlogits [T, E] (=).
void softmax_topk_backward(const Tensor& probs, const Routes& routes, bool normalize, const Tensor& dweights,
                           const Tensor& dprobs, const Tensor& dlogits);

// sigmoid_bias (DeepSeek-V3, aux-loss-free): s = sigmoid(logits) (scores [T, E], =); the k
// experts with the largest s + bias (bias [E], no gradient), from the top_groups of
// `groups` equal groups whose score is the sum of their two largest s + bias (groups = 1:
// all experts); weights = s at them (divided by their sum when `normalize`) x scaling.
void sigmoid_bias_forward(const Tensor& logits, const Tensor& bias, int64_t groups, int64_t top_groups, bool normalize,
                          double scaling, const Tensor& scores, const Routes& out);
void sigmoid_bias_backward(const Tensor& scores, const Routes& routes, bool normalize, double scaling,
                           const Tensor& dweights, const Tensor& dscores, const Tensor& dlogits);

// The Switch load-balancing loss of one micro-batch: E sum_i f_i P_i, f_i the share of the
// T k choices that went to expert i (counts i32 [E], host), P_i the mean of probs [T, E]
// (each row a distribution over the experts) over the tokens. Returns it; with dprobs
// defined also adds its gradient x grad_scale (+=; f held fixed).
double balance_loss(const Tensor& probs, const Tensor& counts, int64_t top_k, double grad_scale, const Tensor& dprobs);

// The router z-loss of one micro-batch: mean over tokens of logsumexp(logits)^2. Returns
// it; with dlogits defined also adds its gradient x grad_scale (+=).
double router_z_loss(const Tensor& logits, double grad_scale, const Tensor& dlogits);

}  // namespace kiln::ops
