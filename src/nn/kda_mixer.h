// Kimi Delta Attention as a token mixer (registry name "kda"; Kimi Linear's layer, as
// flash-linear-attention's layers/kda.py), per layer:
//   q|k|v = silu(short_conv(x Wqkv^T))       depthwise, causal, kernel model.kda.conv_kernel,
//                                             per document (ops/short_conv)
//   q, k <- L2-normalized per head            (eps 1e-6, FLA's l2norm)
//   g    = -exp(A_log) softplus(Wfb Wfa x + dt_bias)   channel-wise log decay (ops/kda/kda_gate.h)
//   beta = sigmoid(Wb x)                      per head
//   o    = KDA(q, k, v, g, beta)              the gated delta rule, scale 1/sqrt(d_k), chunked
//   out  = Wo [RMSNorm_head(o) * gain * sigmoid(Wgb Wga x + bgb)]
// Wfa/Wfb and Wga/Wgb are low rank (model.kda.gate_rank). Documents never share state: the
// convolution and the delta rule restart at each document of a packed batch.
//
// CPU (f32, f64) trains on the chunked delta rule; the GPU (f32, or bf16 with fp32 math)
// on the CUDA kernels model.kda.gpu_kernel names (kda_gpu_kernel), recurrent or chunked, whose f32 workspace
// (the recurrent backward's; both directions of the chunked) is planned for at most one
// document per kTokensPerDoc tokens of a micro-batch. Exports refuse it (no stock
// transformers or llama.cpp family computes it).
//
// Decode (kda_mixer_decode.cpp): a fixed-size state per slot, the convolution's last
// kernel - 1 inputs and the delta rule's S [H, d_k, d_v].
#pragma once

#include "nn/linear_layer.h"
#include "nn/modules.h"
#include "ops/short_conv/short_conv.h"

namespace kiln {

// model.kda.gpu_kernel as it runs for a head_dim of `dk`: "auto" is chunked_bf16 (the
// fastest, docs/kda.md) where the chunked kernels take the head_dim, else recurrent; any
// other setting is itself.
std::string kda_gpu_kernel(const std::string& setting, int64_t dk);

class KdaMixer final : public TokenMixer {
 public:
  KdaMixer(BuildContext& ctx, const LayerSpec& layer);

  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) override;
  void backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) override;
  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const override;
  double extra_forward_flops_per_token(int64_t seq_len) const override;
  void export_config(ExportConfig& out) const override;

 private:
  friend class KdaDecoder;
  // g [n, H, d_k] from the low-rank projection's output graw [n, H d_k].
  void gate(const Tensor& graw, const Tensor& g) const;
  // The GPU delta rule's f32 workspace for this micro-batch (undefined where none is needed).
  Tensor delta_rule_workspace(Workspace::Scope& scope, const SeqInfo& seq, int64_t tokens, bool backward) const;
  Tensor dt_bias_2d() const { return dt_bias_.view(Shape{h_, dk_}); }

  const ExecContext& exec_;
  Workspace& workspace_;
  static constexpr int64_t kTokensPerDoc = 16;
  std::string key_;  // model.attention or model.alt_attention: its refusals name it
  bool cuda_ = false;
  bool chunked_gpu_ = false;  // model.kda.gpu_kernel = "chunked" or "chunked_bf16" on a CUDA device
  bool bf16_grads_ = false;   // model.kda.gpu_kernel = "chunked_bf16": its backward's grads_bf16_kernel
  ops::ShortConvGpuKernel conv_kernel_ = ops::ShortConvGpuKernel::per_element;  // model.kda.conv_gpu_kernel
  int64_t max_docs_ = 0;      // documents per micro-batch the GPU workspace holds
  int64_t hidden_ = 0, h_ = 0, dk_ = 0, dv_ = 0, rank_ = 0, kernel_ = 0, qkv_cols_ = 0;
  double norm_eps_ = 1e-6;
  LinearLayer qkv_proj_;                // [2 H dk + H dv, hidden]: q, k, v rows
  LinearLayer f_a_proj_, f_b_proj_;     // the decay gate's low-rank pair: [rank, hidden], [H dk, rank]
  LinearLayer b_proj_;                  // [H, hidden]: beta
  LinearLayer g_a_proj_, g_b_proj_;     // the output gate's: [rank, hidden], [H dv, rank] (+ bias)
  LinearLayer o_proj_;                  // [hidden, H dv]
  Tensor conv_w_, conv_g_;              // the short convolution over q|k|v
  Tensor a_log_, a_log_g_, dt_bias_, dt_bias_g_, gain_, gain_g_;
  // Saved by forward (backward recomputes the convolution's output, q, k, v, g, beta and the
  // gated output from them).
  Tensor qkv_raw_, fa_, graw_, braw_, o_, ga_, gpre_;
};

}  // namespace kiln
