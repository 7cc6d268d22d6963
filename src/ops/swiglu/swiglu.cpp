#include "ops/swiglu/swiglu.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/cpu_exp.h"
#include "ops/swiglu/swiglu_cuda.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kiln::ops {

namespace {
void validate(const char* op, const Tensor& gate_up, const Tensor& half, const char* half_name) {
  expect_rank(op, "gate_up", gate_up, 2);
  KILN_CHECK(gate_up.size(1) % 2 == 0, op, "gate_up must have an even number of columns, got {}",
             gate_up.describe());
  expect_shape(op, half_name, half, Shape{gate_up.size(0), gate_up.size(1) / 2});
  expect_same(op, half_name, half, gate_up);
}

void validate_amax(const char* op, const Tensor& amax, const Tensor& gate_up) {
  if (!amax.defined()) return;
  KILN_CHECK(amax.dtype() == DType::f32 && amax.numel() == 1 && amax.device() == gate_up.device(), op,
             "amax must be one f32 on the {}, got {}", device_name(gate_up.device()), amax.describe());
}

float* amax_or_null(const Tensor& amax) { return amax.defined() ? amax.data<float>() : nullptr; }

// max |v| over n values (0 when empty).
template <typename T>
float largest_magnitude(const T* v, int64_t n) {
  T m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max<T>(m, std::fabs(v[i]));
  return static_cast<float>(m);
}
}  // namespace

void swiglu_forward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& out, const Tensor& amax) {
  const char* op = "swiglu";
  KILN_OP_SCOPE(op, gate_up);
  validate(op, gate_up, out, "out");
  validate_amax(op, amax, gate_up);
  KILN_ON_CUDA(gate_up, op, {
    if (is_mixed(gate_up))
      cuda::swiglu_forward_bf16(ctx, bf16_data(gate_up), gate_up.size(0), out.size(1), bf16_data(out),
                                amax_or_null(amax));
    else
      cuda::swiglu_forward_f32(ctx, gate_up.data<float>(), gate_up.size(0), out.size(1), out.data<float>(),
                               amax_or_null(amax));
  });
  dispatch_cpu_float(op, gate_up.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = gate_up.size(0), f = out.size(1);
    const T* gu = gate_up.data<T>();
    T* o = out.data<T>();
#pragma omp parallel
    {
      std::vector<T> e(static_cast<size_t>(f));  // exp(-g) of a row (cpu::exp_negated)
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        const T* g = gu + i * 2 * f;
        const T* u = g + f;
        cpu::exp_negated(g, e.data(), f);
        for (int64_t j = 0; j < f; ++j) o[i * f + j] = g[j] / (T(1) + e[j]) * u[j];
      }
    }
    if (amax.defined()) *amax.data<float>() = largest_magnitude(o, n * f);
  });
}

// silu(g) = g s(g), s = sigmoid; d silu/dg = s (1 + g (1 - s)).
void swiglu_backward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up,
                     const Tensor& out, const Tensor& amax) {
  const char* op = "swiglu_backward";
  KILN_OP_SCOPE(op, gate_up);
  validate_amax(op, amax, gate_up);
  validate(op, gate_up, dout, "dout");
  expect_shape(op, "dgate_up", dgate_up, gate_up.shape());
  expect_same(op, "dgate_up", dgate_up, gate_up);
  if (out.defined()) validate(op, gate_up, out, "out");
  KILN_ON_CUDA(gate_up, op, {
    if (is_mixed(gate_up))
      cuda::swiglu_backward_bf16(ctx, bf16_data(gate_up), bf16_data(dout), gate_up.size(0), dout.size(1),
                                 bf16_data(dgate_up), out.defined() ? bf16_data(out) : nullptr, amax_or_null(amax));
    else
      cuda::swiglu_backward_f32(ctx, gate_up.data<float>(), dout.data<float>(), gate_up.size(0), dout.size(1),
                                dgate_up.data<float>(), out.defined() ? out.data<float>() : nullptr, amax_or_null(amax));
  });
  dispatch_cpu_float(op, gate_up.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = gate_up.size(0), f = dout.size(1);
    const T* gu = gate_up.data<T>();
    const T* d = dout.data<T>();
    T* dgu = dgate_up.data<T>();
    T* o = out.defined() ? out.data<T>() : nullptr;
#pragma omp parallel
    {
      std::vector<T> e(static_cast<size_t>(f));
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        cpu::exp_negated(gu + i * 2 * f, e.data(), f);
        for (int64_t j = 0; j < f; ++j) {
          const T g = gu[i * 2 * f + j], u = gu[i * 2 * f + f + j], dy = d[i * f + j];
          const T s = T(1) / (T(1) + e[j]);
          dgu[i * 2 * f + j] = dy * u * s * (T(1) + g * (T(1) - s));
          dgu[i * 2 * f + f + j] = dy * g * s;
          if (o) o[i * f + j] = g / (T(1) + e[j]) * u;  // as swiglu_forward computes it
        }
      }
    }
    if (amax.defined()) *amax.data<float>() = largest_magnitude(dgu, n * 2 * f);
  });
}

}  // namespace kiln::ops
