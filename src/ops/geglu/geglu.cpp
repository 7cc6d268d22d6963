#include "ops/geglu/geglu.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/geglu/gelu_tanh.h"
#if KILN_WITH_CUDA
#include "ops/geglu/geglu_cuda.h"
#endif

namespace kiln::ops {

namespace {

// gate_up [N, 2F] and a half-width partner [N, F] of the same dtype and device; on the GPU
// f32 or bf16.
void validate(const char* op, const Tensor& gate_up, const Tensor& half, const char* half_name) {
  expect_rank(op, "gate_up", gate_up, 2);
  KILN_CHECK(gate_up.size(1) % 2 == 0, op, "gate_up must have an even number of columns, got {}",
             gate_up.describe());
  expect_shape(op, half_name, half, Shape{gate_up.size(0), gate_up.size(1) / 2});
  expect_same(op, half_name, half, gate_up);
  if (gate_up.device() == Device::cuda)
    KILN_CHECK(gate_up.dtype() == DType::f32 || gate_up.dtype() == DType::bf16, op,
               "gate_up must be f32 or bf16 on the GPU, got {}", gate_up.describe());
}

}  // namespace

void geglu_forward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& out) {
  const char* op = "geglu";
  KILN_OP_SCOPE(op, gate_up);
  validate(op, gate_up, out, "out");
  KILN_ON_CUDA(gate_up, op,
               cuda::geglu_forward(ctx, gate_up.raw(), gate_up.dtype(), gate_up.size(0), out.size(1), out.raw()));
  dispatch_cpu_float(op, gate_up.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = gate_up.size(0), f = out.size(1);
    const T* gu = gate_up.data<T>();
    T* o = out.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j) o[i * f + j] = gelu::value(gu[i * 2 * f + j]) * gu[i * 2 * f + f + j];
  });
}

// d out / d gate = gelu_tanh'(gate) * up, d out / d up = gelu_tanh(gate).
void geglu_backward(const ExecContext& ctx, const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up, const Tensor& out) {
  const char* op = "geglu_backward";
  KILN_OP_SCOPE(op, gate_up);
  validate(op, gate_up, dout, "dout");
  expect_shape(op, "dgate_up", dgate_up, gate_up.shape());
  expect_same(op, "dgate_up", dgate_up, gate_up);
  if (out.defined()) validate(op, gate_up, out, "out");
  KILN_ON_CUDA(gate_up, op,
               cuda::geglu_backward(ctx, gate_up.raw(), dout.raw(), gate_up.dtype(), gate_up.size(0), dout.size(1),
                                    dgate_up.raw(), out.defined() ? out.raw() : nullptr));
  dispatch_cpu_float(op, gate_up.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = gate_up.size(0), f = dout.size(1);
    const T* gu = gate_up.data<T>();
    const T* d = dout.data<T>();
    T* dgu = dgate_up.data<T>();
    T* o = out.defined() ? out.data<T>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j) {
        const T g = gu[i * 2 * f + j], u = gu[i * 2 * f + f + j], dy = d[i * f + j];
        const T act = gelu::value(g);
        dgu[i * 2 * f + j] = dy * u * gelu::derivative(g);
        dgu[i * 2 * f + f + j] = dy * act;
        if (o) o[i * f + j] = act * u;  // as geglu_forward computes it (after dout is read)
      }
  });
}

}  // namespace kiln::ops
