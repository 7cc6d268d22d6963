#include "ops/split/qkv_split.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/split/qkv_split_cuda.h"

#include <cstring>

namespace kiln::ops {

namespace {

void validate(const char* op, const Tensor& fused, const Tensor& q, const Tensor& k, const Tensor& v) {
  expect_rank(op, "q", q, 3);
  expect_rank(op, "k", k, 3);
  expect_shape(op, "v", v, k.shape());
  expect_same(op, "k", k, q);
  expect_same(op, "v", v, q);
  const int64_t n = q.size(0), cols = (q.size(1) + 2 * k.size(1)) * q.size(2);
  KILN_CHECK(k.size(0) == n && k.size(2) == q.size(2), op, "q {} and k {} disagree", q.describe(), k.describe());
  expect_shape(op, "qkv", fused, Shape{n, cols});
  expect_same(op, "qkv", fused, q);
}

// Copies between the fused rows and the three parts; to_parts picks the direction.
template <typename T>
void shuffle(T* fused, T* q, T* k, T* v, int64_t n, int64_t q_cols, int64_t kv_cols, bool to_parts) {
  const int64_t cols = q_cols + 2 * kv_cols;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T* row = fused + i * cols;
    T* parts[3] = {q + i * q_cols, k + i * kv_cols, v + i * kv_cols};
    const int64_t widths[3] = {q_cols, kv_cols, kv_cols};
    int64_t offset = 0;
    for (int p = 0; p < 3; ++p) {
      if (to_parts)
        std::memcpy(parts[p], row + offset, sizeof(T) * widths[p]);
      else
        std::memcpy(row + offset, parts[p], sizeof(T) * widths[p]);
      offset += widths[p];
    }
  }
}

[[maybe_unused]] void shuffle_cuda(const ExecContext& ctx, const Tensor& fused, const Tensor& q, const Tensor& k, const Tensor& v,
                                  bool to_parts) {
  const int64_t n = q.size(0), q_cols = q.size(1) * q.size(2), kv_cols = k.size(1) * k.size(2);
  if (is_mixed(q))
    cuda::qkv_shuffle_bf16(ctx, bf16_data(fused), bf16_data(q), bf16_data(k), bf16_data(v), n, q_cols, kv_cols, to_parts);
  else
    cuda::qkv_shuffle_f32(ctx, fused.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(), n, q_cols, kv_cols,
                          to_parts);
}

}  // namespace

void qkv_split(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  validate("qkv_split", qkv, q, k, v);
  KILN_OP_SCOPE("qkv_split", q);
  KILN_ON_CUDA(q, "qkv_split", shuffle_cuda(ctx, qkv, q, k, v, true));
  dispatch_cpu_float("qkv_split", q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    shuffle<T>(qkv.data<T>(), q.data<T>(), k.data<T>(), v.data<T>(), q.size(0), q.size(1) * q.size(2),
               k.size(1) * k.size(2), true);
  });
}

void qkv_merge(const ExecContext& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv) {
  validate("qkv_merge", dqkv, dq, dk, dv);
  KILN_OP_SCOPE("qkv_merge", dq);
  KILN_ON_CUDA(dq, "qkv_merge", shuffle_cuda(ctx, dqkv, dq, dk, dv, false));
  dispatch_cpu_float("qkv_merge", dq.dtype(), [&](auto zero) {
    using T = decltype(zero);
    shuffle<T>(dqkv.data<T>(), dq.data<T>(), dk.data<T>(), dv.data<T>(), dq.size(0), dq.size(1) * dq.size(2),
               dk.size(1) * dk.size(2), false);
  });
}

}  // namespace kiln::ops
