#include "ops/optim/adamw_bf16_master.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/optim/adamw_bf16_master_math.h"

namespace kiln::ops {

namespace {

constexpr const char* kOp = "adamw_bf16_master";

void check(const AdamWBf16MasterTensor& t) {
  expect_dtype(kOp, "param", t.param, DType::bf16);
  for (const Tensor* x : {&t.grad, &t.m, &t.v}) {
    KILN_CHECK(x->defined(), kOp, "grad/m/v of {} is undefined", t.param.describe());
    expect_dtype(kOp, "grad/m/v", *x, DType::f32);
    KILN_CHECK(x->device() == t.param.device() && x->numel() == t.param.numel(), kOp,
               "grad/m/v must match param {}, got {}", t.param.describe(), x->describe());
  }
}

#if KILN_WITH_CUDA
cuda::AdamWBf16MasterArgs args_of(const AdamWBf16MasterTensor& t) {
  return {static_cast<uint16_t*>(t.param.raw()), t.grad.data<float>(), t.m.data<float>(), t.v.data<float>(),
          t.param.numel(), static_cast<float>(t.weight_decay), t.stream, t.index_base};
}
#endif

}  // namespace

void adamw_bf16_master_reference(uint16_t* p, const float* g, float* m, float* v, int64_t n, const AdamWStep& s,
                                 double weight_decay, uint64_t stream, int64_t update, int64_t index_base) {
  const adamw_lowmem::Factors f =
      adamw_lowmem::factors(static_cast<float>(s.lr), static_cast<float>(weight_decay),
                            static_cast<float>(s.bias_correction1), static_cast<float>(s.bias_correction2));
  const float b1 = static_cast<float>(s.beta1), b2 = static_cast<float>(s.beta2), eps = static_cast<float>(s.eps);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    adamw_bf16_master_element(p[i], g[i], m[i], v[i], b1, b2, eps, f, stream, static_cast<uint64_t>(update),
                              static_cast<uint64_t>(index_base + i));
}

void adamw_bf16_master_update_all(const ExecContext& ctx, const std::vector<AdamWBf16MasterTensor>& tensors,
                                  const AdamWStep& s, int64_t update) {
  if (tensors.empty()) return;
  KILN_OP_SCOPE(kOp, tensors.front().param);
  for (const AdamWBf16MasterTensor& t : tensors) {
    check(t);
    if (t.param.device() == Device::cuda) {
#if KILN_WITH_CUDA
      cuda::adamw_bf16_master_update(ctx, args_of(t), static_cast<float>(s.lr), static_cast<float>(s.beta1),
                                     static_cast<float>(s.beta2), static_cast<float>(s.eps),
                                     static_cast<float>(s.bias_correction1), static_cast<float>(s.bias_correction2),
                                     update);
      continue;
#else
      (void)ctx;
      no_cuda_kernel(kOp);
#endif
    }
    adamw_bf16_master_reference(static_cast<uint16_t*>(t.param.raw()), t.grad.data<float>(), t.m.data<float>(),
                                t.v.data<float>(), t.param.numel(), s, t.weight_decay, t.stream, update, t.index_base);
  }
}

void adamw_bf16_master_update_all_on_device(const ExecContext& ctx, const std::vector<AdamWBf16MasterTensor>& tensors,
                                            const AdamWStep& fixed, const DeviceUpdateScalars* scalars, int group) {
  if (tensors.empty()) return;
  KILN_CHECK(tensors.front().param.device() == Device::cuda, kOp, "scalars in device memory need GPU tensors");
  KILN_CHECK(group >= 0 && group < kMaxUpdateGroups, kOp, "update group {} out of range", group);
  KILN_OP_SCOPE(kOp, tensors.front().param);
#if KILN_WITH_CUDA
  for (const AdamWBf16MasterTensor& t : tensors) {
    check(t);
    cuda::adamw_bf16_master_update_on_device(ctx, args_of(t), static_cast<float>(fixed.beta1),
                                             static_cast<float>(fixed.beta2), static_cast<float>(fixed.eps), scalars,
                                             group);
  }
#else
  (void)ctx, (void)fixed, (void)scalars;
  no_cuda_kernel(kOp);
#endif
}

}  // namespace kiln::ops
