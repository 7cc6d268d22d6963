#include "ops/rope/rope.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/rope/rope_cuda.h"

#include <cmath>

namespace kiln::ops {

std::vector<float> rope_inverse_frequencies(double theta, int64_t head_dim) {
  KILN_CHECK(head_dim % 2 == 0, "rope", "head_dim must be even, got {}", head_dim);
  std::vector<float> inv(static_cast<size_t>(head_dim / 2));
  for (int64_t j = 0; j < head_dim / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(head_dim);
    inv[static_cast<size_t>(j)] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  return inv;
}

void rope_fill_tables(const ExecContext& ctx, const std::vector<float>& inv_freq, const Tensor& cos, const Tensor& sin, float scale) {
  const char* op = "rope_tables";
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  expect_rank(op, "cos", cos, 2);
  KILN_CHECK(cos.size(1) >= half, op, "cos must have at least {} columns, got {}", half, cos.describe());
  expect_shape(op, "sin", sin, cos.shape());
  expect_same(op, "sin", sin, cos);
  KILN_CHECK(cos.device() == Device::cpu, op, "tables are built on the host");
  dispatch_cpu_float(op, cos.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t columns = cos.size(1);
    for (int64_t p = 0; p < cos.size(0); ++p) {
      T* c = cos.data<T>() + p * columns;
      T* s = sin.data<T>() + p * columns;
      for (int64_t j = 0; j < half; ++j) {
        const float angle = static_cast<float>(p) * inv_freq[static_cast<size_t>(j)];
        // cos and sin rounded to T, then scaled in T (transformers: emb.cos() * scaling).
        c[j] = static_cast<T>(std::cos(static_cast<double>(angle))) * static_cast<T>(scale);
        s[j] = static_cast<T>(std::sin(static_cast<double>(angle))) * static_cast<T>(scale);
      }
      for (int64_t j = half; j < columns; ++j) c[j] = T(1), s[j] = T(0);
    }
  });
}

void rope_apply(const ExecContext& ctx, const Tensor& x, const Tensor& positions, const Tensor& cos, const Tensor& sin, bool inverse) {
  const char* op = "rope";
  KILN_OP_SCOPE(op, x);
  expect_rank(op, "x", x, 3);
  expect_shape(op, "positions", positions, Shape{x.size(0)});
  expect_dtype(op, "positions", positions, DType::i32);
  KILN_CHECK(x.size(2) % 2 == 0, op, "head_dim must be even, got {}", x.describe());
  expect_rank(op, "cos", cos, 2);
  KILN_CHECK(cos.size(1) == x.size(2) / 2, op, "cos {} does not fit head_dim {}", cos.describe(), x.size(2));
  if (is_mixed(x)) {  // bf16 activations, fp32 tables
    expect_dtype(op, "cos", cos, DType::f32);
    expect_dtype(op, "sin", sin, DType::f32);
  } else {
    expect_same(op, "cos", cos, x);
    expect_same(op, "sin", sin, x);
  }
  KILN_ON_CUDA(x, op, {
    if (is_mixed(x))
      cuda::rope_apply_bf16(ctx, bf16_data(x), positions.data<int32_t>(), cos.data<float>(), sin.data<float>(), x.size(0),
                            x.size(1), x.size(2) / 2, inverse);
    else
      cuda::rope_apply_f32(ctx, x.data<float>(), positions.data<int32_t>(), cos.data<float>(), sin.data<float>(),
                           x.size(0), x.size(1), x.size(2) / 2, inverse);
  });
  const int64_t n = x.size(0), heads = x.size(1), half = x.size(2) / 2, max_pos = cos.size(0);
  const int32_t* pos = positions.data<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(pos[i] >= 0 && pos[i] < max_pos, op, "position {} at token {} is outside the table [0, {})", pos[i],
               i, max_pos);
  dispatch_cpu_float(op, x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* data = x.data<T>();
    const T sign = inverse ? T(-1) : T(1);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const T* c = cos.data<T>() + pos[i] * half;
      const T* s = sin.data<T>() + pos[i] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = data + (i * heads + h) * 2 * half;
        for (int64_t j = 0; j < half; ++j) {
          const T x1 = v[j], x2 = v[j + half], sj = sign * s[j];
          v[j] = x1 * c[j] - x2 * sj;
          v[j + half] = x2 * c[j] + x1 * sj;
        }
      }
    }
  });
}

}  // namespace kiln::ops
