// The sparse MLP (registry "moe"), and its LatentMoE form (model.moe.latent_width): see
// moe_mlp.cpp.
#pragma once

#include "nn/linear_layer.h"
#include "nn/modules.h"
#include "ops/moe/moe.h"
#include "ops/moe/routing.h"

namespace kiln {

class Router;

class MoeMlp final : public Mlp {
 public:
  MoeMlp(BuildContext& ctx, const LayerSpec& layer);
  ~MoeMlp() override;

  void forward(const Tensor& x, const Tensor& out) override;
  void backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override;
  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const override;
  // Qwen3-MoE (softmax_topk) or Dots1 (sigmoid_bias): moe_export.cpp.
  void export_config(ExportConfig& out) const override;
  // The step's routed choices per expert are the load sigmoid_bias balances by; cleared
  // for the next step.
  void after_step(bool applied) override;
  // The last step's load per expert (min, max and coefficient of variation, relative to the
  // mean), dead experts (no token all step) and the most steps one has been dead, the mean
  // routing entropy per token, the pairs a capacity dropped (and their share of the routed
  // ones), and the router's own (sigmoid_bias's bias range, relu's L1 coefficient).
  void report(std::vector<std::pair<std::string, double>>& out) const override;
  const Tensor& step_counts() const { return step_counts_; }  // i32 [E]

 private:
  friend class MoeDecoder;
  static int slot(BuildContext& ctx, const char* name, LossTerm::Per per = LossTerm::Per::micro_batch);
  Tensor step_tokens() const;
  ops::GradScale router_grad_scale(double factor) const;
  ops::Routes routes_rows(int64_t t) const;
  ops::MoeDispatch dispatch_rows(int64_t t) const;

  // The experts' grouped products: bf16/f32, or tensorwise FP8 under train.fp8_experts.
  void grouped_forward(const Tensor& x, const Tensor& w, const ops::MoeDispatch& d, const Tensor& y) const;
  void grouped_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const ops::MoeDispatch& d, const Tensor& dx,
                        const Tensor& dw) const;

  void export_qwen3_moe(ExportConfig& out) const;
  void export_dots1(ExportConfig& out) const;

  const ModelConfig& model_;
  const MoeConfig& moe_;
  const ExecContext& exec_;
  Workspace& workspace_;
  LossContext& losses_;
  int64_t layer_ = 0, hidden_ = 0;
  // The routed experts' input and output width: model.moe.latent_width with LatentMoE's
  // projections, else the model's (hidden_).
  int64_t expert_io_ = 0;
  bool latent() const { return moe_.latent_width > 0; }
  int aux_slot_ = -1, z_slot_ = -1;  // loss slots of the balance loss and the z-loss (-1: off)
  std::unique_ptr<Router> router_;
  Tensor router_w_, router_g_;                  // [E, d]
  Tensor gate_up_w_, gate_up_g_;                // [E 2F, d]: expert e's gate rows, then its up rows
  Tensor down_w_, down_g_;                      // [E d, F]
  LinearLayer shared_gate_up_proj_;             // [2S, d]
  LinearLayer shared_down_proj_;                // [d, S]
  LinearLayer latent_down_proj_;                // LatentMoE [L, d]: x into the experts' latent
  LinearLayer latent_up_proj_;                  // LatentMoE [d, L]: their weighted sum back out
  Tensor logits_, probs_;                       // saved [T, E] wide
  Tensor router_saved_;                         // saved [T, E] wide: what the router keeps for backward
  ops::Routes routes_;                          // saved: experts i32 [T, S], weights [T, S] wide
  ops::MoeDispatch dispatch_;                   // saved: counts [E], offsets [E + 1], permutation [R], [T S]
  Tensor gate_up_;                              // saved [R, 2F]: the experts' pre-activations (R: grouped rows)
  Tensor expert_out_;                           // saved [R, d or L]: the experts' outputs (model.moe.save_outputs)
  Tensor shared_gate_up_;                       // saved [T, 2S]
  Tensor latent_in_;                            // LatentMoE, saved [T, L]: x projected down
  Tensor latent_sum_;                           // LatentMoE, saved [T, L]: the experts' weighted sum
  // The load diagnostics (ops/moe/load_stats.h), on the model's device so that a captured
  // step adds to them without a host read; report() reads them back at log steps only.
  Tensor step_counts_;   // i32 [E]: choices per expert over the step's micro-batches
  Tensor step_entropy_;  // f64 [2]: the step's routing entropy summed over tokens, and its tokens
  Tensor last_counts_;   // i32 [E]: the last finished step's counts
  Tensor last_entropy_;  // f64 [2]: its entropy sum and tokens
  Tensor dead_steps_;    // i32 [E]: steps in a row each expert has gone without a token
  Tensor step_dropped_;  // i32 [1]: pairs the capacity dropped over the step's micro-batches
  Tensor last_dropped_;  // i32 [1]: the last finished step's
  // model.moe.balance_scope = "step": f64 [E + 1] on the model's device, the step's choices
  // per expert and routed tokens, over every micro-batch and rank (the counting pass's;
  // LossContext); undefined otherwise (the loss ops then take the micro-batch's own).
  Tensor balance_counts_;
  bool step_scope_ = false;
  bool expert_fp8_ = false;  // train.fp8_experts (the recipe's expert role is fp8_tensorwise)
  bool step_scope() const { return step_scope_; }
  int64_t slots_ = 0;    // route slots per token (the router's: top_k, or E)
};

std::unique_ptr<BranchDecoder> make_moe_decoder(const MoeMlp& mlp, DecodeContext& ctx);
void register_moe_mlp(MlpRegistry& registry);

}  // namespace kiln
