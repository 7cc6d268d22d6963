#include "nn/mla_mixer.h"

#include "nn/mup.h"
#include "ops/dropout/dropout_mask.h"
#include "ops/mla/mla_heads.h"
#include "ops/rms_norm/rms_norm.h"

#include <algorithm>
#include <cmath>

namespace kiln {

MlaMixer::MlaMixer(BuildContext& ctx, const LayerSpec& layer)
    : exec_(ctx.exec), workspace_(ctx.workspace), losses_(ctx.losses), key_(mixer_key(layer)) {
  const ModelConfig& m = *layer.model;
  KILN_CHECK(layer.choices.window == 0, "model.sliding_window",
             "'mla' layers attend to the whole causal context: list layer {} in model.full_attention_layers", layer.index);
  KILN_CHECK(m.attention_softcap == 0, "model.attention_softcap", "'mla' layers have no logit softcap");
  KILN_CHECK(!m.attention_sinks, "model.attention_sinks", "'mla' layers have no attention sinks");
  h_ = m.heads, norm_eps_ = m.norm_eps;
  dqk_ = m.mla.qk_head_dim > 0 ? m.mla.qk_head_dim : m.head_dim;
  dv_ = m.mla.v_head_dim > 0 ? m.mla.v_head_dim : m.head_dim;
  rank_ = m.mla.kv_rank > 0 ? m.mla.kv_rank : m.hidden / 4;
  KILN_CHECK(rank_ > 0, "model.mla.kv_rank", "= 0 defaults to model.hidden / 4, which is 0 here: set it");
  d_ = std::max(dqk_, dv_);
  if (ctx.device == Device::cuda) {
    // cuDNN's attention (the bf16 path) takes head widths that are multiples of 8, at most
    // 256: more zero columns, which change nothing, and a refusal past the limit.
    d_ = (d_ + 7) / 8 * 8;
    KILN_CHECK(d_ <= kMaxGpuHeadDim, dqk_ >= dv_ ? "model.mla.qk_head_dim" : "model.mla.v_head_dim",
               "= {}: 'mla' on the GPU attends over heads at most {} wide", std::max(dqk_, dv_), kMaxGpuHeadDim);
  }
  options_.scale = 1.0 / std::sqrt(static_cast<double>(dqk_));
  options_.deterministic = ctx.deterministic;
  options_.dropout.p = m.attention_dropout;  // drawn only where a batch's key is given (training)
  options_.dropout.site = dropout::attention_site(layer.index);
  const int64_t t = ctx.max_tokens, qc = h_ * dqk_, vc = h_ * dv_;
  // DeepSeek-V2's names (self_attn.q_proj, kv_a_proj, kv_a_layernorm; kv_b_proj split into
  // its k and v rows); llama.cpp has none for a NoPE MLA.
  const NameScope n = layer.names.child("mla.", "self_attn.", "");
  const Init hidden_init = Init::normal(hidden_init_std(m));
  const Tensor& q_master =
      q_proj_.declare_fused(ctx, {{n("q_proj.weight", "q_proj.weight", ""), qc}}, m.hidden, ParamRole::matrix,
                            hidden_init);
  kv_a_proj_.declare(ctx, n("kv_a_proj.weight", "kv_a_proj.weight", ""), rank_, m.hidden, ParamRole::matrix,
                     hidden_init);
  ctx.parameter(gain_, gain_g_, n("kv_a_layernorm.weight", "kv_a_layernorm.weight", ""), Shape{rank_}, ParamRole::norm,
                Init::ones());
  const Tensor& kvb_master = kv_b_proj_.declare_fused(
      ctx, {{n("k_b_proj.weight", "k_b_proj.weight", ""), qc}, {n("v_b_proj.weight", "v_b_proj.weight", ""), vc}},
      rank_, ParamRole::matrix, hidden_init);
  // The residual writer: scaled init keeps the residual stream's variance flat in depth.
  o_proj_.declare(ctx, n("o_proj.weight", "o_proj.weight", ""), m.hidden, vc, ParamRole::matrix,
                  Init::normal(residual_init_std(m)));
  if (ctx.training && ctx.qk_clip_tau > 0) {
    // Every head has its own key (per-head sharing): q rows in W_q, k rows in W_kb.
    QkClipWeights w;
    w.qkv_master = &q_master;
    w.k_master = &kvb_master;
    clip_ = std::make_unique<QkClip>(ctx, layer.index, h_, h_, dqk_, false);
    clip_->set_weights(std::move(w));
  }
  ctx.saved(a_, Shape{t, rank_});
  ctx.saved(c_, Shape{t, rank_});
  ctx.saved_wide(rstd_, Shape{t});
  for (Tensor* s : {&q_, &k_, &v_, &o_}) ctx.saved(*s, Shape{t, h_, d_});
  ctx.saved_wide(lse_, Shape{t, h_});
  // Backward's peak: d(head outputs) and the crop of o; d_o, dq, dk, dv padded; their crops;
  // the latent's two gradients (forward takes less).
  auto bytes = [&](int64_t cols) { return Workspace::footprint(ctx.dtype, Shape{t, cols}); };
  ctx.workspace.reserve_peak(2 * bytes(vc) + 4 * bytes(h_ * d_) + bytes(qc) * 2 + bytes(vc) + 2 * bytes(rank_));
}

ops::AttentionOptions MlaMixer::attention_options(const SeqInfo& seq) const {
  ops::AttentionOptions o = options_;
  o.max_seqlen = seq.max_seqlen;
  o.uniform = seq.uniform;
  o.dropout.key = seq.dropout_key;  // defined only for a batch that runs a backward
  return o;
}

void MlaMixer::forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) {
  const int64_t t = x.size(0);
  Workspace::Scope scope(workspace_);
  const DType dt = x.dtype();
  const Tensor a = a_.rows(0, t), c = c_.rows(0, t), q = q_.rows(0, t), k = k_.rows(0, t), v = v_.rows(0, t);
  const Tensor o = o_.rows(0, t);
  // q, then the latent and the keys and values it expands to, each padded to d_.
  const Tensor q_raw = scope.take(dt, Shape{t, h_, dqk_});
  q_proj_.forward(x, q_raw.view(Shape{t, h_ * dqk_}));
  ops::mla_copy_heads(exec_, q_raw, q);
  kv_a_proj_.forward(x, a);
  ops::rms_norm_forward(exec_, a, gain_, norm_eps_, c, rstd_.rows(0, t));
  const Tensor k_raw = scope.take(dt, Shape{t, h_, dqk_}), v_raw = scope.take(dt, Shape{t, h_, dv_});
  k_up().forward(c, k_raw.view(Shape{t, h_ * dqk_}));
  v_up().forward(c, v_raw.view(Shape{t, h_ * dv_}));
  ops::mla_copy_heads(exec_, k_raw, k);
  ops::mla_copy_heads(exec_, v_raw, v);
  if (clip_ && losses_->backward && !losses_->recomputing)  // a training forward, measured once
    clip_->measure(q, k, seq.cu_seqlens, attention_options(seq));
  ops::attention_forward(exec_, q, k, v, seq.cu_seqlens, attention_options(seq), o, lse_.rows(0, t));
  ops::mla_copy_heads(exec_, o, v_raw);  // the value columns of each head's output
  o_proj_.forward(v_raw.view(Shape{t, h_ * dv_}), out);
}

