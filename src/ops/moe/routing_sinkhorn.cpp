// sinkhorn's routing (ops/moe/routing.h): the front end and the CPU reference; the GPU's
// kernels are routing_balanced_cuda.cu.
#include "ops/moe/routing.h"

#include "core/op_profiler.h"
#include "ops/moe/routing_checks.h"

#include <cmath>

namespace kiln::ops {

namespace {

constexpr double kSinkhornEps = 1e-8;  // Megatron's: keeps an expert no token wants finite

}  // namespace

void sinkhorn_topk_forward(const ExecContext& ctx, const Tensor& logits, int64_t iterations, bool normalize, const Tensor& probs,
                           const Tensor& row_scale, const Tensor& col_scale, const Routes& out) {
  const char* op = "sinkhorn_topk";
  KILN_OP_SCOPE(op, logits);
  routing_detail::check_routes(op, logits, out);
  const int64_t t_count = logits.size(0), e_count = logits.size(1), k = out.experts.size(1);
  expect_same(op, "probs", probs, logits);
  expect_shape(op, "probs", probs, logits.shape());
  expect_same(op, "row_scale", row_scale, logits);
  expect_shape(op, "row_scale", row_scale, Shape{t_count});
  expect_same(op, "col_scale", col_scale, logits);
  expect_shape(op, "col_scale", col_scale, Shape{e_count});
  KILN_CHECK(iterations >= 0, op, "{} iterations", iterations);
  KILN_ON_CUDA(logits, op,
               cuda::sinkhorn_topk_forward(ctx, logits.data<float>(), t_count, e_count, k, iterations, normalize,
                                           probs.data<float>(), row_scale.data<float>(), col_scale.data<float>(),
                                           out.experts.data<int32_t>(), out.weights.data<float>()));
  dispatch_cpu_float(op, logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* p = probs.data<T>();
    routing_detail::softmax_rows(logits.data<T>(), t_count, e_count, p);
    // The scales in double, stored in T (the GPU keeps fp32 ones).
    T* r = row_scale.data<T>();
    T* c = col_scale.data<T>();
    std::fill(c, c + e_count, T(1));
    for (int64_t it = 0; it < iterations; ++it) {
      for (int64_t t = 0; t < t_count; ++t) {
        double s = 0;
        for (int64_t j = 0; j < e_count; ++j) s += static_cast<double>(c[j]) * static_cast<double>(p[t * e_count + j]);
        r[t] = static_cast<T>(1.0 / (static_cast<double>(t_count) * (s + kSinkhornEps)));
      }
      for (int64_t j = 0; j < e_count; ++j) {
        double s = 0;
        for (int64_t t = 0; t < t_count; ++t) s += static_cast<double>(r[t]) * static_cast<double>(p[t * e_count + j]);
        c[j] = static_cast<T>(1.0 / (static_cast<double>(e_count) * (s + kSinkhornEps)));
      }
    }
    std::vector<double> key(static_cast<size_t>(e_count));
    const std::vector<char> all(static_cast<size_t>(e_count), 1);
    std::vector<int32_t> best;
    for (int64_t t = 0; t < t_count; ++t) {
      const T* pr = p + t * e_count;
      for (int64_t j = 0; j < e_count; ++j)
        key[static_cast<size_t>(j)] = static_cast<double>(static_cast<T>(c[j] * pr[j]));  // as the GPU's fp32 product
      routing_detail::top_k(key.data(), e_count, k, all, best);
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

}  // namespace kiln::ops
