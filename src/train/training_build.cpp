#include "train/training_build.h"

#include "config/layer_pattern.h"
#include "nn/precision_recipe.h"

namespace kiln {

BuildOptions training_build_options(const Config& config, Device device) {
  BuildOptions options;
  KILN_CHECK(!config.train.fp8_experts || config.train.precision == "fp8_tensorwise", "config",
             "train.fp8_experts = true needs train.precision = 'fp8_tensorwise', got '{}'", config.train.precision);
  options.device = device;
  options.precision = resolve_precision_recipe(config.train.precision, device);
  options.precision->keep_fp8_inputs = config.train.fp8_keep_inputs;
  options.precision->blockwise_vector_kernels = config.train.fp8_blockwise_kernels == "vector";
  KILN_CHECK(config.train.fp8_layers == "all" || is_fp8(options.precision->dense), "train.fp8_layers",
             "'{}' chooses FP8 blocks, but train.precision = '{}' has none", config.train.fp8_layers,
             config.train.precision);
  parse_layer_set("train.fp8_layers", config.train.fp8_layers, config.model.layers);  // refuses a bad set by key
  options.precision->fp8_layers = config.train.fp8_layers;
  if (config.train.fp8_experts) options.precision->expert = GemmFormat::fp8_tensorwise;
  options.dtype = options.precision->compute;
  options.recompute_blocks = config.train.recompute_blocks;
  options.deterministic = config.train.deterministic;
  options.max_tokens = config.train.micro_batch_tokens;
  options.loss_chunk_rows = config.train.loss_chunk_tokens;
  options.z_loss = config.train.z_loss;
  if (config.optim.qk_clip.enabled) options.qk_clip_tau = config.optim.qk_clip.tau;
  if (config.optim.master_weights == "bf16") {
    KILN_CHECK(options.dtype == DType::bf16, "config",
               "optim.master_weights = 'bf16' needs bf16 mixed precision on the GPU (train.precision), this run "
               "computes in {}", dtype_name(options.dtype));
    options.bf16_masters = true;
  }
  return options;
}

}  // namespace kiln
