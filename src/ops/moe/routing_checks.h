// Checks and the CPU top-k shared by the routers' front ends (routing*.cpp).
#pragma once

#include "ops/common.h"
#include "ops/moe/routing.h"
#include "ops/moe/routing_cuda.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kiln::ops::routing_detail {

// The GPU's routers compute in fp32 on rows of at most kRoutingMaxExperts experts.
inline void gpu_router_math(const char* op, const Tensor& t) {
  if (t.device() != Device::cuda) return;
  KILN_CHECK(t.dtype() == DType::f32, op, "the GPU's router math is fp32, got {}", t.describe());
#if KILN_WITH_CUDA
  KILN_CHECK(t.rank() != 2 || t.size(1) <= cuda::kRoutingMaxExperts, op, "{} experts: the GPU routes at most {}",
             t.size(1), cuda::kRoutingMaxExperts);
#endif
}

inline void check_routes(const char* op, const Tensor& logits, const Routes& r) {
  expect_rank(op, "logits", logits, 2);
  expect_rank(op, "experts", r.experts, 2);
  const int64_t t = logits.size(0), k = r.experts.size(1);
  KILN_CHECK(k >= 1 && k <= logits.size(1), op, "top {} of {} experts", k, logits.size(1));
  expect_tensor(op, "experts", r.experts, Shape{t, k}, DType::i32, logits.device());
  expect_tensor(op, "weights", r.weights, Shape{t, k}, logits.dtype(), logits.device());
  gpu_router_math(op, logits);
}

// probs [T, E] = the softmax of each row of logits, in double, stored in T (each exp once).
template <typename T>
void softmax_rows(const T* logits, int64_t t_count, int64_t e_count, T* probs) {
  std::vector<double> e(static_cast<size_t>(e_count));
  for (int64_t t = 0; t < t_count; ++t) {
    const T* l = logits + t * e_count;
    const double m = *std::max_element(l, l + e_count);
    double sum = 0;
    for (int64_t j = 0; j < e_count; ++j) sum += e[static_cast<size_t>(j)] = std::exp(static_cast<double>(l[j]) - m);
    for (int64_t j = 0; j < e_count; ++j) probs[t * e_count + j] = static_cast<T>(e[static_cast<size_t>(j)] / sum);
  }
}

// The k best of `key` (largest first; equal keys: the lower index), among `allowed` ones.
inline void top_k(const double* key, int64_t e_count, int64_t k, const std::vector<char>& allowed, std::vector<int32_t>& best) {
  best.resize(static_cast<size_t>(e_count));
  std::iota(best.begin(), best.end(), 0);
  std::stable_sort(best.begin(), best.end(), [&](int32_t a, int32_t b) {
    if (allowed[static_cast<size_t>(a)] != allowed[static_cast<size_t>(b)]) return allowed[static_cast<size_t>(a)] > allowed[static_cast<size_t>(b)];
    return key[a] > key[b];
  });
  best.resize(static_cast<size_t>(k));
}

}  // namespace kiln::ops::routing_detail
