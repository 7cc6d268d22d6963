// Routers: from a token's router logits (one per expert) to the k experts it goes to and
// their weights. Registry "routers" (model.moe.router); each has its own tests.
#pragma once

#include "config/config.h"
#include "nn/loss_terms.h"
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
  // Route slots per token, S: top_k for the token-choice routers; E for those that give a
  // token any number of experts (expert_choice, relu), each slot then an expert or -1.
  virtual int64_t slots() const = 0;
  // The most (token, expert) pairs it routes over `tokens` tokens: the rows the grouped
  // layout needs (tokens x S unless the router caps them itself).
  virtual int64_t most_pairs(int64_t tokens) const { return tokens * slots(); }
  // Whether model.moe.capacity_factor drops this router's overflow at the dispatch (the
  // token-choice routers; expert_choice's capacity is its choice itself).
  virtual bool capacity_drops() const { return true; }
  // Empty, or why the KV-cache decoder cannot run it (a router whose choice for a token
  // reads later tokens).
  virtual std::string not_causal() const { return ""; }
  // logits [T, E] (wide) -> routes (experts i32 [T, S], weights wide [T, S]) and probs
  // [T, E]: each token's distribution over the experts that the balance loss reads. `saved`
  // [T, E] (wide) keeps what the backward needs besides them (the caller's buffer, so a
  // decoder routes its own rows). `training`: a training forward (sinkhorn balances only
  // there; evaluation and decoding route by the softmax alone).
  virtual void route(const Tensor& logits, const ops::Routes& routes, const Tensor& probs, const Tensor& saved,
                     bool training) = 0;
  // The gradients of the weights (dweights [T, S]) and of probs (dprobs [T, E], from the
  // balance loss; undefined: none) -> dlogits [T, E] (=), the choice held fixed. scratch
  // [T, E] (wide): the caller's, for the router's own intermediate gradient. loss_scale:
  // the gradient scale of per-micro-batch loss terms (the router's own: relu's L1), the loss
  // scale S included (MoeMlp::router_grad_scale).
  virtual void backward(const ops::Routes& routes, const Tensor& probs, const Tensor& saved, const Tensor& dweights,
                        const Tensor& dprobs, const Tensor& dlogits, const Tensor& scratch, ops::GradScale loss_scale) = 0;
  // The router's own loss terms' values of a forward (relu's L1), where the balance loss's
  // go: into the device slots `device` (null: the host's, `host`).
  virtual void add_losses(const Tensor& logits, double* device, LossSlotSums* host) { (void)logits, (void)device, (void)host; }
  // After an applied optimizer step, with the step's routed choices per expert (i32 [E])
  // and its tokens (f64 [1]), on the model's device: routers that balance without a loss
  // adapt here (sigmoid_bias's bias, relu's L1 coefficient; kernels on the GPU: no host
  // read).
  virtual void after_step(const Tensor& step_counts, const Tensor& step_tokens) { (void)step_counts, (void)step_tokens; }
  // Diagnostics under `prefix` ("moe.3."): sigmoid_bias's bias range.
  virtual void report(const std::string& prefix, std::vector<std::pair<std::string, double>>& out) const {
    (void)prefix, (void)out;
  }
};

using RouterRegistry = Registry<Router, BuildContext&, const RouterSpec&>;
RouterRegistry& router_registry();

void register_softmax_topk_router(RouterRegistry& registry);
void register_sigmoid_bias_router(RouterRegistry& registry);
void register_sinkhorn_router(RouterRegistry& registry);
void register_expert_choice_router(RouterRegistry& registry);
void register_relu_router(RouterRegistry& registry);

// Expert choice's capacity over `tokens` tokens: ceil(cf x tokens x k / E) (cf =
// model.moe.capacity_factor, 1 when 0), at most the tokens; the token-choice routers'
// per-expert limit at the dispatch likewise (0 when capacity_factor is 0: dropless).
int64_t expert_capacity(const MoeConfig& moe, int64_t tokens, double factor);

}  // namespace kiln
