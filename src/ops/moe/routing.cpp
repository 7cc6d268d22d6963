// The routers' math (ops/moe/routing.h): front ends and the CPU reference; the GPU's
// kernels are routing_cuda.h.
#include "ops/moe/routing.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linear/linear.h"
#include "ops/linear/linear_cuda.h"
#include "ops/moe/balance_scope.h"
#include "ops/moe/routing_checks.h"
#include "ops/moe/routing_cuda.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kiln::ops {

using routing_detail::check_routes;
using routing_detail::gpu_router_math;
using routing_detail::top_k;

namespace {

// dlogits of a softmax row p from dp: p_j (dp_j - sum_m p_m dp_m).
template <typename T>
void softmax_row_backward(const T* p, const double* dp, int64_t n, T* dl) {
  double dot = 0;
  for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(p[j]) * dp[j];
  for (int64_t j = 0; j < n; ++j) dl[j] = static_cast<T>(static_cast<double>(p[j]) * (dp[j] - dot));
}

}  // namespace

void softmax_topk_forward(const ExecContext& ctx, const Tensor& logits, bool normalize, const Tensor& probs, const Routes& out) {
  const char* op = "softmax_topk";
  KILN_OP_SCOPE(op, logits);
  check_routes(op, logits, out);
  expect_same(op, "probs", probs, logits);
  expect_shape(op, "probs", probs, logits.shape());
  KILN_ON_CUDA(logits, op,
               cuda::softmax_topk_forward(ctx, logits.data<float>(), logits.size(0), logits.size(1), out.experts.size(1),
                                          normalize, probs.data<float>(), out.experts.data<int32_t>(),
                                          out.weights.data<float>()));
  dispatch_cpu_float(op, logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t t_count = logits.size(0), e_count = logits.size(1), k = out.experts.size(1);
    std::vector<double> p(static_cast<size_t>(e_count));
    std::vector<char> all(static_cast<size_t>(e_count), 1);
    std::vector<int32_t> best;
    for (int64_t t = 0; t < t_count; ++t) {
      const T* l = logits.data<T>() + t * e_count;
      const double m = *std::max_element(l, l + e_count);
      double sum = 0;
      for (int64_t j = 0; j < e_count; ++j) sum += p[static_cast<size_t>(j)] = std::exp(static_cast<double>(l[j]) - m);
      T* pr = probs.data<T>() + t * e_count;
      for (int64_t j = 0; j < e_count; ++j) pr[j] = static_cast<T>(p[static_cast<size_t>(j)] / sum);
      std::vector<double> key(pr, pr + e_count);  // choose on the stored probabilities
      top_k(key.data(), e_count, k, all, best);
      double chosen = 0;
      for (int32_t e : best) chosen += static_cast<double>(pr[e]);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = best[static_cast<size_t>(j)];
        out.experts.data<int32_t>()[t * k + j] = e;
        out.weights.data<T>()[t * k + j] = normalize ? static_cast<T>(static_cast<double>(pr[e]) / chosen) : pr[e];
      }
    }
  });
}

void softmax_topk_backward(const ExecContext& ctx, const Tensor& probs, const Routes& routes, bool normalize, const Tensor& dweights,
                           const Tensor& dprobs, const Tensor& dlogits) {
  const char* op = "softmax_topk_backward";
  KILN_OP_SCOPE(op, probs);
  check_routes(op, probs, routes);
  expect_same(op, "dweights", dweights, routes.weights);
  expect_shape(op, "dweights", dweights, routes.weights.shape());
  expect_same(op, "dlogits", dlogits, probs);
  expect_shape(op, "dlogits", dlogits, probs.shape());
  if (dprobs.defined()) expect_shape(op, "dprobs", dprobs, probs.shape()), expect_same(op, "dprobs", dprobs, probs);
  KILN_ON_CUDA(probs, op,
               cuda::softmax_topk_backward(ctx, probs.data<float>(), routes.experts.data<int32_t>(),
                                           routes.weights.data<float>(), probs.size(0), probs.size(1),
                                           routes.experts.size(1), normalize, dweights.data<float>(),
                                           dprobs.data_or_null<float>(), dlogits.data<float>()));
  dispatch_cpu_float(op, probs.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t t_count = probs.size(0), e_count = probs.size(1), k = routes.experts.size(1);
    std::vector<double> dp(static_cast<size_t>(e_count));
    for (int64_t t = 0; t < t_count; ++t) {
      const T* p = probs.data<T>() + t * e_count;
      const int32_t* ids = routes.experts.data<int32_t>() + t * k;
      const T* w = routes.weights.data<T>() + t * k;
      const T* dw = dweights.data<T>() + t * k;
      for (int64_t j = 0; j < e_count; ++j)
        dp[static_cast<size_t>(j)] = dprobs.defined() ? static_cast<double>(dprobs.data<T>()[t * e_count + j]) : 0.0;
      // Empty slots (expert_choice's: id -1, weight 0) carry nothing.
      if (normalize) {  // w_j = p_j / S: dp_i = (dw_i - sum_j dw_j w_j) / S
        double chosen = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j)
          if (ids[j] >= 0) chosen += static_cast<double>(p[ids[j]]), dot += static_cast<double>(dw[j]) * w[j];
        for (int64_t j = 0; j < k; ++j)
          if (ids[j] >= 0) dp[static_cast<size_t>(ids[j])] += (static_cast<double>(dw[j]) - dot) / chosen;
      } else {
        for (int64_t j = 0; j < k; ++j)
          if (ids[j] >= 0) dp[static_cast<size_t>(ids[j])] += static_cast<double>(dw[j]);
      }
      softmax_row_backward(p, dp.data(), e_count, dlogits.data<T>() + t * e_count);
    }
  });
}

