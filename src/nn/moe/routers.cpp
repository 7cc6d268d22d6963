// The routers (nn/moe/router.h): softmax_topk (Qwen3-MoE) and sigmoid_bias (DeepSeek-V3's
// auxiliary-loss-free balancing).
#include "nn/moe/router.h"

#include "ops/moe/routing.h"

#include <algorithm>
#include <cmath>

namespace kiln {

namespace {

// softmax over all experts in fp32 or wider, the top k, renormalized when norm_topk_prob:
// transformers' Qwen3MoeSparseMoeBlock. The balance loss reads the softmax itself.
class SoftmaxTopK final : public Router {
 public:
  SoftmaxTopK(BuildContext& ctx, const RouterSpec& spec)
      : exec_(ctx.exec), normalize_(spec.moe->norm_topk_prob), k_(spec.moe->top_k) {}

  int64_t slots() const override { return k_; }

  void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor&, bool) override {
    ops::softmax_topk_forward(exec_, logits, normalize_, probs, routes);
  }

  void backward(const ops::Routes& routes, const Tensor& probs, const Tensor&, const Tensor& dweights,
                const Tensor& dprobs, const Tensor& dlogits, const Tensor&, ops::GradScale) override {
    ops::softmax_topk_backward(exec_, probs, routes, normalize_, dweights, dprobs, dlogits);
  }

 private:
  const ExecContext& exec_;
  bool normalize_;
  int64_t k_;
};

// Sigmoid scores; the top k chosen on score + a per-expert bias that no gradient moves:
// after each applied step the bias rises for experts that got less than the mean load and
// falls for the others (the sign rule: +-rate; the proportional rule: rate x (mean - load) /
// mean), so the load evens out without a loss pulling the router. The weights come from the
// scores alone. The bias is model state ("mlp.gate.e_score_correction_bias", as DeepSeek-V3
// names it), saved with the weights and in checkpoints. The balance loss, when asked for
// too (DeepSeek-V3's complementary sequence loss), reads the scores normalized per token.
class SigmoidBias final : public Router {
 public:
  SigmoidBias(BuildContext& ctx, const RouterSpec& spec)
      : exec_(ctx.exec), moe_(*spec.moe), sign_rule_(spec.moe->bias_update == "sign") {
    const int64_t e = moe_.experts;
    ctx.state(bias_, spec.names("gate.e_score_correction_bias", "gate.e_score_correction_bias", "exp_probs_b.bias"),
              Shape{e}, Init::zeros());
  }

  int64_t slots() const override { return moe_.top_k; }

  // saved: the sigmoid scores.
  void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor& scores,
             bool) override {
    ops::sigmoid_bias_forward(exec_, logits, bias_, moe_.groups, moe_.top_groups, moe_.norm_topk_prob, moe_.routed_scaling,
                              scores, routes);
    ops::row_normalize_forward(exec_, scores, probs);
  }

  // d(probs) -> d(scores) through p = s / sum(s) into scratch, then the scores' backward.
  void backward(const ops::Routes& routes, const Tensor& probs, const Tensor& scores, const Tensor& dweights,
                const Tensor& dprobs, const Tensor& dlogits, const Tensor& scratch, ops::GradScale) override {
    Tensor dscores;
    if (dprobs.defined()) {
      dscores = scratch;
      ops::row_normalize_backward(exec_, scores, probs, dprobs, dscores);
    }
    ops::sigmoid_bias_backward(exec_, scores, routes, moe_.norm_topk_prob, moe_.routed_scaling, dweights, dscores, dlogits);
  }

  void report(const std::string& prefix, std::vector<std::pair<std::string, double>>& out) const override {
    OwnedTensor bias(bias_.dtype(), Device::cpu, bias_.shape());
    copy_tensor(bias_, *bias);
    double lo = 0, hi = 0;
    for (int64_t j = 0; j < bias->numel(); ++j) {
      const double b = bias->dtype() == DType::f64 ? bias->data<double>()[j] : bias->data<float>()[j];
      lo = j == 0 ? b : std::min(lo, b), hi = j == 0 ? b : std::max(hi, b);
    }
    out.emplace_back(prefix + "bias_min", lo);
    out.emplace_back(prefix + "bias_max", hi);
  }

  void after_step(const Tensor& step_counts, const Tensor&) override {
    ops::sigmoid_bias_update(exec_, bias_, step_counts, sign_rule_, moe_.bias_rate);
  }

 private:
  const ExecContext& exec_;
  const MoeConfig& moe_;
  bool sign_rule_;  // model.moe.bias_update: "sign" (else "proportional")
  Tensor bias_;     // [E] wide: the load-balancing bias (state, no gradient)
};

}  // namespace

int64_t expert_capacity(const MoeConfig& moe, int64_t tokens, double factor) {
  if (factor <= 0) return 0;
  const double pairs = factor * static_cast<double>(tokens * moe.top_k) / static_cast<double>(moe.experts);
  // Capped in double: a capacity past INT64_MAX cast to int64_t was undefined (1e300 gave
  // "capacity -9223372036854775808").
  return static_cast<int64_t>(std::min(static_cast<double>(tokens), std::ceil(pairs - 1e-9)));
}

RouterRegistry& router_registry() {
  static RouterRegistry* registry = [] {
    auto* r = new RouterRegistry("router");
    register_softmax_topk_router(*r);
    register_sigmoid_bias_router(*r);
    register_sinkhorn_router(*r);
    register_expert_choice_router(*r);
    register_relu_router(*r);
    return r;
  }();
  return *registry;
}

void register_softmax_topk_router(RouterRegistry& registry) {
  registry.add("softmax_topk", "softmax over all experts, top k, renormalized if norm_topk_prob (Qwen3-MoE)",
               [](BuildContext& ctx, const RouterSpec& spec) { return std::make_unique<SoftmaxTopK>(ctx, spec); });
}

void register_sigmoid_bias_router(RouterRegistry& registry) {
  registry.add("sigmoid_bias",
               "sigmoid scores, top k on score + a load-balancing bias (no gradient), optional group limit (DeepSeek-V3)",
               [](BuildContext& ctx, const RouterSpec& spec) { return std::make_unique<SigmoidBias>(ctx, spec); });
}

}  // namespace kiln
