// Fused AdamW update of one parameter tensor.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/optim/adamw_cuda.h"

#include <memory>
#include <vector>

namespace kiln::ops {

struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  double bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t
};

// p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
// p -= lr * (m / bc1) / (sqrt(v / bc2) + eps).
void adamw_update(const ExecContext& ctx, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWStep& step);

// The same update of many tensors, each with its own weight decay (step.weight_decay is
// ignored): one launch on the GPU (all tensors fp32 there), a loop of adamw_update on the CPU.
// `table` is the caller's device table of the list (created on first use; each optimizer
// keeps its own).
struct AdamWTensor {
  Tensor param, grad, m, v;
  double weight_decay = 0;
};
using AdamWDeviceTable = std::shared_ptr<cuda::AdamWTable>;
void adamw_update_all(const ExecContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& step, AdamWDeviceTable& table);

// The GPU form whose scalars live in device memory, read when the kernel runs (a training
// step captured as a CUDA graph): lr and bias corrections from scalars->group[group], every gradient
// multiplied by scalars->grad_scale (the clip factor; the same bits as scaling the
// gradients first), and no change at all while scalars->skip is set. beta1, beta2 and eps
// are fixed for a run.
void adamw_update_all_on_device(const ExecContext& ctx, const std::vector<AdamWTensor>& tensors, const AdamWStep& fixed,
                                const DeviceUpdateScalars* scalars, int group, AdamWDeviceTable& table);

}  // namespace kiln::ops
