// The language-model head, the first objective: logits = hidden W^T (W the embedding when
// tied, else its own [V, hidden] weight), an optional final softcap, and cross-entropy
// (plus the z-loss, z_loss x logsumexp^2) computed a chunk of rows at a time, never for the
// whole [tokens, V] logits. Its sums go to three loss slots (nn/loss_terms.h): "loss" (slot
// 0, the main loss), "z" and the target count.
#pragma once

#include "nn/decode.h"
#include "nn/interfaces.h"
#include "nn/loss_terms.h"
#include "nn/parameter.h"
#include "ops/cross_entropy/lm_head_loss.h"

#include <vector>

namespace kiln {

struct ModelConfig;

struct LmHeadSpec {
  int64_t chunk_rows = 1024;  // logits rows computed at once
  double z_loss = 0;          // coefficient of mean(logsumexp^2) in the objective
  double weight = 1;          // the main loss's weight in the objective (below 1 beside MTP's average)
};

// How a loss's gradient is scaled: 1 / (target tokens of the whole step), a host value, or
// read from device memory when the kernels run (a step captured as a CUDA graph).
struct LossScale {
  double host = 1;
  const float* device = nullptr;
};

// The logits of a decode step's rows.
class HeadDecoder {
 public:
  HeadDecoder(const Tensor& weight, double softcap, DecodeContext& ctx, const Norm& final_norm);
  // logits [m, V] (wide) of h [m, hidden] (the final norm's output).
  void logits(const Tensor& h, const Tensor& out);
  // With the GPU's fused kernels, for the captured decode steps: the final norm folded in,
  // logits [n, V] straight from the residual stream x [n, hidden].
  bool fused() const { return fused_; }
  void logits_fused(const Tensor& x, const Tensor& out);

 private:
  const ExecContext& exec_;
  const Tensor& weight_;
  double softcap_;
  bool fused_ = false;
  RmsNormForm norm_;
};

class LmHead {
 public:
  // embed and embed_grad: the embedding's compute weight and gradient, which a tied head
  // reads and accumulates into (held by reference: bound when the arenas are allocated).
  // first_slot: its three loss slots ("loss", "z", the target count), reserved by the model.
  LmHead(BuildContext& ctx, const ModelConfig& model, const Tensor& embed, const Tensor& embed_grad,
         const LmHeadSpec& spec, int first_slot);

  // Loss sums of hidden [T, hidden] against targets i32 [T] into the head's slots of `sums`
  // (host doubles; or, with device_sums, device doubles added to without a read back). With
  // dhidden defined, also the backward: dhidden (=) and the head weight's gradient (+=).
  void loss(const Tensor& hidden, const Tensor& targets, LossScale scale, const Tensor& dhidden,
            LossSlotSums& sums, double* device_sums);
  // The same loss through another output matrix w [V, hidden] (this head's own, weight(),
  // or a multi-token prediction head's) with its gradient dw (+=), of other targets, into
  // the three slots from `first_slot`, its gradient x `weight`: what a multi-token
  // prediction depth predicts through. Shares this head's logits scratch.
  void loss_through(const Tensor& w, const Tensor& dw, double weight, int first_slot, const Tensor& hidden,
                    const Tensor& targets, LossScale scale, const Tensor& dhidden, LossSlotSums& sums,
                    double* device_sums);
  const Tensor& weight_grad() const { return tied_ ? embed_grad_ : grad_; }
  // Logits of hidden rows [M, hidden] (M <= the chunk) as host floats [M, V].
  void logits(const Tensor& hidden, std::vector<float>& out);

  std::unique_ptr<HeadDecoder> make_decoder(DecodeContext& ctx, const Norm& final_norm) const;
  void export_config(ExportConfig& out) const;
  const Tensor& weight() const { return tied_ ? embed_ : weight_; }
  int first_slot() const { return first_slot_; }

 private:
  const ExecContext& exec_;
  bool tied_;
  double softcap_;
  LmHeadSpec spec_;
  const Tensor& embed_;
  const Tensor& embed_grad_;
  Tensor weight_, grad_;         // [V, hidden]: the untied head's own
  // logits [chunk, V padded to 8] (compute dtype), row statistics [chunk, 2], and on the
  // GPU's mixed path at an odd vocabulary the weight's padded copy
  ops::LmHeadScratch scratch_;
  int first_slot_ = 0;           // "loss", then "z", then the target count
};

}  // namespace kiln