void MlaMixer::backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) {
  const int64_t t = dout.size(0);
  Workspace::Scope scope(workspace_);
  const DType dt = dout.dtype();
  const Tensor a = a_.rows(0, t), c = c_.rows(0, t), q = q_.rows(0, t), k = k_.rows(0, t), v = v_.rows(0, t);
  const Tensor o = o_.rows(0, t);
  // Output side: W_o, then the padded attention output's gradient.
  const Tensor ov = scope.take(dt, Shape{t, h_, dv_}), dov = scope.take(dt, Shape{t, h_, dv_});
  ops::mla_copy_heads(exec_, o, ov);
  o_proj_.backward(ov.view(Shape{t, h_ * dv_}), dout, dov.view(Shape{t, h_ * dv_}));
  const Tensor d_o = scope.take(dt, Shape{t, h_, d_}), dq = scope.take(dt, Shape{t, h_, d_});
  const Tensor dk = scope.take(dt, Shape{t, h_, d_}), dv = scope.take(dt, Shape{t, h_, d_});
  ops::mla_copy_heads(exec_, dov, d_o);
  ops::attention_backward(exec_, q, k, v, o, lse_.rows(0, t), d_o, seq.cu_seqlens, attention_options(seq), dq, dk, dv);
  // Crop the padding's gradients away, then back through the projections.
  const Tensor dq_raw = scope.take(dt, Shape{t, h_, dqk_}), dk_raw = scope.take(dt, Shape{t, h_, dqk_});
  ops::mla_copy_heads(exec_, dq, dq_raw);
  ops::mla_copy_heads(exec_, dk, dk_raw);
  ops::mla_copy_heads(exec_, dv, dov);  // dov is free again: the value gradient
  q_proj_.backward(x, dq_raw.view(Shape{t, h_ * dqk_}), dx);
  const Tensor dc = scope.take(dt, Shape{t, rank_}), da = scope.take(dt, Shape{t, rank_});
  k_up().backward(c, dk_raw.view(Shape{t, h_ * dqk_}), dc);
  v_up().backward(c, dov.view(Shape{t, h_ * dv_}), dc, true);
  ops::rms_norm_backward(exec_, a, gain_, rstd_.rows(0, t), dc, da, gain_g_);
  kv_a_proj_.backward(x, da, dx, true);
}

void MlaMixer::after_step(bool applied) {
  if (clip_) clip_->after_step(applied);
}

void MlaMixer::report(std::vector<std::pair<std::string, double>>& out) const {
  if (clip_) clip_->report(out);
}

// Scores (d_qk per key) and weighted values (d_v per key), 2 FLOPs each, over the S / 2
// keys a causal query sees on average.
double MlaMixer::extra_forward_flops_per_token(int64_t seq_len) const {
  return 2.0 * static_cast<double>(h_ * (dqk_ + dv_)) * static_cast<double>(seq_len) / 2.0;
}

void MlaMixer::export_config(ExportConfig& out) const {
  out.refuse(key_, "'mla'",
             out.format() == ExportConfig::Format::gguf
                 ? "llama.cpp's architectures kiln writes have no NoPE MLA layer"
                 : "no stock transformers class kiln exports computes a NoPE MLA layer");
}

void register_mla_mixer(MixerRegistry& registry) {
  registry.add("mla",
               "NoPE multi-head latent attention: a normed low-rank latent expanded to k and v per head "
               "([model.mla]; decode caches the latent)",
               [](BuildContext& ctx, const LayerSpec& layer, PositionEncoding&) {
                 return std::make_unique<MlaMixer>(ctx, layer);
               });
}

}  // namespace kiln
