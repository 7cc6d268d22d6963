// The sparse MLP's side of the export contract (nn/export_config.h): the stock family that
// computes its router exactly, or a refusal naming the key.
//   softmax_topk -> Qwen3-MoE (transformers' Qwen3MoeForCausalLM, llama.cpp's qwen3moe):
//                   no shared expert, no routed scaling; dense layers anywhere
//                   (mlp_only_layers; llama.cpp's qwen3moe has none).
//   sigmoid_bias -> dots.llm1 (transformers' Dots1ForCausalLM, llama.cpp's dots1): Qwen3's
//                   attention with DeepSeek-V3's router -- sigmoid scores, top k of score +
//                   e_score_correction_bias from the top topk_group of n_group groups,
//                   weights from the scores (renormalized if norm_topk_prob) x
//                   routed_scaling_factor -- and a shared expert n_shared_experts x
//                   moe_intermediate_size wide; the dense layers first
//                   (first_k_dense_replace).
// The balance and z losses' coefficients and the bias's update rule are training
// settings: Qwen3-MoE's router_aux_loss_coef carries the first (scaled to transformers'
// definition), the rest stay in kiln's config.
#include "config/layer_pattern.h"
#include "nn/moe/moe_mlp.h"
#include "nn/moe/router.h"

#include <fmt/format.h>

namespace kiln {

void MoeMlp::export_config(ExportConfig& out) const {
  // LatentMoE: neither stock family projects its experts' input and output.
  if (latent())
    out.refuse("model.moe.latent_width", std::to_string(moe_.latent_width),
               "no exported family (Qwen3-MoE, Dots1) has LatentMoE's latent projections");
  // expert_choice: no stock model can compute a router that reads later tokens.
  if (const std::string why = router_->not_causal(); !why.empty())
    out.refuse("model.moe.router", "'" + moe_.router + "'", why);
  if (out.is("dots1")) return export_dots1(out);
  if (!out.is("qwen3_moe")) out.refuse("model.mlp", "'moe'", "its MLPs are dense");
  export_qwen3_moe(out);
}

void MoeMlp::export_qwen3_moe(ExportConfig& out) const {
  if (moe_.router != "softmax_topk")
    out.refuse("model.moe.router", "'" + moe_.router + "'",
               "Qwen3-MoE routes by a softmax over the experts (softmax_topk; sigmoid_bias exports as Dots1)");
  if (moe_.shared_hidden > 0)
    out.refuse("model.moe.shared_hidden", std::to_string(moe_.shared_hidden), "Qwen3-MoE has no shared expert");
  if (moe_.routed_scaling != 1.0)
    out.refuse("model.moe.routed_scaling", fmt::format("{}", moe_.routed_scaling), "Qwen3-MoE does not scale the weights");
  if (out.format() == ExportConfig::Format::gguf) {
    if (!moe_.norm_topk_prob)
      out.refuse("model.moe.norm_topk_prob", "false", "llama.cpp's qwen3moe renormalizes the top-k weights");
    out.set("expert_count", moe_.experts, "model.moe.experts");
    out.set("expert_used_count", moe_.top_k, "model.moe.top_k");
    out.set("expert_feed_forward_length", moe_.expert_hidden, "model.moe.expert_hidden");
    return;
  }
  out.set("num_experts", moe_.experts, "model.moe.experts");
  out.set("num_experts_per_tok", moe_.top_k, "model.moe.top_k");
  out.set("moe_intermediate_size", moe_.expert_hidden, "model.moe.expert_hidden");
  out.set("norm_topk_prob", moe_.norm_topk_prob, "model.moe.norm_topk_prob");
  // transformers' balance loss is top_k x kiln's (io/hf_config.cpp's import says why).
  out.set("router_aux_loss_coef", moe_.aux_loss / static_cast<double>(moe_.top_k), "model.moe.aux_loss");
  out.set("output_router_logits", false, "model.moe.aux_loss");
  out.set("hidden_act", "silu", "model.mlp");
}

void MoeMlp::export_dots1(ExportConfig& out) const {
  if (moe_.router != "sigmoid_bias")
    out.refuse("model.moe.router", "'" + moe_.router + "'", "Dots1 routes by sigmoid scores and a bias (sigmoid_bias)");
  // The dense layers must come first: Dots1 has one count of them, no list.
  int64_t dense_first = 0;
  while (dense_first < model_.layers && layer_choices(model_, dense_first).mlp != "moe") ++dense_first;
  for (int64_t l = dense_first; l < model_.layers; ++l)
    if (layer_choices(model_, l).mlp != "moe")
      out.refuse("model.alt_mlp_layers", "'" + model_.alt_mlp_layers + "'",
                 fmt::format("layer {} is dense after sparse layer {}; Dots1's dense layers come first "
                             "(first_k_dense_replace)",
                             l, dense_first));
  if (moe_.shared_hidden % moe_.expert_hidden != 0)
    out.refuse("model.moe.shared_hidden", std::to_string(moe_.shared_hidden),
               fmt::format("Dots1's shared expert is n_shared_experts x moe_intermediate_size wide, a multiple of "
                           "model.moe.expert_hidden = {}",
                           moe_.expert_hidden));
  const int64_t shared = moe_.shared_hidden / moe_.expert_hidden;
  if (out.format() == ExportConfig::Format::gguf) {
    if (shared == 0)
      out.refuse("model.moe.shared_hidden", "0", "llama.cpp's dots1 always has a shared expert");
    out.set("expert_count", moe_.experts, "model.moe.experts");
    out.set("expert_used_count", moe_.top_k, "model.moe.top_k");
    out.set("expert_feed_forward_length", moe_.expert_hidden, "model.moe.expert_hidden");
    out.set("expert_shared_count", shared, "model.moe.shared_hidden");
    out.set("expert_weights_scale", moe_.routed_scaling, "model.moe.routed_scaling");
    out.set("expert_weights_norm", moe_.norm_topk_prob, "model.moe.norm_topk_prob");
    out.set("expert_gating_func", 2, "model.moe.router");  // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    out.set("leading_dense_block_count", dense_first, "model.alt_mlp_layers");
    if (moe_.groups > 1) {  // read for every architecture; groups scored by their two best, as kiln
      out.set("expert_group_count", moe_.groups, "model.moe.groups");
      out.set("expert_group_used_count", moe_.top_groups, "model.moe.top_groups");
    }
    return;
  }
  out.set("n_routed_experts", moe_.experts, "model.moe.experts");
  out.set("num_experts_per_tok", moe_.top_k, "model.moe.top_k");
  out.set("moe_intermediate_size", moe_.expert_hidden, "model.moe.expert_hidden");
  out.set("n_shared_experts", shared, "model.moe.shared_hidden");
  out.set("norm_topk_prob", moe_.norm_topk_prob, "model.moe.norm_topk_prob");
  out.set("routed_scaling_factor", moe_.routed_scaling, "model.moe.routed_scaling");
  out.set("n_group", moe_.groups, "model.moe.groups");
  out.set("topk_group", moe_.top_groups, "model.moe.top_groups");
  out.set("first_k_dense_replace", dense_first, "model.alt_mlp_layers");
  out.set("output_router_logits", false, "model.moe.aux_loss");
  out.set("hidden_act", "silu", "model.mlp");
}

}  // namespace kiln
