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

// The logits chunk's row length: the vocabulary rounded up to 8 elements (16 bytes in
// bf16), so that every row of the chunk starts 16-byte aligned and the three products get
// cuBLASLt's aligned kernels. With an odd vocabulary (128,001, GPT-2's 50,257) a row
// length of V left the products 2-byte aligned, on cuBLAS' slow align1 kernels. The
// products still cover V columns only; the padding columns are never read as logits.
inline int64_t lm_head_logits_cols(int64_t vocab) { return (vocab + 7) / 8 * 8; }

// Scratch planned by the caller: logits [chunk_rows, lm_head_logits_cols(V)] (compute
// dtype: bf16 on the GPU's mixed path, where each chunk's logits turn into their gradient
// in place) and row_stats f64 [chunk_rows, 2] (per-row loss and z, summed in row order so
// results are reproducible). On the GPU's mixed path with a vocabulary that is not a
// multiple of 8, also padded_weight [lm_head_logits_cols(V), d] (undefined otherwise; see
// lm_head_needs_padded_weight).
struct LmHeadScratch {
  Tensor logits;
  Tensor row_stats;
  // The weight copied in at every call, its padding rows zero: the forward's N and the
  // hidden gradient's K are then the padded width, a multiple of 8, and cuBLASLt picks its
  // aligned kernels for them (with N = K = 128,001 both ran on align1 kernels, 116 of the
  // 146 ms a step of the LM head's loss at K3's 8 x 4096 on an H100). The padding logits
  // are h . 0 = 0 and their gradient stays 0, so the products' sums are the same.
  Tensor padded_weight;
};

// Whether lm_head_loss wants LmHeadScratch::padded_weight: the GPU's bf16 mixed path only,
// at a vocabulary that is not a multiple of 8.
inline bool lm_head_needs_padded_weight(int64_t vocab, Device device, DType dtype) {
  return device == Device::cuda && dtype == DType::bf16 && lm_head_logits_cols(vocab) != vocab;
}

// h [N, d], w [V, d], targets i32 [N] (kIgnoreTarget = -1 skipped). If dh is defined it is
// written (=) with loss_scale * d(objective)/dh; if dw is defined it is accumulated (+=).
// With neither, this is evaluation only.
LossSums lm_head_loss(const ExecContext& ctx, const Tensor& h, const Tensor& w, const Tensor& targets, const LmHeadLossOptions& options,
                      const LmHeadScratch& scratch, const Tensor& dh, const Tensor& dw);

// Logits of the given rows only (for sampling): h [M, d] -> logits [M, V].
void lm_head_logits(const ExecContext& ctx, const Tensor& h, const Tensor& w, double softcap, const Tensor& logits);

}  // namespace kiln::ops
