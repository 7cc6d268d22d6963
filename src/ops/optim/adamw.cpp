#include "ops/optim/adamw.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/optim/adamw_cuda.h"

#include <cmath>

namespace kiln::ops {

void adamw_update(const ExecContext& ctx, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWStep& s) {
  const char* op = "adamw";
  KILN_OP_SCOPE(op, param);
  expect_same(op, "grad", grad, param);
  expect_same(op, "m", m, param);
  expect_same(op, "v", v, param);
  KILN_CHECK(grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(), op,
             "size mismatch: param {}, grad {}, m {}, v {}", param.describe(), grad.describe(), m.describe(),
             v.describe());
  KILN_ON_CUDA(param, op, cuda::adamw_update_f32(ctx, param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(),
                                                 param.numel(), static_cast<float>(s.lr), static_cast<float>(s.beta1),
                                                 static_cast<float>(s.beta2), static_cast<float>(s.eps),
                                                 static_cast<float>(s.weight_decay),
                                                 static_cast<float>(s.bias_correction1),
                                                 static_cast<float>(s.bias_correction2)));
  dispatch_cpu_float(op, param.dtype(), [&](auto zero) {
    using T = decltype(zero);
    T* p = param.data<T>();
    const T* g = grad.data<T>();
    T* mp = m.data<T>();
    T* vp = v.data<T>();
    const T decay = static_cast<T>(1.0 - s.lr * s.weight_decay);
    const T b1 = static_cast<T>(s.beta1), b2 = static_cast<T>(s.beta2);
    const T step_size = static_cast<T>(s.lr / s.bias_correction1);
    const T inv_sqrt_bc2 = static_cast<T>(1.0 / std::sqrt(s.bias_correction2));
    const T eps = static_cast<T>(s.eps);
    const int64_t n = param.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      mp[i] = b1 * mp[i] + (T(1) - b1) * g[i];
      vp[i] = b2 * vp[i] + (T(1) - b2) * g[i] * g[i];
      p[i] = p[i] * decay - step_size * mp[i] / (std::sqrt(vp[i]) * inv_sqrt_bc2 + eps);
    }
  });
}

#if KILN_WITH_CUDA
namespace {
// The multi-tensor kernel's list (kept: no allocation per step), after checking each entry.
const std::vector<cuda::AdamWTensorF32>& device_list(const char* op, const std::vector<AdamWTensor>& tensors) {
  static thread_local std::vector<cuda::AdamWTensorF32> list;
  list.clear();
  for (const AdamWTensor& t : tensors) {
    for (const Tensor* x : {&t.grad, &t.m, &t.v}) {
      expect_same(op, "grad/m/v", *x, t.param);
      KILN_CHECK(x->numel() == t.param.numel(), op, "size mismatch: param {}, {}", t.param.describe(), x->describe());
    }
    list.push_back({t.param.data<float>(), t.grad.data<float>(), t.m.data<float>(), t.v.data<float>(),
                    t.param.numel(), static_cast<float>(t.weight_decay)});
  }
  return list;
}
}  // namespace
#endif

#if KILN_WITH_CUDA
namespace {
cuda::AdamWTable& table_of(AdamWDeviceTable& table) {
  if (!table) table = cuda::make_adamw_table();
  return *table;
}
}  // namespace
#endif

void adamw_update_all(const ExecContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& s, AdamWDeviceTable& table) {
  if (tensors.empty()) return;
  if (tensors.front().param.device() == Device::cuda) {
#if KILN_WITH_CUDA
    const char* op = "adamw";
    KILN_OP_SCOPE(op, tensors.front().param);
    const auto& list = device_list(op, tensors);
    cuda::adamw_update_many_f32(ctx, table_of(table), list.data(), static_cast<int64_t>(list.size()), static_cast<float>(s.lr),
                                static_cast<float>(s.beta1), static_cast<float>(s.beta2), static_cast<float>(s.eps),
                                static_cast<float>(s.bias_correction1), static_cast<float>(s.bias_correction2));
    return;
#else
    (void)table;
    no_cuda_kernel("adamw");
#endif
  }
  for (const AdamWTensor& t : tensors) {
    AdamWStep one = s;
    one.weight_decay = t.weight_decay;
    adamw_update(ctx, t.param, t.grad, t.m, t.v, one);
  }
}

void adamw_update_all_on_device(const ExecContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& fixed,
                                const DeviceUpdateScalars* scalars, int group, AdamWDeviceTable& table) {
  const char* op = "adamw";
  if (tensors.empty()) return;
  KILN_CHECK(tensors.front().param.device() == Device::cuda, op, "scalars in device memory need GPU tensors");
  KILN_OP_SCOPE(op, tensors.front().param);
#if KILN_WITH_CUDA
  const auto& list = device_list(op, tensors);
  cuda::adamw_update_many_device_f32(ctx, table_of(table), list.data(), static_cast<int64_t>(list.size()),
                                     static_cast<float>(fixed.beta1), static_cast<float>(fixed.beta2),
                                     static_cast<float>(fixed.eps), scalars, group);
#else
  (void)fixed, (void)scalars, (void)group, (void)table;
  no_cuda_kernel(op);
#endif
}

}  // namespace kiln::ops
