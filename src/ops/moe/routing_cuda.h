// CUDA kernels behind ops/moe/routing.h (routing_cuda.cu): the routers' math in fp32 on
// router logits [T, E] (fp32 on both GPU paths), a warp per token. Choices follow the CPU
// reference: the k largest keys, equal keys to the lower expert id. Losses add their values
// (+=) to a double in device memory and never synchronize; every sum runs in an order fixed
// by the shape, so results are the same bits every run (no atomics on floats). The front
// end validates; these launch on the context's stream and trust their inputs. E <= 1024.
#pragma once

#include "core/exec_context.h"
#include "ops/moe/balance_scope.h"

#include <cstdint>

namespace kiln::cuda {

inline constexpr int64_t kRoutingMaxExperts = 1024;

// softmax_topk: probs [T, E] = softmax(logits); experts i32 [T, k], weights [T, k] (= p at
// the experts, / their sum when normalize).
void softmax_topk_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, int64_t k, bool normalize,
                          float* probs, int32_t* experts, float* weights);
// dlogits [T, E] (=) from dweights [T, k] and dprobs [T, E] (null: none).
void softmax_topk_backward(const ExecContext& ctx, const float* probs, const int32_t* experts, const float* weights, int64_t tokens,
                           int64_t e_count, int64_t k, bool normalize, const float* dweights, const float* dprobs,
                           float* dlogits);

// sigmoid_bias: scores [T, E] = sigmoid(logits); the k best of scores + bias [E] within the
// top_groups best of `groups` equal groups (a group's key: its two best keys summed);
// weights = scores at them (/ (their sum + 1e-20) when normalize) x scaling.
void sigmoid_bias_forward(const ExecContext& ctx, const float* logits, const float* bias, int64_t tokens, int64_t e_count, int64_t k,
                          int64_t groups, int64_t top_groups, bool normalize, float scaling, float* scores,
                          int32_t* experts, float* weights);
void sigmoid_bias_backward(const ExecContext& ctx, const float* scores, const int32_t* experts, int64_t tokens, int64_t e_count, int64_t k,
                           bool normalize, float scaling, const float* dweights, const float* dscores, float* dlogits);

// sinkhorn (routing_balanced_cuda.cu): probs = softmax(logits); `iterations` of row_scale
// [T] and col_scale [E] (col_scale from 1; the scales' sums in fp64, in a fixed order);
// experts, weights: the k largest col_scale x p per token, weights = p at them (/ their sum
// when normalize). The backward is softmax_topk_backward.
void sinkhorn_topk_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, int64_t k, int64_t iterations,
                           bool normalize, float* probs, float* row_scale, float* col_scale, int32_t* experts,
                           float* weights);
// expert_choice (routing_balanced_cuda.cu): probs = softmax(logits); expert e takes the
// `capacity` tokens of largest p (equal: the lower token), a block per expert; routes [T,
// E]: slot e = e (weight p) where taken, else -1 (weight 0).
void expert_choice_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, int64_t capacity, float* probs,
                           int32_t* experts, float* weights);

// relu (routing_relu_cuda.cu): routes [T, E] (slot e = e where logits > 0, weight the
// logit; else -1, 0), probs = the gates over their row sum (0 without one).
void relu_route_forward(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, float* probs, int32_t* experts,
                        float* weights);
// dlogits = [experts >= 0] (dweights + coef[0] grad_scale / T), grad_scale times
// *device_scale when that is not null (ops::GradScale).
void relu_route_backward(const ExecContext& ctx, const int32_t* experts, int64_t tokens, int64_t e_count, const float* dweights,
                         const float* coef, double grad_scale, const double* device_scale, float* dlogits);
// *sum += mean_t sum_e max(l, 0) (fp64 sums in a fixed order).
void relu_l1_sum(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, double* sum);
// ReMoE's coefficient step (ops::relu_l1_update), one thread.
void relu_l1_update(const ExecContext& ctx, float* coef, const int32_t* counts, int64_t e_count, const double* tokens, int64_t top_k,
                    double factor);

// probs [T, E] = scores / their row sums; and dscores (=) from dprobs.
void row_normalize_forward(const ExecContext& ctx, const float* scores, int64_t tokens, int64_t e_count, float* probs);
void row_normalize_backward(const ExecContext& ctx, const float* scores, const float* probs, const float* dprobs, int64_t tokens,
                            int64_t e_count, float* dscores);

// The balance loss E sum_i f_i P_i (f from the scope's counts, ops/moe/balance_scope.h,
// read on the device; P from probs' columns): *sum += its value (sum: a device double;
// null: not formed); with dprobs (null: none) also dprobs += (accumulate) or = grad_scale x
// its gradient (grad_scale times *device_scale when that is not null, as in
// relu_route_backward).
void balance_loss(const ExecContext& ctx, const float* probs, const balance_scope::Counts& counts, double grad_scale,
                  const double* device_scale, double* sum, float* dprobs, bool accumulate);
// step[e] += counts[e] for e < E, step[E] += tokens (one thread per element).
void balance_step_routes_add(const ExecContext& ctx, const int32_t* counts, int64_t e_count, int64_t tokens, double* step);
// The z-loss mean_t lse(logits_t)^2 (over *step_tokens in place of `tokens` when that is
// set and nonzero): *sum += its value (null: not formed); with dlogits (null: none) also
// dlogits += grad_scale (x *device_scale) x its gradient.
void router_z_loss(const ExecContext& ctx, const float* logits, int64_t tokens, int64_t e_count, const double* step_tokens,
                   double grad_scale, const double* device_scale, double* sum, float* dlogits);

// sigmoid_bias's balancing step from a step's routed choices per expert (counts i32 [E]):
// bias += rate x sign(mean - count) (sign) or rate x (mean - count) / mean; none when no
// choice was made. The CPU reference's arithmetic (doubles, then one float add).
void sigmoid_bias_update(const ExecContext& ctx, float* bias, const int32_t* counts, int64_t e_count, bool sign_rule, double rate);

// A double in the context's device scratch, for front ends that return a loss value
// to the host: reset, then read (synchronizes).
double* own_loss_sum(const ExecContext& ctx);
void reset_loss_sum(const ExecContext& ctx, double* sum);
double read_loss_sum(const ExecContext& ctx, const double* sum);

}  // namespace kiln::cuda
