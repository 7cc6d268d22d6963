// relu's routing (ReMoE; ops/moe/routing.h): the front ends and the CPU reference; the
// GPU's kernels are routing_relu_cuda.cu.
#include "ops/moe/routing.h"

#include "core/op_profiler.h"
#include "ops/moe/routing_checks.h"

namespace kiln::ops {

namespace {

void check_relu_routes(const char* op, const Tensor& logits, const Routes& routes) {
  routing_detail::check_routes(op, logits, routes);
  KILN_CHECK(routes.experts.size(1) == logits.size(1), op, "routes {} for {} experts: relu routes over E slots",
             routes.experts.describe(), logits.size(1));
}

void check_coef(const char* op, const Tensor& coef, const Tensor& like) {
  expect_same(op, "coef", coef, like);
  expect_shape(op, "coef", coef, Shape{1});
}

double relu_l1_cpu(const char* op, const Tensor& logits) {
  double sum = 0;
  dispatch_cpu_float(op, logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    for (int64_t i = 0; i < logits.numel(); ++i) sum += std::max(0.0, static_cast<double>(logits.data<T>()[i]));
  });
  return logits.size(0) > 0 ? sum / static_cast<double>(logits.size(0)) : 0.0;
}

}  // namespace

void relu_route_forward(const ExecContext& ctx, const Tensor& logits, const Tensor& probs, const Routes& out) {
  const char* op = "relu_route";
  KILN_OP_SCOPE(op, logits);
  check_relu_routes(op, logits, out);
  expect_same(op, "probs", probs, logits);
  expect_shape(op, "probs", probs, logits.shape());
  const int64_t t_count = logits.size(0), e_count = logits.size(1);
  KILN_ON_CUDA(logits, op,
               cuda::relu_route_forward(ctx, logits.data<float>(), t_count, e_count, probs.data<float>(),
                                        out.experts.data<int32_t>(), out.weights.data<float>()));
  dispatch_cpu_float(op, logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    for (int64_t t = 0; t < t_count; ++t) {
      const T* l = logits.data<T>() + t * e_count;
      double sum = 0;
      for (int64_t j = 0; j < e_count; ++j) sum += std::max(0.0, static_cast<double>(l[j]));
      for (int64_t j = 0; j < e_count; ++j) {
        const bool on = l[j] > T(0);
        out.experts.data<int32_t>()[t * e_count + j] = on ? static_cast<int32_t>(j) : -1;
        out.weights.data<T>()[t * e_count + j] = on ? l[j] : T(0);
        probs.data<T>()[t * e_count + j] = on ? static_cast<T>(static_cast<double>(l[j]) / sum) : T(0);
      }
    }
  });
}

void relu_route_backward(const ExecContext& ctx, const Routes& routes, const Tensor& dweights, const Tensor& coef, GradScale grad_scale,
                         const Tensor& dlogits) {
  const char* op = "relu_route_backward";
  KILN_OP_SCOPE(op, dlogits);
  check_relu_routes(op, dlogits, routes);
  expect_same(op, "dweights", dweights, routes.weights);
  expect_shape(op, "dweights", dweights, routes.weights.shape());
  check_coef(op, coef, dlogits);
  const int64_t t_count = dlogits.size(0), e_count = dlogits.size(1);
  KILN_ON_CUDA(dlogits, op,
               cuda::relu_route_backward(ctx, routes.experts.data<int32_t>(), t_count, e_count, dweights.data<float>(),
                                         coef.data<float>(), grad_scale.host, grad_scale.device, dlogits.data<float>()));
  const double scale = cpu_grad_scale(op, grad_scale);
  dispatch_cpu_float(op, dlogits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const double l1 = static_cast<double>(coef.data<T>()[0]) * scale / static_cast<double>(t_count);
    for (int64_t i = 0; i < t_count * e_count; ++i) {
      const bool on = routes.experts.data<int32_t>()[i] >= 0;  // the gate is positive
      dlogits.data<T>()[i] = on ? static_cast<T>(static_cast<double>(dweights.data<T>()[i]) + l1) : T(0);
    }
  });
}

double relu_l1(const ExecContext& ctx, const Tensor& logits) {
  const char* op = "relu_l1";
  KILN_OP_SCOPE(op, logits);
  expect_rank(op, "logits", logits, 2);
  routing_detail::gpu_router_math(op, logits);
  if (logits.device() == Device::cuda) {
#if KILN_WITH_CUDA
    double* sum = cuda::own_loss_sum(ctx);
    cuda::reset_loss_sum(ctx, sum);
    cuda::relu_l1_sum(ctx, logits.data<float>(), logits.size(0), logits.size(1), sum);
    return cuda::read_loss_sum(ctx, sum);
#else
    no_cuda_kernel(op);
#endif
  }
  return relu_l1_cpu(op, logits);
}

void relu_l1_sum(const ExecContext& ctx, const Tensor& logits, double* sum) {
  const char* op = "relu_l1";
  KILN_OP_SCOPE(op, logits);
  expect_rank(op, "logits", logits, 2);
  routing_detail::gpu_router_math(op, logits);
  KILN_CHECK(sum != nullptr, op, "no sum to add to");
  KILN_ON_CUDA(logits, op, cuda::relu_l1_sum(ctx, logits.data<float>(), logits.size(0), logits.size(1), sum));
  *sum += relu_l1_cpu(op, logits);
}

void relu_l1_update(const ExecContext& ctx, const Tensor& coef, const Tensor& counts, const Tensor& tokens, int64_t top_k, double factor) {
  const char* op = "relu_l1_update";
  KILN_OP_SCOPE(op, coef);
  expect_shape(op, "coef", coef, Shape{1});
  routing_detail::gpu_router_math(op, coef);
  expect_rank(op, "counts", counts, 1);
  expect_tensor(op, "counts", counts, counts.shape(), DType::i32, coef.device());
  expect_tensor(op, "tokens", tokens, Shape{1}, DType::f64, coef.device());
  const int64_t e_count = counts.numel();
  KILN_CHECK(top_k >= 1 && top_k <= e_count && factor > 1, op, "target {} of {} experts, factor {}", top_k, e_count,
             factor);
  KILN_ON_CUDA(coef, op,
               cuda::relu_l1_update(ctx, coef.data<float>(), counts.data<int32_t>(), e_count, tokens.data<double>(), top_k,
                                    factor));
  const double n = tokens.data<double>()[0];
  if (n <= 0) return;
  double pairs = 0;
  for (int64_t e = 0; e < e_count; ++e) pairs += counts.data<int32_t>()[e];
  const double sparsity = 1.0 - pairs / (n * static_cast<double>(e_count));
  const double target = 1.0 - static_cast<double>(top_k) / static_cast<double>(e_count);
  dispatch_cpu_float(op, coef.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T& c = coef.data<T>()[0];
    c = static_cast<T>(sparsity < target ? static_cast<double>(c) * factor : static_cast<double>(c) / factor);
  });
}

}  // namespace kiln::ops