void sigmoid_bias_forward(const ExecContext& ctx, const Tensor& logits, const Tensor& bias, int64_t groups, int64_t top_groups, bool normalize,
                          double scaling, const Tensor& scores, const Routes& out) {
  const char* op = "sigmoid_bias";
  KILN_OP_SCOPE(op, logits);
  check_routes(op, logits, out);
  const int64_t e_count = logits.size(1), k = out.experts.size(1);
  expect_same(op, "scores", scores, logits);
  expect_shape(op, "scores", scores, logits.shape());
  expect_shape(op, "bias", bias, Shape{e_count});
  KILN_CHECK(groups >= 1 && e_count % groups == 0 && top_groups >= 1 && top_groups <= groups &&
                 k <= top_groups * (e_count / groups),
             op, "top {} of {} experts in the top {} of {} groups", k, e_count, top_groups, groups);
  KILN_ON_CUDA(logits, op, {
    expect_same(op, "bias", bias, logits);
    cuda::sigmoid_bias_forward(ctx, logits.data<float>(), bias.data<float>(), logits.size(0), e_count, k, groups, top_groups,
                               normalize, static_cast<float>(scaling), scores.data<float>(), out.experts.data<int32_t>(),
                               out.weights.data<float>());
  });
  dispatch_cpu_float(op, logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    expect_dtype(op, "bias", bias, logits.dtype());
    const int64_t t_count = logits.size(0), size = e_count / groups;
    std::vector<double> key(static_cast<size_t>(e_count)), group_key(static_cast<size_t>(groups));
    std::vector<char> allowed(static_cast<size_t>(e_count)), all_groups(static_cast<size_t>(groups), 1);
    std::vector<int32_t> best, best_groups;
    for (int64_t t = 0; t < t_count; ++t) {
      const T* l = logits.data<T>() + t * e_count;
      T* s = scores.data<T>() + t * e_count;
      for (int64_t j = 0; j < e_count; ++j) {
        s[j] = static_cast<T>(1.0 / (1.0 + std::exp(-static_cast<double>(l[j]))));
        key[static_cast<size_t>(j)] = static_cast<double>(s[j]) + static_cast<double>(bias.data<T>()[j]);
      }
      // A group's score: the sum of its two best keys (its one key if it has one).
      for (int64_t g = 0; g < groups; ++g) {
        std::vector<double> in(key.begin() + g * size, key.begin() + (g + 1) * size);
        std::sort(in.begin(), in.end(), std::greater<>());
        group_key[static_cast<size_t>(g)] = in[0] + (size > 1 ? in[1] : 0.0);
      }
      top_k(group_key.data(), groups, top_groups, all_groups, best_groups);
      std::fill(allowed.begin(), allowed.end(), 0);
      for (int32_t g : best_groups) std::fill(allowed.begin() + g * size, allowed.begin() + (g + 1) * size, 1);
      top_k(key.data(), e_count, k, allowed, best);
      double chosen = 0;
      for (int32_t e : best) chosen += static_cast<double>(s[e]);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = best[static_cast<size_t>(j)];
        out.experts.data<int32_t>()[t * k + j] = e;
        const double w = normalize ? static_cast<double>(s[e]) / (chosen + 1e-20) : static_cast<double>(s[e]);
        out.weights.data<T>()[t * k + j] = static_cast<T>(w * scaling);
      }
    }
  });
}

