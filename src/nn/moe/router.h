// Routers: from a token's router logits (one per expert) to the k experts it goes to and
// their weights. Registry "routers" (model.moe.router); each has its own tests.
#pragma once

#include "config/config.h"
#include "nn/parameter.h"
#include "nn/registry.h"
#include "ops/moe/routing.h"

namespace kiln {

struct RouterSpec {
  const MoeConfig* moe = nullptr;
  NameScope names;        // the layer's MLP scope ("layers.3.mlp.")
};

class Router {
 public:
  virtual ~Router() = default;
  // logits [T, E] (wide) -> routes (experts i32 [T, k], weights wide [T, k]) and probs
  // [T, E]: each token's distribution over the experts that the balance loss reads. `saved`
  // [T, E] (wide) keeps what the backward needs besides them (the caller's buffer, so a
  // decoder routes its own rows).
  virtual void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor& saved) = 0;
  // The gradients of the weights (dweights [T, k]) and of probs (dprobs [T, E], from the
  // balance loss; undefined: none) -> dlogits [T, E] (=), the choice held fixed. scratch
  // [T, E] (wide): the caller's, for the router's own intermediate gradient.
  virtual void backward(const ops::Routes& routes, const Tensor& probs, const Tensor& saved, const Tensor& dweights,
                        const Tensor& dprobs, const Tensor& dlogits, const Tensor& scratch) = 0;
  // After an applied optimizer step, with the step's routed choices per expert (i32 [E],
  // on the model's device): routers that balance without a loss adapt here (sigmoid_bias's
  // bias, by a kernel on the GPU: no host read).
  virtual void after_step(const Tensor& step_counts) { (void)step_counts; }
  // Diagnostics under `prefix` ("moe.3."): sigmoid_bias's bias range.
  virtual void report(const std::string& prefix, std::vector<std::pair<std::string, double>>& out) const {
    (void)prefix, (void)out;
  }
};

using RouterRegistry = Registry<Router, BuildContext&, const RouterSpec&>;
RouterRegistry& router_registry();

void register_softmax_topk_router(RouterRegistry& registry);
void register_sigmoid_bias_router(RouterRegistry& registry);

}  // namespace kiln
