// expert_choice's routing (ops/moe/routing.h): the front end and the CPU reference; the
// GPU's kernels are routing_balanced_cuda.cu.
#include "ops/moe/routing.h"

#include "core/op_profiler.h"
#include "ops/moe/routing_checks.h"

#include <cmath>

namespace kiln::ops {

void expert_choice_forward(const ExecContext& ctx, const Tensor& logits, int64_t capacity, const Tensor& probs, const Routes& out) {
  const char* op = "expert_choice";
  KILN_OP_SCOPE(op, logits);
  routing_detail::check_routes(op, logits, out);
  const int64_t t_count = logits.size(0), e_count = logits.size(1);
  KILN_CHECK(out.experts.size(1) == e_count, op, "routes {} for {} experts: expert_choice routes over E slots",
             out.experts.describe(), e_count);
  KILN_CHECK(capacity >= 0 && capacity <= t_count, op, "capacity {} of {} tokens", capacity, t_count);
  expect_same(op, "probs", probs, logits);
  expect_shape(op, "probs", probs, logits.shape());
  KILN_ON_CUDA(logits, op,
               cuda::expert_choice_forward(ctx, logits.data<float>(), t_count, e_count, capacity, probs.data<float>(),
                                           out.experts.data<int32_t>(), out.weights.data<float>()));
  dispatch_cpu_float(op, logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* p = probs.data<T>();
    routing_detail::softmax_rows(logits.data<T>(), t_count, e_count, p);
    int32_t* ids = out.experts.data<int32_t>();
    T* w = out.weights.data<T>();
    std::fill(ids, ids + t_count * e_count, -1);
    std::fill(w, w + t_count * e_count, T(0));
    // Per expert, the tokens of its column in order of p (largest first, equal: the lower token).
    std::vector<double> column(static_cast<size_t>(t_count));
    const std::vector<char> all(static_cast<size_t>(t_count), 1);
    std::vector<int32_t> best;
    for (int64_t e = 0; e < e_count; ++e) {
      for (int64_t t = 0; t < t_count; ++t) column[static_cast<size_t>(t)] = static_cast<double>(p[t * e_count + e]);
      routing_detail::top_k(column.data(), t_count, capacity, all, best);
      for (int32_t t : best) ids[t * e_count + e] = static_cast<int32_t>(e), w[t * e_count + e] = p[t * e_count + e];
    }
  });
}

}  // namespace kiln::ops
