#include "train/pipeline_costs.h"

#include "config/layer_pattern.h"
#include "core/error.h"
#include "model/model.h"
#include "nn/modules.h"
#include "train/memory_check.h"
#include "train/training_build.h"

#include <algorithm>

namespace kiln {

namespace {

struct BlockCost {
  double forward_matmul = 0;  // active matmul parameters
  double extra_flops = 0;     // the mixer's forward work beyond its matmuls, per token
  double parameters = 0;      // all of the block's parameters (experts included)
  size_t bytes = 0;           // parameters, their compute copies, gradients, saved activations, buffers
  size_t activations = 0;     // one micro-batch's saved state (the part of bytes activation frames copy)
  std::string kind;
};

// Layer l's block planned in arenas of its own, the way Backbone plans it into the model's:
// what it reserves is what it would hold on its stage.
BlockCost plan_block(const ModelConfig& config, const BuildOptions& options, int64_t l) {
  const ExecContext exec;
  Arena params("parameters", options.device), grads("gradients", options.device),
      activations("activations", options.device), buffers("buffers", options.device),
      step_buffers("step buffers", options.device);
  Workspace workspace(options.device);
  std::vector<std::unique_ptr<Parameter>> parameters;
  ComputeWeights compute(options.device);
  LossContext losses;
  StepStatistics statistics;
  const PrecisionRecipe precision = options.recipe();
  BuildContext ctx{exec,          params,          grads,           activations, workspace,
                   parameters,    compute,         precision,       options.device,
                   options.max_tokens, options.training, options.deterministic, &losses};
  ctx.buffers = &buffers;
  ctx.step_buffers = &step_buffers;
  ctx.qk_clip_tau = options.training ? options.qk_clip_tau : 0;
  ctx.step_statistics = &statistics;
  ctx.bf16_masters = options.bf16_masters && ctx.mixed();
  const std::string index = std::to_string(l);
  const LayerSpec layer{NameScope{"layers." + index + ".", "model.layers." + index + ".", "blk." + index + "."}, l,
                        &config, layer_choices(config, l)};
  // The position encoding's tables are the backbone's, not the block's: planned elsewhere.
  Arena scratch_params("parameters", options.device), scratch_grads("gradients", options.device),
      scratch_activations("activations", options.device);
  std::vector<std::unique_ptr<Parameter>> scratch_parameters;
  ComputeWeights scratch_compute(options.device);
  BuildContext position_ctx{exec,          scratch_params,  scratch_grads,     scratch_activations, workspace,
                            scratch_parameters, scratch_compute, precision,     options.device,
                            options.max_tokens, options.training, options.deterministic, &losses};
  ModelConfig position_config = config;
  if (config.rope.local_theta > 0 && layer.choices.window > 0) {
    position_config.rope_theta = config.rope.local_theta;
    position_config.rope = RopeConfig{};
    position_config.rope.fraction = config.rope.fraction;
  }
  const auto position = position_registry().build("model.position", config.position, position_ctx, position_config);
  const TransformerBlock block(ctx, layer, *position);

  BlockCost cost;
  for (const auto& p : parameters) {
    const auto n = static_cast<double>(p->shape().numel());
    cost.parameters += n;
    if (p->shape().rank() == 2) cost.forward_matmul += n * p->active_fraction();
  }
  cost.extra_flops = block.extra_forward_flops_per_token(config.max_seq_len);
  // The residual stream's input of the block ([T, hidden], master dtype) is the backbone's.
  const size_t residual = static_cast<size_t>(options.max_tokens * config.hidden) * dtype_size(precision.master);
  cost.activations = activations.planned_bytes() + residual;
  cost.bytes = params.planned_bytes() + compute.arena.planned_bytes() + grads.planned_bytes() + cost.activations +
               buffers.planned_bytes() + step_buffers.planned_bytes();
  cost.kind = layer.choices.mixer + (layer.choices.window > 0 ? "/w" + std::to_string(layer.choices.window) : "") +
              "+" + layer.choices.mlp;
  return cost;
}

}  // namespace

PipelineCosts pipeline_costs_from_config(const Config& config, Device device) {
  const ModelConfig& m = config.model;
  KILN_CHECK(m.attn_res_block == 0, "model.attn_res_block",
             "Block Attention Residuals mix every earlier layer's output into each layer: no pipeline split of "
             "them is planned (model.attn_res_block = {})",
             m.attn_res_block);
  const BuildOptions options = training_build_options(config, device);
  const Model model(m, options);  // plans every arena; allocates nothing
  const MemoryBudget whole = plan_training_memory(config, device);
  const double total_parameters = static_cast<double>(model.parameter_count());
  const double optimizer_per_parameter = total_parameters > 0 ? static_cast<double>(whole.optimizer) / total_parameters : 0;

  PipelineCosts costs;
  double layer_time = 0, layer_memory = 0;
  for (int64_t l = 0; l < m.layers; ++l) {
    const BlockCost block = plan_block(m, options, l);
    LayerCost cost;
    cost.time = 3.0 * (2.0 * block.forward_matmul + block.extra_flops);
    cost.memory = static_cast<double>(block.bytes) + optimizer_per_parameter * block.parameters;
    cost.activations = static_cast<double>(block.activations);
    layer_time += cost.time;
    layer_memory += cost.memory;
    costs.layers.push_back(cost);
    costs.layer_kinds.push_back(block.kind);
  }
  // The embedding: its table, compute copy (mixed path), gradient and optimizer state.
  const DType master = options.dtype == DType::bf16 ? DType::f32 : options.dtype;
  const double table = static_cast<double>(m.vocab_size * m.hidden);
  const double embedding = table * (2.0 * static_cast<double>(dtype_size(master)) +
                                    (options.dtype == DType::bf16 ? 2.0 : 0.0) + optimizer_per_parameter);
  costs.first_extra.memory = embedding;
  // The rest of the model's count and plan (the head, the final norm, multi-token
  // prediction, the loss terms' buffers) is the last stage's; a tied head reads a copy of
  // the embedding there.
  const double whole_memory = static_cast<double>(whole.parameters + whole.gradients + whole.optimizer +
                                                  whole.activations);
  costs.last_extra.time = std::max(0.0, model.flops_per_token(m.max_seq_len) - layer_time);
  costs.last_extra.memory =
      std::max(0.0, whole_memory - layer_memory - embedding) + (m.tie_embeddings ? embedding : 0.0);
  return costs;
}

}  // namespace kiln