void sigmoid_bias_backward(const ExecContext& ctx, const Tensor& scores, const Routes& routes, bool normalize, double scaling,
                           const Tensor& dweights, const Tensor& dscores, const Tensor& dlogits) {
  const char* op = "sigmoid_bias_backward";
  KILN_OP_SCOPE(op, scores);
  check_routes(op, scores, routes);
  expect_shape(op, "dweights", dweights, routes.weights.shape());
  expect_same(op, "dweights", dweights, scores);
  expect_shape(op, "dlogits", dlogits, scores.shape());
  expect_same(op, "dlogits", dlogits, scores);
  if (dscores.defined()) expect_shape(op, "dscores", dscores, scores.shape()), expect_same(op, "dscores", dscores, scores);
  KILN_ON_CUDA(scores, op,
               cuda::sigmoid_bias_backward(ctx, scores.data<float>(), routes.experts.data<int32_t>(), scores.size(0),
                                           scores.size(1), routes.experts.size(1), normalize,
                                           static_cast<float>(scaling), dweights.data<float>(), dscores.data_or_null<float>(),
                                           dlogits.data<float>()));
  dispatch_cpu_float(op, scores.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t t_count = scores.size(0), e_count = scores.size(1), k = routes.experts.size(1);
    std::vector<double> ds(static_cast<size_t>(e_count));
    for (int64_t t = 0; t < t_count; ++t) {
      const T* s = scores.data<T>() + t * e_count;
      const int32_t* ids = routes.experts.data<int32_t>() + t * k;
      const T* dw = dweights.data<T>() + t * k;
      for (int64_t j = 0; j < e_count; ++j)
        ds[static_cast<size_t>(j)] = dscores.defined() ? static_cast<double>(dscores.data<T>()[t * e_count + j]) : 0.0;
      if (normalize) {  // w_i = c s_i / (S + eps): ds_i = c (dw_i - sum_j dw_j s_j / (S + eps)) / (S + eps)
        double chosen = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) chosen += static_cast<double>(s[ids[j]]);
        const double denom = chosen + 1e-20;
        for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(dw[j]) * static_cast<double>(s[ids[j]]) / denom;
        for (int64_t j = 0; j < k; ++j)
          ds[static_cast<size_t>(ids[j])] += scaling * (static_cast<double>(dw[j]) - dot) / denom;
      } else {
        for (int64_t j = 0; j < k; ++j) ds[static_cast<size_t>(ids[j])] += scaling * static_cast<double>(dw[j]);
      }
      T* dl = dlogits.data<T>() + t * e_count;
      for (int64_t j = 0; j < e_count; ++j) {
        const double sj = static_cast<double>(s[j]);
        dl[j] = static_cast<T>(ds[static_cast<size_t>(j)] * sj * (1.0 - sj));
      }
    }
  });
}

namespace {

void check_balance(const char* op, const Tensor& probs, const Tensor& counts, const Tensor& dprobs, const Tensor& step_routes) {
  expect_rank(op, "probs", probs, 2);
  gpu_router_math(op, probs);
  expect_tensor(op, "counts", counts, Shape{probs.size(1)}, DType::i32, probs.device());
  if (dprobs.defined()) expect_shape(op, "dprobs", dprobs, probs.shape()), expect_same(op, "dprobs", dprobs, probs);
  if (step_routes.defined()) expect_tensor(op, "step_routes", step_routes, Shape{probs.size(1) + 1}, DType::f64, probs.device());
}

// The counts the loss takes (ops/moe/balance_scope.h), at device or host addresses.
balance_scope::Counts scope_counts(const Tensor& probs, const Tensor& counts, int64_t top_k, const Tensor& step_routes) {
  return {counts.data<int32_t>(), probs.size(0), step_routes.defined() ? step_routes.data<double>() : nullptr, probs.size(1),
          top_k};
}

const double* step_tokens_of(const Tensor& step_tokens) {
  return step_tokens.defined() ? step_tokens.data<double>() : nullptr;
}

// The CPU reference: the value, and with dprobs its gradient x grad_scale (+=).
double balance_loss_cpu(const char* op, const Tensor& probs, const balance_scope::Counts& c, double grad_scale,
                        const Tensor& dprobs) {
  double loss = 0;
  dispatch_cpu_float(op, probs.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t t_count = probs.size(0), e_count = probs.size(1);
    for (int64_t e = 0; e < e_count; ++e) {
      double p = 0;
      for (int64_t t = 0; t < t_count; ++t) p += static_cast<double>(probs.data<T>()[t * e_count + e]);
      loss += c.term(e, p);
      if (!dprobs.defined()) continue;
      const double g = c.gradient(e, grad_scale);
      for (int64_t t = 0; t < t_count; ++t) dprobs.data<T>()[t * e_count + e] += static_cast<T>(g);
    }
  });
  return loss;
}

