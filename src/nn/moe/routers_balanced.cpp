// The routers that balance by the choice itself (nn/moe/router.h): sinkhorn (balanced
// assignment over a training micro-batch, as BASE layers / Megatron's sinkhorn router) and
// expert_choice (each expert takes its top tokens; Zhou et al. 2022).
#include "nn/moe/router.h"

#include "ops/moe/routing.h"

namespace kiln {

namespace {

// A softmax over the experts; in a training forward the top k are chosen on the
// Sinkhorn-balanced matrix of the micro-batch's softmax (model.moe.sinkhorn_iterations), so
// that every expert gets about T k / E tokens with no loss; the weights are the softmax at
// the chosen experts (renormalized when norm_topk_prob) and the gradient flows through the
// softmax only. Evaluation and the KV-cache decoder route by the softmax's own top k, as
// Megatron does outside training: Sinkhorn balances a whole micro-batch (over one decoded
// token it would be degenerate, and over a batch it would read later tokens), and a
// trained router's softmax already spreads the load. So the decoder matches the full
// forward of an evaluation exactly, not a training forward.
class Sinkhorn final : public Router {
 public:
  Sinkhorn(BuildContext& ctx, const RouterSpec& spec) : exec_(ctx.exec), moe_(*spec.moe) {
    ctx.buffer(row_scale_, Shape{ctx.max_tokens}, ctx.master_dtype);
    ctx.buffer(col_scale_, Shape{moe_.experts}, ctx.master_dtype);
  }

  int64_t slots() const override { return moe_.top_k; }

  void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor&,
             bool training) override {
    if (!training) return ops::softmax_topk_forward(exec_, logits, moe_.norm_topk_prob, probs, routes);
    ops::sinkhorn_topk_forward(exec_, logits, moe_.sinkhorn_iterations, moe_.norm_topk_prob, probs,
                               row_scale_.rows(0, logits.size(0)), col_scale_, routes);
  }

  void backward(const ops::Routes& routes, const Tensor& probs, const Tensor&, const Tensor& dweights,
                const Tensor& dprobs, const Tensor& dlogits, const Tensor&, ops::GradScale) override {
    ops::softmax_topk_backward(exec_, probs, routes, moe_.norm_topk_prob, dweights, dprobs, dlogits);
  }

 private:
  const ExecContext& exec_;
  const MoeConfig& moe_;
  Tensor row_scale_, col_scale_;  // [max tokens], [E] wide: the Sinkhorn scales
};

// A softmax over the experts per token; then each expert takes the C tokens of the
// micro-batch that score it highest, C = ceil(cf T k / E) (cf = model.moe.capacity_factor,
// 1 when 0), weighted by their softmax score. A token gets 0..E experts (routes of E slots,
// empty ones -1), every expert exactly C tokens: balanced with no loss. Its choice for a
// token reads every token of the micro-batch, later ones too: not causal, so the KV-cache
// decoder and the exports refuse it.
class ExpertChoice final : public Router {
 public:
  ExpertChoice(BuildContext& ctx, const RouterSpec& spec) : exec_(ctx.exec), moe_(*spec.moe) {}

  int64_t slots() const override { return moe_.experts; }
  int64_t most_pairs(int64_t tokens) const override { return moe_.experts * capacity(tokens); }
  bool capacity_drops() const override { return false; }
  std::string not_causal() const override {
    return "each expert chooses among all of a micro-batch's tokens, so a token's experts depend on later tokens";
  }

  void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor&, bool) override {
    ops::expert_choice_forward(exec_, logits, capacity(logits.size(0)), probs, routes);
  }

  void backward(const ops::Routes& routes, const Tensor& probs, const Tensor&, const Tensor& dweights,
                const Tensor& dprobs, const Tensor& dlogits, const Tensor&, ops::GradScale) override {
    ops::softmax_topk_backward(exec_, probs, routes, /*normalize=*/false, dweights, dprobs, dlogits);
  }

 private:
  int64_t capacity(int64_t tokens) const {
    return expert_capacity(moe_, tokens, moe_.capacity_factor > 0 ? moe_.capacity_factor : 1.0);
  }

  const ExecContext& exec_;
  const MoeConfig& moe_;
};

}  // namespace

void register_sinkhorn_router(RouterRegistry& registry) {
  registry.add("sinkhorn",
               "softmax; top k on the Sinkhorn-balanced micro-batch in training, the softmax's top k otherwise",
               [](BuildContext& ctx, const RouterSpec& spec) { return std::make_unique<Sinkhorn>(ctx, spec); });
}

void register_expert_choice_router(RouterRegistry& registry) {
  registry.add("expert_choice", "each expert takes its top capacity tokens by softmax score (not causal: no decoding)",
               [](BuildContext& ctx, const RouterSpec& spec) { return std::make_unique<ExpertChoice>(ctx, spec); });
}

}  // namespace kiln
