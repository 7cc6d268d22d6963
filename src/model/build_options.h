// How a Model is built: dtype, device, the token budget, training buffers, recompute.
#pragma once

#include "core/dtype.h"
#include "nn/precision_recipe.h"

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace kiln {

struct BuildOptions {
  // Compute dtype: f32 or f64 (everything in it), or bf16 on the GPU (mixed precision:
  // bf16 activations and weight copies, fp32 masters, gradients and residual stream).
  DType dtype = DType::f32;
  // The whole precision recipe (each role's GEMM format: train.precision = "fp8_tensorwise"
  // puts the dense role in FP8). Unset: every role computes in `dtype`. When set, its
  // compute dtype must be `dtype`.
  std::optional<PrecisionRecipe> precision;
  PrecisionRecipe recipe() const { return precision ? *precision : PrecisionRecipe::uniform(dtype); }
  Device device = Device::cpu;
  int64_t max_tokens = 4096;    // fixed token budget of one micro-batch
  int64_t loss_chunk_rows = 1024;
  double z_loss = 0;            // the LM head's z-loss coefficient (train.z_loss)
  bool training = true;
  // Activation recompute: the first `recompute_blocks` blocks keep only their input; what
  // their modules save for backward lives in one region all of them share, refilled by
  // running the block's forward again just before its backward. Same results to the bit
  // (the same kernels run on the same inputs), for about one more forward of those blocks.
  int64_t recompute_blocks = 0;
  // Bitwise-reproducible kernels only (TrainConfig::deterministic).
  bool deterministic = true;
  // QK-Clip's tau ([optim.qk_clip]): attention measures each head's largest logit in
  // training forwards and clips after each update (nn/qk_clip.h); 0 = off.
  double qk_clip_tau = 0;
  // optim.master_weights = "bf16": on the mixed path the 2-D weights are kept in bf16 only
  // (the masters themselves, no fp32 copy); gains and biases stay fp32.
  bool bf16_masters = false;
  // A pipeline rank's model (train/pipeline_model_stage.h): only the blocks of these layer
  // ranges ([first, last): the rank's stages) are built, the embedding where layer 0 is
  // (and where a tied head reads its table), the final norm and the LM head where the last
  // layer is. Empty: the whole model. The layers left out still reserve their loss slots,
  // and every parameter draws its initial values by its index in the whole model, so a
  // stage's parameters, initial values and loss slots are the whole model's.
  std::vector<std::pair<int64_t, int64_t>> layers;
  bool whole() const { return layers.empty(); }
  bool builds_layer(int64_t l) const {
    if (layers.empty()) return true;
    for (const auto& [first, last] : layers)
      if (first <= l && l < last) return true;
    return false;
  }
};

}  // namespace kiln