void check_z(const char* op, const Tensor& logits, const Tensor& dlogits, const Tensor& step_tokens) {
  expect_rank(op, "logits", logits, 2);
  gpu_router_math(op, logits);
  if (dlogits.defined()) expect_shape(op, "dlogits", dlogits, logits.shape()), expect_same(op, "dlogits", dlogits, logits);
  if (step_tokens.defined()) expect_tensor(op, "step_tokens", step_tokens, Shape{1}, DType::f64, logits.device());
}

double router_z_loss_cpu(const char* op, const Tensor& logits, double grad_scale, const Tensor& dlogits, const Tensor& step_tokens) {
  double loss = 0;
  dispatch_cpu_float(op, logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t t_count = logits.size(0), e_count = logits.size(1);
    const double tokens = balance_scope::routed_tokens(step_tokens_of(step_tokens), t_count);
    for (int64_t t = 0; t < t_count; ++t) {
      const T* l = logits.data<T>() + t * e_count;
      const double m = *std::max_element(l, l + e_count);
      double sum = 0;
      for (int64_t j = 0; j < e_count; ++j) sum += std::exp(static_cast<double>(l[j]) - m);
      const double lse = m + std::log(sum);
      loss += lse * lse / tokens;
      if (!dlogits.defined()) continue;
      const double g = grad_scale * 2.0 * lse / tokens;
      for (int64_t j = 0; j < e_count; ++j)
        dlogits.data<T>()[t * e_count + j] += static_cast<T>(g * std::exp(static_cast<double>(l[j]) - lse));
    }
  });
  return loss;
}

}  // namespace

double cpu_grad_scale(const char* op, GradScale scale) {
  KILN_CHECK(scale.device == nullptr, op, "a gradient scale in device memory for a CPU tensor");
  return scale.host;
}

double balance_loss(const ExecContext& ctx, const Tensor& probs, const Tensor& counts, int64_t top_k, double grad_scale, const Tensor& dprobs,
                    const Tensor& step_routes) {
  const char* op = "balance_loss";
  KILN_OP_SCOPE(op, probs);
  check_balance(op, probs, counts, dprobs, step_routes);
  const balance_scope::Counts c = scope_counts(probs, counts, top_k, step_routes);
  if (probs.device() == Device::cuda) {
#if KILN_WITH_CUDA
    double* sum = cuda::own_loss_sum(ctx);
    cuda::reset_loss_sum(ctx, sum);
    cuda::balance_loss(ctx, probs.data<float>(), c, grad_scale, nullptr, sum, dprobs.data_or_null<float>(), /*accumulate=*/true);
    return cuda::read_loss_sum(ctx, sum);
#else
    no_cuda_kernel(op);
#endif
  }
  return balance_loss_cpu(op, probs, c, grad_scale, dprobs);
}

void balance_loss_sum(const ExecContext& ctx, const Tensor& probs, const Tensor& counts, int64_t top_k, double* sum,
                      const Tensor& step_routes) {
  const char* op = "balance_loss";
  KILN_OP_SCOPE(op, probs);
  check_balance(op, probs, counts, Tensor(), step_routes);
  KILN_CHECK(sum != nullptr, op, "no sum to add to");
  const balance_scope::Counts c = scope_counts(probs, counts, top_k, step_routes);
  KILN_ON_CUDA(probs, op, cuda::balance_loss(ctx, probs.data<float>(), c, 0, nullptr, sum, nullptr, true));
  *sum += balance_loss_cpu(op, probs, c, 0, Tensor());
}

void balance_loss_backward(const ExecContext& ctx, const Tensor& probs, const Tensor& counts, int64_t top_k, GradScale grad_scale,
                           const Tensor& dprobs, const Tensor& step_routes) {
  const char* op = "balance_loss_backward";
  KILN_OP_SCOPE(op, probs);
  check_balance(op, probs, counts, dprobs, step_routes);
  KILN_CHECK(dprobs.defined(), op, "dprobs is undefined");
  const balance_scope::Counts c = scope_counts(probs, counts, top_k, step_routes);
  KILN_ON_CUDA(probs, op, {
    cuda::balance_loss(ctx, probs.data<float>(), c, grad_scale.host, grad_scale.device, nullptr, dprobs.data<float>(),
                       /*accumulate=*/false);
  });
  zero_tensor(dprobs);
  balance_loss_cpu(op, probs, c, cpu_grad_scale(op, grad_scale), dprobs);
}

