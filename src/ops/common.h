// Shared front-end helpers for ops: validation that throws "[op] ..." and dispatch of
// the CPU reference over its float types (f32 for training, f64 for gradient checks).
#pragma once

#include "core/error.h"
#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

inline void expect_rank(const char* op, const char* name, const Tensor& t, int rank) {
  KILN_CHECK(t.defined(), op, "{} is undefined", name);
  KILN_CHECK(t.rank() == rank, op, "{} must have rank {}, got {}", name, rank, t.describe());
}

inline void expect_shape(const char* op, const char* name, const Tensor& t, Shape shape) {
  KILN_CHECK(t.defined(), op, "{} is undefined", name);
  KILN_CHECK(t.shape() == shape, op, "{} must be {}, got {}", name, shape.str(), t.describe());
}

inline void expect_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  KILN_CHECK(t.dtype() == dtype, op, "{} must be {}, got {}", name, dtype_name(dtype), t.describe());
}

// t is defined, has `shape` and `dtype`, and lives on `device` (for operands whose dtype
// differs from the op's inputs on the mixed-precision path).
inline void expect_tensor(const char* op, const char* name, const Tensor& t, Shape shape, DType dtype,
                          Device device) {
  expect_shape(op, name, t, shape);
  expect_dtype(op, name, t, dtype);
  KILN_CHECK(t.device() == device, op, "{} must be on {}, got {}", name, device_name(device), t.describe());
}

inline void expect_same(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  KILN_CHECK(t.defined(), op, "{} is undefined", name);
  KILN_CHECK(t.dtype() == like.dtype() && t.device() == like.device(), op, "{} must be {}@{}, got {}", name,
             dtype_name(like.dtype()), device_name(like.device()), t.describe());
}

// The GPU's mixed-precision path: bf16 activations with fp32 gains, statistics and
// gradients (the layout is described in ops/mixed_precision.h).
inline bool is_mixed(const Tensor& t) { return t.device() == Device::cuda && t.dtype() == DType::bf16; }

// The 16-bit payload of a bf16 tensor, for the bf16 kernels (ops/mixed_precision.h).
inline uint16_t* bf16_data(const Tensor& t) {
  KILN_CHECK(t.dtype() == DType::bf16, "tensor", "expected bf16, got {}", t.describe());
  return static_cast<uint16_t*>(t.raw());
}

// Calls fn(T{}) with T = float or double for a CPU tensor of that dtype.
template <typename Fn>
void dispatch_cpu_float(const char* op, DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: fn(float{}); return;
    case DType::f64: fn(double{}); return;
    default: fail(op, "the CPU backend computes in f32 or f64, got {}", dtype_name(dtype));
  }
}

// Runs the CUDA kernel call(s) and returns when `tensor` lives on the GPU; the calls pick
// their kernels by dtype (typed access throws on a dtype no kernel takes). In a build
// without CUDA, a GPU tensor is an error.
#if KILN_WITH_CUDA
#define KILN_ON_CUDA(tensor, op, ...)              \
  if ((tensor).device() == ::kiln::Device::cuda) { \
    __VA_ARGS__;                                   \
    return;                                        \
  }
#else
#define KILN_ON_CUDA(tensor, op, ...) \
  if ((tensor).device() == ::kiln::Device::cuda) ::kiln::ops::no_cuda_kernel(op);
#endif

// The CUDA path of an op that does not have a kernel yet.
[[noreturn]] inline void no_cuda_kernel(const char* op) {
  fail(op, "no CUDA kernel yet{}", KILN_WITH_CUDA ? "" : " (this kiln was built without CUDA)");
}

}  // namespace kiln::ops
