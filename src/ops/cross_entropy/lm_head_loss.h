// LM head + cross-entropy, chunked: logits exist for at most `chunk_rows` tokens at a time,
// never for the whole [tokens, vocab] batch. Forward and backward are fused: the loss
// is a scalar whose normalization is known up front, so each chunk's logit gradient is
// formed at once and pushed into dh and dw before the next chunk reuses the buffer.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

namespace kiln::ops {

struct LmHeadLossOptions {
  int64_t chunk_rows = 1024;
  double z_loss = 0;       // adds z_loss * logsumexp^2 per target token
  double loss_scale = 1;   // gradient of the objective = loss_scale * sum over tokens
  // This loss's weight in the objective (a multi-token prediction depth's, or the main
  // loss's beside them): its gradient x weight, on top of loss_scale (host or device).
  double weight = 1;
  double softcap = 0;      // final-logit softcap: softcap * tanh(logits / softcap); 0 = off
  // A step that stays on the device (GPU only; train/step_program.h): loss_scale read from
  // this float in device memory when the kernels run, and the loss sums added (+=) to
  // these three doubles (loss, z, count) in device memory instead of being read back;
  // lm_head_loss then returns zeros and does not synchronize.
  const float* loss_scale_on_device = nullptr;
  double* sums_on_device = nullptr;
};

struct LossSums {
  double loss = 0;     // sum of cross-entropy over counted tokens (nats)
  double z = 0;        // sum of logsumexp^2 over counted tokens
  int64_t count = 0;   // tokens with a target (not kIgnoreTarget)
};

// Scratch planned by the caller: logits [chunk_rows, V] (compute dtype: bf16 on the GPU's
// mixed path, where each chunk's logits turn into their gradient in place) and row_stats
// f64 [chunk_rows, 2] (per-row loss and z, summed in row order so results are reproducible).
struct LmHeadScratch {
  Tensor logits;
  Tensor row_stats;
};

// h [N, d], w [V, d], targets i32 [N] (kIgnoreTarget = -1 skipped). If dh is defined it is
// written (=) with loss_scale * d(objective)/dh; if dw is defined it is accumulated (+=).
// With neither, this is evaluation only.
LossSums lm_head_loss(const ExecContext& ctx, const Tensor& h, const Tensor& w, const Tensor& targets, const LmHeadLossOptions& options,
                      const LmHeadScratch& scratch, const Tensor& dh, const Tensor& dw);

// Logits of the given rows only (for sampling): h [M, d] -> logits [M, V].
void lm_head_logits(const ExecContext& ctx, const Tensor& h, const Tensor& w, double softcap, const Tensor& logits);

}  // namespace kiln::ops