void balance_step_routes_add(const ExecContext& ctx, const Tensor& counts, int64_t tokens, const Tensor& step_routes) {
  const char* op = "balance_step_routes_add";
  KILN_OP_SCOPE(op, counts);
  expect_rank(op, "counts", counts, 1);
  expect_tensor(op, "counts", counts, counts.shape(), DType::i32, counts.device());
  expect_tensor(op, "step_routes", step_routes, Shape{counts.numel() + 1}, DType::f64, counts.device());
  KILN_CHECK(tokens >= 0, op, "{} tokens", tokens);
  const int64_t e_count = counts.numel();
  KILN_ON_CUDA(counts, op, cuda::balance_step_routes_add(ctx, counts.data<int32_t>(), e_count, tokens, step_routes.data<double>()));
  double* step = step_routes.data<double>();
  const int32_t* c = counts.data<int32_t>();
  for (int64_t e = 0; e < e_count; ++e) step[e] += static_cast<double>(c[e]);
  step[e_count] += static_cast<double>(tokens);
}

double router_z_loss(const ExecContext& ctx, const Tensor& logits, double grad_scale, const Tensor& dlogits, const Tensor& step_tokens) {
  const char* op = "router_z_loss";
  KILN_OP_SCOPE(op, logits);
  check_z(op, logits, dlogits, step_tokens);
  if (logits.device() == Device::cuda) {
#if KILN_WITH_CUDA
    double* sum = cuda::own_loss_sum(ctx);
    cuda::reset_loss_sum(ctx, sum);
    cuda::router_z_loss(ctx, logits.data<float>(), logits.size(0), logits.size(1), step_tokens_of(step_tokens), grad_scale,
                        nullptr, sum, dlogits.data_or_null<float>());
    return cuda::read_loss_sum(ctx, sum);
#else
    no_cuda_kernel(op);
#endif
  }
  return router_z_loss_cpu(op, logits, grad_scale, dlogits, step_tokens);
}

void router_z_loss_sum(const ExecContext& ctx, const Tensor& logits, double* sum, const Tensor& step_tokens) {
  const char* op = "router_z_loss";
  KILN_OP_SCOPE(op, logits);
  check_z(op, logits, Tensor(), step_tokens);
  KILN_CHECK(sum != nullptr, op, "no sum to add to");
  KILN_ON_CUDA(logits, op,
               cuda::router_z_loss(ctx, logits.data<float>(), logits.size(0), logits.size(1), step_tokens_of(step_tokens), 0,
                                   nullptr, sum, nullptr));
  *sum += router_z_loss_cpu(op, logits, 0, Tensor(), step_tokens);
}

void router_z_loss_backward(const ExecContext& ctx, const Tensor& logits, GradScale grad_scale, const Tensor& dlogits,
                            const Tensor& step_tokens) {
  const char* op = "router_z_loss_backward";
  KILN_OP_SCOPE(op, logits);
  check_z(op, logits, dlogits, step_tokens);
  KILN_CHECK(dlogits.defined(), op, "dlogits is undefined");
  KILN_ON_CUDA(logits, op,
               cuda::router_z_loss(ctx, logits.data<float>(), logits.size(0), logits.size(1), step_tokens_of(step_tokens),
                                   grad_scale.host, grad_scale.device, nullptr, dlogits.data<float>()));
  router_z_loss_cpu(op, logits, cpu_grad_scale(op, grad_scale), dlogits, step_tokens);
}

void router_logits(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& logits) {
  const char* op = "router_logits";
  KILN_OP_SCOPE(op, x);
  expect_rank(op, "x", x, 2);
  expect_rank(op, "w", w, 2);
  expect_same(op, "w", w, x);
  KILN_CHECK(x.size(1) == w.size(1), op, "x {} and w {} disagree on the hidden size", x.describe(), w.describe());
  if (!is_mixed(x)) return linear_forward(ctx, x, w, Tensor(), logits);
  expect_tensor(op, "logits", logits, Shape{x.size(0), w.size(0)}, DType::f32, x.device());
#if KILN_WITH_CUDA
  cuda::gemm(ctx, false, true, x.size(0), w.size(0), x.size(1), 1.0f, x.raw(), x.size(1), w.raw(), x.size(1), DType::bf16,
             0.0f, logits.raw(), w.size(0), DType::f32);
#endif
}

