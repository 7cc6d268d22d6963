#include "ops/kda/kda_gate.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/stable_math.h"
#if KILN_WITH_CUDA
#include "ops/kda/kda_cuda.h"
#endif

#include <algorithm>
#include <cmath>

namespace kiln::ops {

namespace {

// The parameters' dtype: raw's on the CPU, f32 on the GPU (raw f32 or bf16 there).
DType param_dtype(const Tensor& raw) { return raw.device() == Device::cuda ? DType::f32 : raw.dtype(); }

// A parameter (or its gradient) of the gate: param_dtype on raw's device.
void expect_param(const char* op, const char* name, const Tensor& t, const Tensor& raw, Shape shape) {
  expect_tensor(op, name, t, shape, param_dtype(raw), raw.device());
}

void validate(const char* op, const Tensor& raw, const Tensor& A_log, const Tensor& dt_bias) {
  expect_rank(op, "raw", raw, 3);
  if (raw.device() == Device::cuda)
    KILN_CHECK(raw.dtype() == DType::f32 || raw.dtype() == DType::bf16, op, "raw must be f32 or bf16 on the GPU, got {}",
               raw.describe());
  expect_param(op, "A_log", A_log, raw, Shape{raw.size(1)});
  if (dt_bias.defined()) expect_param(op, "dt_bias", dt_bias, raw, Shape{raw.size(1), raw.size(2)});
}

void expect_like(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  expect_shape(op, name, t, like.shape());
  expect_same(op, name, t, like);
}

}  // namespace

void kda_gate_forward(const ExecContext& ctx, const Tensor& raw, const Tensor& A_log, const Tensor& dt_bias,
                      const Tensor& g) {
  const char* op = "kda_gate_forward";
  KILN_OP_SCOPE(op, raw);
  validate(op, raw, A_log, dt_bias);
  expect_like(op, "g", g, raw);
  KILN_ON_CUDA(raw, op,
               cuda::kda_gate_forward(ctx, raw.raw(), raw.dtype(), A_log.data<float>(), dt_bias.data_or_null<float>(),
                                      raw.size(0), raw.size(1), raw.size(2), g.raw()));
  dispatch_cpu_float(op, raw.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = raw.size(0), heads = raw.size(1), dk = raw.size(2);
    const T *x = raw.data<T>(), *a = A_log.data<T>(), *bias = dt_bias.defined() ? dt_bias.data<T>() : nullptr;
    T* out = g.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < dk; ++i) {
          const int64_t c = h * dk + i;
          out[t * heads * dk + c] = -std::exp(a[h]) * cpu::stable_softplus(x[t * heads * dk + c] + (bias ? bias[c] : T(0)));
        }
  });
}

// With x = raw + dt_bias: dg/draw = dg/d dt_bias = -exp(A_log) sigmoid(x) (softplus' is
// the sigmoid) and dg/dA_log = g itself.
void kda_gate_backward(const ExecContext& ctx, const Tensor& raw, const Tensor& A_log, const Tensor& dt_bias,
                       const Tensor& dg, const Tensor& draw, const Tensor& dA_log, const Tensor& ddt_bias) {
  const char* op = "kda_gate_backward";
  KILN_OP_SCOPE(op, raw);
  validate(op, raw, A_log, dt_bias);
  expect_like(op, "dg", dg, raw);
  expect_like(op, "draw", draw, raw);
  if (dA_log.defined()) expect_param(op, "dA_log", dA_log, raw, Shape{raw.size(1)});
  if (ddt_bias.defined()) expect_param(op, "ddt_bias", ddt_bias, raw, Shape{raw.size(1), raw.size(2)});
  KILN_ON_CUDA(raw, op,
               cuda::kda_gate_backward(ctx, raw.raw(), raw.dtype(), A_log.data<float>(), dt_bias.data_or_null<float>(), dg.raw(),
                                       raw.size(0), raw.size(1), raw.size(2), draw.raw(), dA_log.data_or_null<float>(),
                                       ddt_bias.data_or_null<float>()));
  dispatch_cpu_float(op, raw.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = raw.size(0), heads = raw.size(1), dk = raw.size(2), row = heads * dk;
    const T *x = raw.data<T>(), *a = A_log.data<T>(), *bias = dt_bias.defined() ? dt_bias.data<T>() : nullptr;
    const T* d = dg.data<T>();
    T* dx = draw.data<T>();
    T* da = dA_log.defined() ? dA_log.data<T>() : nullptr;
    T* db = ddt_bias.defined() ? ddt_bias.data<T>() : nullptr;
    // One head per item: it owns dA_log[h] and its channels' ddt_bias (sums over tokens).
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      const T rate = std::exp(a[h]);
      T sum_a = 0;
      for (int64_t i = 0; i < dk; ++i) {
        const int64_t c = h * dk + i;
        T sum_b = 0;
        for (int64_t t = 0; t < n; ++t) {
          const T xi = x[t * row + c] + (bias ? bias[c] : T(0)), dy = d[t * row + c];
          const T dxi = -rate * cpu::stable_sigmoid(xi) * dy;
          dx[t * row + c] = dxi;
          sum_b += dxi;
          sum_a += -rate * cpu::stable_softplus(xi) * dy;
        }
        if (db) db[c] += sum_b;
      }
      if (da) da[h] += sum_a;
    }
  });
}

}  // namespace kiln::ops
