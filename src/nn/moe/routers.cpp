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
  explicit SoftmaxTopK(const RouterSpec& spec) : normalize_(spec.moe->norm_topk_prob) {}

  void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor&) override {
    ops::softmax_topk_forward(logits, normalize_, probs, routes);
  }

  void backward(const ops::Routes& routes, const Tensor& probs, const Tensor&, const Tensor& dweights,
                const Tensor& dprobs, const Tensor& dlogits) override {
    ops::softmax_topk_backward(probs, routes, normalize_, dweights, dprobs, dlogits);
  }

 private:
  bool normalize_;
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
  SigmoidBias(BuildContext& ctx, const RouterSpec& spec) : moe_(*spec.moe) {
    const int64_t e = moe_.experts;
    ctx.state(bias_, spec.names("gate.e_score_correction_bias", "gate.e_score_correction_bias", "exp_probs_b.bias"),
              Shape{e}, Init::zeros());
  }

  // saved: the sigmoid scores.
  void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor& scores) override {
    ops::sigmoid_bias_forward(logits, bias_, moe_.groups, moe_.top_groups, moe_.norm_topk_prob, moe_.routed_scaling,
                              scores, routes);
    normalize_rows(scores, probs);
  }

  void backward(const ops::Routes& routes, const Tensor& probs, const Tensor& scores, const Tensor& dweights,
                const Tensor& dprobs, const Tensor& dlogits) override {
    // d(probs) -> d(scores) through p = s / sum(s): ds_m = (dp_m - sum_j dp_j p_j) / sum(s).
    if (dprobs.defined()) {
      OwnedTensor ds(scores.dtype(), Device::cpu, scores.shape());
      dispatch(scores, [&](auto* s, auto* p, auto* dp, auto* out, int64_t rows, int64_t e) {
        for (int64_t r = 0; r < rows; ++r) {
          double sum = 0, dot = 0;
          for (int64_t j = 0; j < e; ++j) sum += s[r * e + j], dot += dp[r * e + j] * p[r * e + j];
          for (int64_t j = 0; j < e; ++j) out[r * e + j] = (dp[r * e + j] - dot) / sum;
        }
      }, probs, dprobs, *ds);
      ops::sigmoid_bias_backward(scores, routes, moe_.norm_topk_prob, moe_.routed_scaling, dweights, *ds, dlogits);
      return;
    }
    ops::sigmoid_bias_backward(scores, routes, moe_.norm_topk_prob, moe_.routed_scaling, dweights, Tensor(), dlogits);
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

  void after_step(const Tensor& step_counts) override {
    const int64_t e = moe_.experts;
    const int32_t* counts = step_counts.data<int32_t>();
    double mean = 0;
    for (int64_t j = 0; j < e; ++j) mean += counts[j];
    mean /= static_cast<double>(e);
    if (mean <= 0) return;
    OwnedTensor bias(bias_.dtype(), Device::cpu, bias_.shape());
    copy_tensor(bias_, *bias);
    for (int64_t j = 0; j < e; ++j) {
      const double error = mean - counts[j];  // > 0: the expert is under-loaded
      const double step = moe_.bias_update == "sign" ? moe_.bias_rate * ((error > 0) - (error < 0))
                                                     : moe_.bias_rate * error / mean;
      if (bias->dtype() == DType::f64) bias->data<double>()[j] += step;
      else bias->data<float>()[j] += static_cast<float>(step);
    }
    copy_tensor(*bias, bias_);
  }

 private:
  // probs = scores / their row sums (on the host: the CPU reference).
  static void normalize_rows(const Tensor& scores, const Tensor& probs) {
    KILN_CHECK(scores.device() == Device::cpu, "sigmoid_bias", "the balance loss's scores on the GPU need its kernels");
    const int64_t rows = scores.size(0), e = scores.size(1);
    auto run = [&](auto* s, auto* p) {
      for (int64_t r = 0; r < rows; ++r) {
        double sum = 0;
        for (int64_t j = 0; j < e; ++j) sum += s[r * e + j];
        for (int64_t j = 0; j < e; ++j) p[r * e + j] = static_cast<std::remove_pointer_t<decltype(p)>>(s[r * e + j] / sum);
      }
    };
    if (scores.dtype() == DType::f64) run(scores.data<double>(), probs.data<double>());
    else run(scores.data<float>(), probs.data<float>());
  }

  template <typename Fn>
  static void dispatch(const Tensor& scores, Fn&& fn, const Tensor& probs, const Tensor& dprobs, const Tensor& out) {
    const int64_t rows = scores.size(0), e = scores.size(1);
    if (scores.dtype() == DType::f64)
      fn(scores.data<double>(), probs.data<double>(), dprobs.data<double>(), out.data<double>(), rows, e);
    else
      fn(scores.data<float>(), probs.data<float>(), dprobs.data<float>(), out.data<float>(), rows, e);
  }

  const MoeConfig& moe_;
  Tensor bias_;  // [E] wide: the load-balancing bias (state, no gradient)
};

}  // namespace

RouterRegistry& router_registry() {
  static RouterRegistry* registry = [] {
    auto* r = new RouterRegistry("router");
    register_softmax_topk_router(*r);
    register_sigmoid_bias_router(*r);
    return r;
  }();
  return *registry;
}

void register_softmax_topk_router(RouterRegistry& registry) {
  registry.add("softmax_topk", "softmax over all experts, top k, renormalized if norm_topk_prob (Qwen3-MoE)",
               [](BuildContext&, const RouterSpec& spec) { return std::make_unique<SoftmaxTopK>(spec); });
}

void register_sigmoid_bias_router(RouterRegistry& registry) {
  registry.add("sigmoid_bias",
               "sigmoid scores, top k on score + a load-balancing bias (no gradient), optional group limit (DeepSeek-V3)",
               [](BuildContext& ctx, const RouterSpec& spec) { return std::make_unique<SigmoidBias>(ctx, spec); });
}

}  // namespace kiln