void router_logits_backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dlogits, const Tensor& scratch,
                            const Tensor& dx, const Tensor& dw) {
  const char* op = "router_logits_backward";
  KILN_OP_SCOPE(op, x);
  if (!is_mixed(x)) return linear_backward(ctx, x, w, dlogits, dx, dw, Tensor(), true);
  expect_tensor(op, "dlogits", dlogits, Shape{x.size(0), w.size(0)}, DType::f32, x.device());
  expect_tensor(op, "scratch", scratch, dlogits.shape(), DType::bf16, x.device());
  convert(ctx, dlogits, scratch);
  linear_backward(ctx, x, w, scratch, dx, dw, Tensor(), true);
}

void row_normalize_forward(const ExecContext& ctx, const Tensor& scores, const Tensor& probs) {
  const char* op = "row_normalize";
  KILN_OP_SCOPE(op, scores);
  expect_rank(op, "scores", scores, 2);
  gpu_router_math(op, scores);
  expect_same(op, "probs", probs, scores);
  expect_shape(op, "probs", probs, scores.shape());
  const int64_t rows = scores.size(0), e = scores.size(1);
  KILN_ON_CUDA(scores, op, cuda::row_normalize_forward(ctx, scores.data<float>(), rows, e, probs.data<float>()));
  dispatch_cpu_float(op, scores.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* s = scores.data<T>();
    T* p = probs.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < e; ++j) sum += s[r * e + j];
      for (int64_t j = 0; j < e; ++j) p[r * e + j] = static_cast<T>(s[r * e + j] / sum);
    }
  });
}

void row_normalize_backward(const ExecContext& ctx, const Tensor& scores, const Tensor& probs, const Tensor& dprobs, const Tensor& dscores) {
  const char* op = "row_normalize_backward";
  KILN_OP_SCOPE(op, scores);
  expect_rank(op, "scores", scores, 2);
  gpu_router_math(op, scores);
  for (const auto& [name, t] : {std::pair{"probs", &probs}, std::pair{"dprobs", &dprobs}, std::pair{"dscores", &dscores}}) {
    expect_same(op, name, *t, scores);
    expect_shape(op, name, *t, scores.shape());
  }
  const int64_t rows = scores.size(0), e = scores.size(1);
  KILN_ON_CUDA(scores, op,
               cuda::row_normalize_backward(ctx, scores.data<float>(), probs.data<float>(), dprobs.data<float>(), rows, e,
                                            dscores.data<float>()));
  // ds_m = (dp_m - sum_j dp_j p_j) / sum(s).
  dispatch_cpu_float(op, scores.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T *s = scores.data<T>(), *p = probs.data<T>(), *dp = dprobs.data<T>();
    T* out = dscores.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0, dot = 0;
      for (int64_t j = 0; j < e; ++j) sum += s[r * e + j], dot += dp[r * e + j] * p[r * e + j];
      for (int64_t j = 0; j < e; ++j) out[r * e + j] = (dp[r * e + j] - dot) / sum;
    }
  });
}

void sigmoid_bias_update(const ExecContext& ctx, const Tensor& bias, const Tensor& counts, bool sign_rule, double rate) {
  const char* op = "sigmoid_bias_update";
  KILN_OP_SCOPE(op, bias);
  expect_rank(op, "bias", bias, 1);
  gpu_router_math(op, bias);
  expect_tensor(op, "counts", counts, bias.shape(), DType::i32, bias.device());
  const int64_t e = bias.numel();
  KILN_ON_CUDA(bias, op, cuda::sigmoid_bias_update(ctx, bias.data<float>(), counts.data<int32_t>(), e, sign_rule, rate));
  const int32_t* c = counts.data<int32_t>();
  double mean = 0;
  for (int64_t j = 0; j < e; ++j) mean += c[j];
  mean /= static_cast<double>(e);
  if (mean <= 0) return;
  dispatch_cpu_float(op, bias.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* b = bias.data<T>();
    for (int64_t j = 0; j < e; ++j) {
      const double error = mean - c[j];  // > 0: the expert is under-loaded
      const double step = sign_rule ? rate * ((error > 0) - (error < 0)) : rate * error / mean;
      b[j] += static_cast<T>(step);
    }
  });
}

}  // namespace kiln::ops
