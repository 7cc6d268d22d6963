#include "model/skipped_module.h"

#include "core/arena.h"
#include "nn/step_statistics.h"
#include "nn/weight_grad_deferral.h"

#include <memory>
#include <vector>

namespace kiln {

size_t count_skipped_parameters(const BuildContext& ctx, const std::function<void(BuildContext&)>& build) {
  Arena params("skipped parameters", ctx.device), grads("skipped gradients", ctx.device),
      activations("skipped activations", ctx.device), buffers("skipped buffers", ctx.device),
      step_buffers("skipped step buffers", ctx.device);
  Workspace workspace(ctx.device);
  std::vector<std::unique_ptr<Parameter>> parameters;
  ComputeWeights compute_weights(ctx.device);
  std::vector<Tensor*> kept_views;
  StepStatistics statistics;
  WeightGradDeferral deferral;
  BuildContext skipped{.exec = ctx.exec,
                       .params = params,
                       .grads = grads,
                       .activations = activations,
                       .workspace = workspace,
                       .parameters = parameters,
                       .compute_weights = compute_weights,
                       .precision = ctx.precision,
                       .device = ctx.device,
                       .max_tokens = ctx.max_tokens,
                       .training = ctx.training,
                       .deterministic = ctx.deterministic,
                       .losses = ctx.losses,
                       .buffers = &buffers,
                       .step_buffers = &step_buffers,
                       .kept_views = &kept_views,
                       .qk_clip_tau = ctx.qk_clip_tau,
                       .deferral = ctx.deferral != nullptr ? &deferral : nullptr,
                       .step_statistics = &statistics,
                       .bf16_masters = ctx.bf16_masters};
  build(skipped);
  return parameters.size();
}

}  // namespace kiln
