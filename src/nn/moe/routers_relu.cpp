// relu (ReMoE, Wang et al. 2024, arXiv 2412.14711; nn/moe/router.h): ReLU gates, a token
// going to every expert whose gate is positive, kept sparse by an L1 penalty whose
// coefficient adapts each step toward a target sparsity.
#include "nn/moe/router.h"

#include "ops/moe/routing.h"

#include <fmt/format.h>

namespace kiln {

namespace {

// gates = ReLU(logits); a token goes to each expert with a positive gate, weighted by it
// (0..E experts: routes of E slots, empty ones -1, so the grouped layout is planned for T E
// rows, E / k times a top-k router's). The penalty, loss slot "moe_l1" (summed over the
// sparse layers): lambda x mean_t sum_e gate_te, its gradient lambda / T on each positive
// gate. lambda starts at model.moe.l1_coef and after each applied step is multiplied by
// model.moe.l1_rate when the step's sparsity (the share of zero gates) is below the target
// 1 - top_k / E, else divided by it (ReMoE's rule; top_k is the mean active count aimed
// at). lambda is model state ("mlp.gate.l1_coef"), saved with the weights and in
// checkpoints. The probabilities the diagnostics read: the gates over their row sum.
class Relu final : public Router {
 public:
  Relu(BuildContext& ctx, const RouterSpec& spec) : exec_(ctx.exec), moe_(*spec.moe) {
    ctx.state(coef_, spec.names("gate.l1_coef", "gate.l1_coef", "ffn_gate_inp.l1_coef"), Shape{1},
              Init::constant(moe_.l1_coef));
    const int found = ctx.losses->terms.find("moe_l1");
    slot_ = found >= 0 ? found : ctx.losses->terms.reserve({{"moe_l1", true, LossTerm::Per::micro_batch}});
  }

  int64_t slots() const override { return moe_.experts; }

  void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor&, bool) override {
    ops::relu_route_forward(exec_, logits, probs, routes);
  }

  void backward(const ops::Routes& routes, const Tensor&, const Tensor&, const Tensor& dweights, const Tensor& dprobs,
                const Tensor& dlogits, const Tensor&, ops::GradScale loss_scale) override {
    KILN_CHECK(!dprobs.defined(), "model.moe.router", "relu takes no balance loss (model.moe.aux_loss must be 0)");
    ops::relu_route_backward(exec_, routes, dweights, coef_, loss_scale, dlogits);
  }

  void add_losses(const Tensor& logits, double* device, LossSlotSums* host) override {
    if (device) return ops::relu_l1_sum(exec_, logits, device + slot_);
    if (host) (*host)[static_cast<size_t>(slot_)] += ops::relu_l1(exec_, logits);
  }

  void after_step(const Tensor& step_counts, const Tensor& step_tokens) override {
    ops::relu_l1_update(exec_, coef_, step_counts, step_tokens, moe_.top_k, moe_.l1_rate);
  }

  void report(const std::string& prefix, std::vector<std::pair<std::string, double>>& out) const override {
    OwnedTensor coef(coef_.dtype(), Device::cpu, coef_.shape());
    copy_tensor(coef_, *coef);
    out.emplace_back(prefix + "l1_coef", coef->dtype() == DType::f64 ? coef->data<double>()[0] : coef->data<float>()[0]);
  }

 private:
  const ExecContext& exec_;
  const MoeConfig& moe_;
  Tensor coef_;    // [1] wide: the L1 coefficient lambda (state, no gradient)
  int slot_ = -1;  // the loss slot "moe_l1"
};

}  // namespace

void register_relu_router(RouterRegistry& registry) {
  registry.add("relu", "ReLU gates, every expert with a positive gate, an adaptive L1 penalty (ReMoE)",
               [](BuildContext& ctx, const RouterSpec& spec) { return std::make_unique<Relu>(ctx, spec); });
}

}  // namespace kiln
