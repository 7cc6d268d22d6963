// NoPE multi-head latent attention as a token mixer (registry name "mla"; DeepSeek-V2's
// MLA without its rotary part, as the K3-style hybrids interleave it with KDA), per layer:
//   q_h      = (W_q x)_h                       d_qk per head (no low-rank query path)
//   c        = RMSNorm(W_kva x) * gain         the latent, model.mla.kv_rank wide
//   k_h, v_h = (W_kb c)_h, (W_vb c)_h          d_qk and d_v per head (they may differ)
//   o_h      = causal softmax(q_h k_h^T / sqrt(d_qk)) v_h   per document of a packed batch
//   out      = W_o concat_h(o_h)
// No position encoding at all (the layer is NoPE whatever model.position says). Heads are
// model.heads; W_kb and W_vb are one fused weight, the k rows first (k_b_proj, v_b_proj).
// The attention is kiln's packed causal attention op, on q, k and v zero-padded to one
// head width max(d_qk, d_v) (ops/mla/mla_heads.h), on the GPU rounded up to a multiple of
// 8 (cuDNN's SDPA, the bf16 path, takes one head width for q, k and v as kiln calls it).
//
// Training runs on the CPU (f32, f64) and the GPU (f32, or bf16 compute copies with fp32
// master gradients, the latent norm's gain and statistics fp32), composed of the linear,
// rms_norm and attention ops and one head-copy kernel: everything enqueues on the
// context's stream, so the step can be captured in a CUDA graph. Exports are refused
// naming the key (no stock family has a NoPE MLA layer). QK-Clip: per head, the head's q rows of W_q and k
// rows of W_kb scaled by sqrt(tau / max) each; W_vb untouched.
//
// Decode (mla_mixer_decode.cpp): caches the latent c per position (r numbers, not k and
// v), with W_kb absorbed into the query and W_vb applied after the weighted sum of latents;
// on the CPU and the GPU (f32, bf16), latents at most 512 wide (model.mla.kv_rank).
#pragma once

#include "nn/linear_layer.h"
#include "nn/modules.h"
#include "nn/qk_clip.h"
#include "ops/attention/attention.h"

namespace kiln {

class MlaMixer final : public TokenMixer {
 public:
  MlaMixer(BuildContext& ctx, const LayerSpec& layer);

  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) override;
  void backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) override;
  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const override;
  double extra_forward_flops_per_token(int64_t seq_len) const override;
  void export_config(ExportConfig& out) const override;
  bool clips_qk() const override { return true; }  // its QkClip, when training asks for one
  void after_step(bool applied) override;
  void report(std::vector<std::pair<std::string, double>>& out) const override;

 private:
  friend class MlaDecoder;
  ops::AttentionOptions attention_options(const SeqInfo& seq) const;
  // The key and value rows of the fused up-projection kv_b (views of its weight and gradient).
  LinearLayer k_up() const { return kv_b_proj_.rows(0, h_ * dqk_); }
  LinearLayer v_up() const { return kv_b_proj_.rows(h_ * dqk_, h_ * (dqk_ + dv_)); }

  // The widest padded head the GPU's attention takes (cuDNN's limit; the fp32 kernel's too).
  static constexpr int64_t kMaxGpuHeadDim = 256;

  const ExecContext& exec_;
  Workspace& workspace_;
  const LossContext* losses_;     // whether a forward is a training one (QK-Clip measures those)
  std::unique_ptr<QkClip> clip_;  // training with [optim.qk_clip]
  std::string key_;               // model.attention or model.alt_attention: its refusals name it
  int64_t h_ = 0, dqk_ = 0, dv_ = 0, d_ = 0, rank_ = 0;  // d_ = max(dqk_, dv_): attention's width
  double norm_eps_ = 1e-6;
  ops::AttentionOptions options_;  // scale 1/sqrt(d_qk)
  LinearLayer q_proj_;     // [H dqk, hidden]
  LinearLayer kv_a_proj_;  // [rank, hidden]: the latent
  LinearLayer kv_b_proj_;  // [H (dqk + dv), rank]: k rows, then v rows
  LinearLayer o_proj_;     // [hidden, H dv]
  Tensor gain_, gain_g_;   // the latent's norm [rank]
  // Saved by forward: the latent before and after its norm (and the norm's rstd), the padded
  // q, k, v, the attention's output and its softmax statistics.
  Tensor a_, c_, rstd_, q_, k_, v_, o_, lse_;
};

}  // namespace kiln
