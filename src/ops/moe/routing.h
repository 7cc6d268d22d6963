// Routers' math: from router logits [T, E] (wide: fp32, or f64 on the CPU reference) to
// each token's k experts (i32 [T, k]) and their weights (wide [T, k]), and back. The
// choice itself has no gradient: backwards hold it fixed (what every MoE trainer does and
// what the finite-difference tests check, with logits away from ties).
//
// Ties between equal scores go to the lower expert id (as a stable sort would give).
//
// On the GPU (routing_cuda.h) every tensor here is fp32 (the router's math stays fp32 on the
// mixed path too), counts live on the device, and the losses' *_sum forms add their values
// to a double in device memory without a host read, so a training step with a router can
// be captured as a CUDA graph.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

// A router loss's gradient scale: `host` (the loss's coefficient over the micro-batches,
// times the loss scale S where the host knows it), times `device` when set (GPU only): S
// read from device memory when the kernel runs, so a captured step replays one graph for
// every S (train/loss_scaler.h). A plain double is the common case.
struct GradScale {
  double host = 1;
  const double* device = nullptr;
  GradScale(double h) : host(h) {}  // NOLINT: implicit, as a double was the whole scale
  GradScale(double h, const double* on_device) : host(h), device(on_device) {}
};
// The scale of a CPU kernel: `host`, checked to have no device part (throws naming `op`).
double cpu_grad_scale(const char* op, GradScale scale);

struct Routes {
  Tensor experts;  // i32 [T, k]
  Tensor weights;  // wide [T, k]
};

// The router's logits: x [T, d] (activations) times its weight w [E, d] -> logits [T, E]
// (=, wide: on the GPU's mixed path bf16 x and w, fp32 logits from fp32 accumulation).
void router_logits(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& logits);
// dlogits [T, E] (wide) -> dx [T, d] (+=) and dw [E, d] (+=, wide). On the mixed path the
// products read dlogits rounded to bf16 (as an autocast linear's gradient): `scratch`, bf16
// [T, E]; elsewhere unused (may be undefined).
void router_logits_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dlogits, const Tensor& scratch,
                            const Tensor& dx, const Tensor& dw);

// softmax_topk (Qwen3-MoE): p = softmax(logits) over all experts (probs [T, E], =); the k
// largest; weights = p at them, divided by their sum when `normalize` (norm_topk_prob).
void softmax_topk_forward(const ExecContext& ctx, const Tensor& logits, bool normalize, const Tensor& probs, const Routes& out);
// dweights [T, k], and dprobs [T, E] (a gradient wrt probs from elsewhere, e.g. the
// balance loss; undefined: none) -> dlogits [T, E] (=).
void softmax_topk_backward(const ExecContext& ctx, const Tensor& probs, const Routes& routes, bool normalize, const Tensor& dweights,
                           const Tensor& dprobs, const Tensor& dlogits);

// sinkhorn (balanced assignment; routing_sinkhorn.cpp): p = softmax(logits) (probs [T, E],
// =); `iterations` Sinkhorn steps over the micro-batch's matrix p, from col_scale c = 1:
//   row_scale r_t = 1 / (T (sum_e c_e p_te + eps)),  c_e = 1 / (E (sum_t r_t p_te + eps))
// (eps = 1e-8, as Megatron's), so that r_t c_e p_te has rows summing to 1/T and columns to
// 1/E; each token's k experts are the k largest c_e p_te (its balanced row: r_t does not
// change a row's order); weights = p at them, divided by their sum when `normalize`. The
// scales are the caller's buffers (row_scale [T], col_scale [E], wide). The backward is
// softmax_topk_backward's (the weights are the softmax's; the balancing has no gradient).
void sinkhorn_topk_forward(const ExecContext& ctx, const Tensor& logits, int64_t iterations, bool normalize, const Tensor& probs,
                           const Tensor& row_scale, const Tensor& col_scale, const Routes& out);

// expert_choice (routing_expert_choice.cpp): p = softmax(logits) (probs [T, E], =); expert
// e takes the `capacity` tokens of largest p_te (equal: the lower token). Routes of E slots:
// token t's slot e is e when expert e took it (weight p_te), else -1 (weight 0). The
// backward is softmax_topk_backward's (not normalized; empty slots carry nothing).
void expert_choice_forward(const ExecContext& ctx, const Tensor& logits, int64_t capacity, const Tensor& probs, const Routes& out);

// relu (ReMoE; routing_relu.cpp): gates g = max(logits, 0). Routes of E slots: token t's
// slot e is e when g_te > 0 (weight g_te), else -1 (weight 0); probs [T, E] = g / sum_e g
// (a row without a gate: 0).
void relu_route_forward(const ExecContext& ctx, const Tensor& logits, const Tensor& probs, const Routes& out);
// dlogits [T, E] (=) = [routed: l > 0] (dweights + coef[0] x grad_scale / T): the weights'
// gradient and the L1 penalty's, coef (wide [1], on the logits' device) its adaptive
// coefficient.
void relu_route_backward(const ExecContext& ctx, const Routes& routes, const Tensor& dweights, const Tensor& coef, GradScale grad_scale,
                         const Tensor& dlogits);
