// Causal grouped-query self-attention (registry name "gqa"), Qwen3/Llama shaped:
//   qkv = x Wqkv^T (one fused GEMM; q/k/v stay separately named parameters)
//   q, k <- per-head norm (if model.qk_norm; parameters shared by the heads, as Qwen3's
//           q_norm / k_norm; model.qk_norm_type: RMSNorm, Gemma's RMSNorm or DyT)
//           -> rotary position encoding (unless the layer is NoPE)
//   o = attention(q, k, v) over packed sequences (the layer's window, the softcap, the
//       sinks: a learned logit per head in each softmax's denominator);  out = o Wo^T
// The per-head steps are one fused op (ops/attention/qkv_prepare.h); Gemma's RMSNorm
// passes it the gains 1 + w, formed before each use; DyT, which that op does not compute,
// runs as the op's split, ops/dyt and ops/rope in turn. Only the raw
// projection is saved: q, k, v are rebuilt from it in backward (one cheap pass), which
// saves keeping both raw and normed copies of q and k.
//
// Decode (gqa_attention_decode.cpp): a KV cache per layer, the same ops over the step's
// rows (qkv_prepare at the rows' positions, the cache write, cached attention), or on the
// GPU the fused kernels of ops/decode/decode_kernels.h.
#pragma once

#include "nn/linear_layer.h"
#include "nn/modules.h"
#include "nn/qk_clip.h"
#include "ops/attention/attention.h"
#include "ops/attention/qkv_prepare.h"

namespace kiln {

class GqaAttention final : public TokenMixer {
 public:
  GqaAttention(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position);

  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) override;
  void backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) override;
  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const override;
  double extra_forward_flops_per_token(int64_t seq_len) const override;
  void export_config(ExportConfig& out) const override;
  bool clips_qk() const override { return true; }  // its QkClip, when training asks for one
  void after_step(bool applied) override;
  void report(std::vector<std::pair<std::string, double>>& out) const override;

  int64_t q_heads() const { return hq_; }
  int64_t kv_heads() const { return hkv_; }
  int64_t head_dim() const { return d_; }
  int64_t window() const { return options_.window; }

 private:
  void export_gemma_gguf(ExportConfig& out) const;  // gemma2/gemma3's attention keys
  friend class GqaDecoder;
  // The q/k preparation for these positions (the layer's rotary tables, if it rotates).
  ops::QkvPrepare prepare_at(const Tensor& positions) const;
  ops::AttentionOptions attention_options(const SeqInfo& seq) const;
  // q, k, v [n, H, D] from the raw projection at these positions, with the q/k norm and RoPE
  // (the fused op, or DyT's three steps: then q_raw, k_raw receive the split).
  void prepare_qkv(const Tensor& qkv, const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& q_raw, const Tensor& k_raw) const;
  // Gemma's RMSNorm: prepare_'s gains = 1 + w (w changes with every step).
  void form_gemma_gains() const;
  bool dyt() const { return qk_kind_ == QkNormKind::dyt; }

  enum class QkNormKind { rmsnorm, gemma_rmsnorm, dyt };

  PositionEncoding& position_;
  const ExecContext& exec_;
  Workspace& workspace_;
  const LossContext* losses_;  // whether a forward is a training one (QK-Clip measures those)
  std::unique_ptr<QkClip> clip_;  // training with [optim.qk_clip]
  int64_t layer_ = 0, hidden_ = 0, hq_ = 0, hkv_ = 0, d_ = 0, qkv_cols_ = 0;
  bool rotary_ = true;        // the layer applies RoPE (false: NoPE)
  bool qk_norm_ = false;      // q and k pass a per-head norm (model.qk_norm) ...
  QkNormKind qk_kind_ = QkNormKind::rmsnorm;  // ... of this kind (model.qk_norm_type)
  bool bias_ = false;         // q/k/v projections have biases (model.attention_bias)
  ops::AttentionOptions options_;  // window, softcap and the sinks parameter (model.attention_sinks)
  ops::QkvPrepare prepare_;   // heads and gains; tables and positions per call
  LinearLayer qkv_proj_;  // [(Hq + 2 Hkv) D, hidden]: q, k, v rows (and their fused bias)
  LinearLayer o_proj_;    // [hidden, Hq D]
  Tensor q_gain_grad_, k_gain_grad_;
  Tensor sinks_grad_;  // [Hq], with model.attention_sinks
  // Gemma's RMSNorm: the weights w (prepare_'s gains are 1 + w); DyT: the gains. [D] each.
  Tensor q_weight_, k_weight_;
  Tensor q_alpha_, k_alpha_, q_alpha_grad_, k_alpha_grad_;      // DyT: [1] each
  Tensor q_bias_, k_bias_, q_bias_grad_, k_bias_grad_;          // DyT: [D] each
  Tensor qkv_;  // saved [T, (Hq + 2 Hkv) D]: the raw projection
  Tensor o_;    // saved [T, Hq, D]: the attention output
  Tensor lse_;  // saved [T, Hq]: softmax statistics
};

}  // namespace kiln