// The L1 penalty's value before its coefficient, mean_t sum_e g_te: returned (the GPU
// synchronizes), or added (+=) to *sum where logits lives (no synchronization).
double relu_l1(const ExecContext& ctx, const Tensor& logits);
void relu_l1_sum(const ExecContext& ctx, const Tensor& logits, double* sum);
// ReMoE's adaptation after an applied step, from its routed pairs per expert (counts i32
// [E]) over its tokens (f64 [1]): the sparsity 1 - pairs / (tokens E) below the target 1 -
// k / E (too many experts in use) multiplies coef by `factor`, else divides it; nothing
// without tokens.
void relu_l1_update(const ExecContext& ctx, const Tensor& coef, const Tensor& counts, const Tensor& tokens, int64_t top_k, double factor);

// sigmoid_bias (DeepSeek-V3, aux-loss-free): s = sigmoid(logits) (scores [T, E], =); the k
// experts with the largest s + bias (bias [E], no gradient), from the top_groups of
// `groups` equal groups whose score is the sum of their two largest s + bias (groups = 1:
// all experts); weights = s at them (divided by their sum when `normalize`) x scaling.
void sigmoid_bias_forward(const ExecContext& ctx, const Tensor& logits, const Tensor& bias, int64_t groups, int64_t top_groups, bool normalize,
                          double scaling, const Tensor& scores, const Routes& out);
void sigmoid_bias_backward(const ExecContext& ctx, const Tensor& scores, const Routes& routes, bool normalize, double scaling,
                           const Tensor& dweights, const Tensor& dscores, const Tensor& dlogits);

// sigmoid_bias's distribution for the balance loss: probs [T, E] = scores / their row sums
// (=); and back, dscores [T, E] (=) from dprobs.
void row_normalize_forward(const ExecContext& ctx, const Tensor& scores, const Tensor& probs);
void row_normalize_backward(const ExecContext& ctx, const Tensor& scores, const Tensor& probs, const Tensor& dprobs, const Tensor& dscores);

// sigmoid_bias's balancing step after an applied optimizer step, from the step's routed
// choices per expert (counts i32 [E], on bias's device): bias [E] += rate x sign(mean -
// count) (sign_rule) or rate x (mean - count) / mean; nothing when no choice was made.
void sigmoid_bias_update(const ExecContext& ctx, const Tensor& bias, const Tensor& counts, bool sign_rule, double rate);

// The Switch load-balancing loss of one micro-batch: E sum_i f_i P_i, f_i the share of the
// T k choices that went to expert i (counts i32 [E], on probs' device), P_i the mean of
// probs [T, E] (each row a distribution over the experts) over the tokens. Returns it
// (the GPU reads it back: a synchronization); with dprobs defined also adds its gradient x
// grad_scale (+=; f held fixed).
//
// step_routes (model.moe.balance_scope = "step"; undefined: the micro-batch scope): the
// step's counts, f64 [E + 1] on probs' device (the choices per expert over every
// micro-batch and rank, then the routed tokens T_step; balance_step_routes_add). Once they
// hold tokens, f_i = c_i / (k T_step) and the value is this micro-batch's share of the
// step's loss, E sum_i f_i (sum of its rows' probs_ti) / T_step, so the shares sum to the
// step's loss; its gradient E f_i / T_step per row. Read where the kernels run: a captured
// step replays for any counts (ops/moe/balance_scope.h).
double balance_loss(const ExecContext& ctx, const Tensor& probs, const Tensor& counts, int64_t top_k, double grad_scale, const Tensor& dprobs,
                    const Tensor& step_routes = Tensor());
// Its value added (+=) to *sum, a double where probs lives (device memory for GPU
// tensors): no synchronization.
void balance_loss_sum(const ExecContext& ctx, const Tensor& probs, const Tensor& counts, int64_t top_k, double* sum,
                      const Tensor& step_routes = Tensor());
// Its gradient only: dprobs = grad_scale x d(loss)/d(probs) (=: the balance loss is the only
// gradient probs get from outside the router).
void balance_loss_backward(const ExecContext& ctx, const Tensor& probs, const Tensor& counts, int64_t top_k, GradScale grad_scale,
                           const Tensor& dprobs, const Tensor& step_routes = Tensor());
// The counting pass's part: a micro-batch's choices per expert (counts i32 [E]) and its
// `tokens` added to the step's (step_routes f64 [E + 1], on counts' device; +=, integers
// in fp64, so exact in any order).
void balance_step_routes_add(const ExecContext& ctx, const Tensor& counts, int64_t tokens, const Tensor& step_routes);

// The router z-loss of one micro-batch: mean over tokens of logsumexp(logits)^2. Returns
// it (the GPU synchronizes); with dlogits defined also adds its gradient x grad_scale (+=).
// step_tokens (f64 [1] on logits' device, the step's routed tokens; balance_scope = "step"):
// once nonzero, the mean's divisor, so the micro-batches' values add up to the mean over
// the step's tokens and each token's gradient is 2 lse softmax / T_step.
double router_z_loss(const ExecContext& ctx, const Tensor& logits, double grad_scale, const Tensor& dlogits,
                     const Tensor& step_tokens = Tensor());
// Its value added (+=) to *sum (where logits lives; no synchronization), and its gradient
// only (dlogits +=).
void router_z_loss_sum(const ExecContext& ctx, const Tensor& logits, double* sum, const Tensor& step_tokens = Tensor());
void router_z_loss_backward(const ExecContext& ctx, const Tensor& logits, GradScale grad_scale, const Tensor& dlogits,
                            const Tensor& step_tokens = Tensor());

}  // namespace kiln::ops
