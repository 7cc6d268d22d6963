// Causal grouped-query self-attention (registry name "gqa"), Qwen3/Llama shaped:
//   qkv = x Wqkv^T (one fused GEMM; q/k/v stay separately named parameters)
//   q, k <- per-head RMSNorm (if model.qk_norm) -> position encoding (RoPE)
//   o = attention(q, k, v) over packed sequences;  out = o Wo^T
#include "nn/modules.h"
#include "ops/attention/attention.h"
#include "ops/linear/linear.h"
#include "ops/split/qkv_split.h"

namespace kiln {

namespace {

class GqaAttention final : public Attention {
 public:
  GqaAttention(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position)
      : position_(position), workspace_(ctx.workspace) {
    const ModelConfig& m = *layer.model;
    const int64_t t = ctx.max_tokens;
    hq_ = m.heads, hkv_ = m.kv_heads, d_ = m.head_dim;
    const int64_t q_cols = hq_ * d_, kv_cols = hkv_ * d_, qkv_cols = q_cols + 2 * kv_cols;
    const std::string p = layer.prefix + ".attn.";
    ctx.fused_parameter(qkv_w_, qkv_g_, {{p + "q_proj.weight", q_cols}, {p + "k_proj.weight", kv_cols},
                                         {p + "v_proj.weight", kv_cols}},
                        m.hidden, true, Init::normal(m.init_std));
    if (m.attention_bias)
      ctx.fused_parameter(qkv_b_, qkv_bg_, {{p + "q_proj.bias", q_cols}, {p + "k_proj.bias", kv_cols},
                                            {p + "v_proj.bias", kv_cols}},
                          0, false, Init::zeros());
    // Output projection: scaled init keeps the residual stream's variance flat in depth.
    ctx.parameter(o_w_, o_g_, p + "o_proj.weight", Shape{m.hidden, q_cols}, true,
                  Init::normal(m.init_std / std::sqrt(2.0 * static_cast<double>(m.layers))));
    if (m.qk_norm) {
      q_norm_ = norm_registry().build("model.norm", m.norm, ctx, NormSpec{p + "q_norm", d_, t * hq_, m.norm_eps});
      k_norm_ = norm_registry().build("model.norm", m.norm, ctx, NormSpec{p + "k_norm", d_, t * hkv_, m.norm_eps});
    }
    qkv_cols_ = qkv_cols;
    ctx.saved(q_, Shape{t, hq_, d_});
    ctx.saved(k_, Shape{t, hkv_, d_});
    ctx.saved(v_, Shape{t, hkv_, d_});
    ctx.saved(o_, Shape{t, hq_, d_});
    ctx.saved_wide(lse_, Shape{t, hq_});
    // Scratch, as taken in backward(): d_o, dq, dk, dv, dqkv, dqn, dkn; forward() takes only
    // the fused projection qkv (its parts are copied out, so it is not kept for backward).
    const size_t q_bytes = Workspace::footprint(ctx.dtype, Shape{t, q_cols});
    const size_t kv_bytes = Workspace::footprint(ctx.dtype, Shape{t, kv_cols});
    ctx.workspace.reserve_peak(3 * q_bytes + 3 * kv_bytes + Workspace::footprint(ctx.dtype, Shape{t, qkv_cols}));
    // When q/k are normed, their pre-norm values (the norm backward's input) are copied
    // out of qkv into qn_/kn_, and the normed, rotated values go to q_/k_.
    if (m.qk_norm) {
      ctx.saved(qn_, Shape{t, hq_, d_});
      ctx.saved(kn_, Shape{t, hkv_, d_});
    }
  }

  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) override {
    const int64_t t = x.size(0);
    saved_x_ = x;
    Workspace::Scope scope(workspace_);
    Tensor qkv = scope.take(q_.dtype(), Shape{t, qkv_cols_});
    Tensor q = q_.rows(0, t), k = k_.rows(0, t), v = v_.rows(0, t);
    ops::linear_forward(x, qkv_w_, qkv_b_, qkv);
    if (q_norm_) {
      // Split raw q/k into qn_/kn_ (the norm inputs), normalize into q/k, then rotate.
      Tensor qn = qn_.rows(0, t), kn = kn_.rows(0, t);
      ops::qkv_split(qkv, qn, kn, v);
      q_norm_->forward(qn.view(Shape{t * hq_, d_}), q.view(Shape{t * hq_, d_}));
      k_norm_->forward(kn.view(Shape{t * hkv_, d_}), k.view(Shape{t * hkv_, d_}));
    } else {
      ops::qkv_split(qkv, q, k, v);
    }
    position_.apply(q, seq, false);
    position_.apply(k, seq, false);
    Tensor o = o_.rows(0, t);
    options_.max_seqlen = seq.max_seqlen;
    ops::attention_forward(q, k, v, seq.cu_seqlens, options_, o, lse_.rows(0, t));
    ops::linear_forward(o.view(Shape{t, hq_ * d_}), o_w_, Tensor(), out);
  }

  void backward(const Tensor& dout, const SeqInfo& seq, const Tensor& dx) override {
    const int64_t t = dout.size(0);
    Workspace::Scope scope(workspace_);
    Tensor d_o = scope.take(dout.dtype(), Shape{t, hq_, d_});
    Tensor o = o_.rows(0, t);
    ops::linear_backward(o.view(Shape{t, hq_ * d_}), o_w_, dout, d_o.view(Shape{t, hq_ * d_}), o_g_, Tensor());
    Tensor dq = scope.take(dout.dtype(), Shape{t, hq_, d_});
    Tensor dk = scope.take(dout.dtype(), Shape{t, hkv_, d_});
    Tensor dv = scope.take(dout.dtype(), Shape{t, hkv_, d_});
    // q_ and k_ hold rotated values: exactly what attention saw.
    ops::attention_backward(q_.rows(0, t), k_.rows(0, t), v_.rows(0, t), o, lse_.rows(0, t), d_o, seq.cu_seqlens,
                            options_, dq, dk, dv);
    position_.apply(dq, seq, true);
    position_.apply(dk, seq, true);
    Tensor dqkv = scope.take(dout.dtype(), Shape{t, qkv_cols_});
    if (q_norm_) {
      Tensor dqn = scope.take(dout.dtype(), Shape{t, hq_, d_});
      Tensor dkn = scope.take(dout.dtype(), Shape{t, hkv_, d_});
      q_norm_->backward(dq.view(Shape{t * hq_, d_}), dqn.view(Shape{t * hq_, d_}), false);
      k_norm_->backward(dk.view(Shape{t * hkv_, d_}), dkn.view(Shape{t * hkv_, d_}), false);
      ops::qkv_merge(dqn, dkn, dv, dqkv);
    } else {
      ops::qkv_merge(dq, dk, dv, dqkv);
    }
    ops::linear_backward(saved_x_, qkv_w_, dqkv, dx, qkv_g_, qkv_bg_);
  }

 private:
  PositionEncoding& position_;
  Workspace& workspace_;
  int64_t hq_ = 0, hkv_ = 0, d_ = 0;
  ops::AttentionOptions options_;
  Tensor qkv_w_, qkv_g_, qkv_b_, qkv_bg_, o_w_, o_g_;
  std::unique_ptr<Norm> q_norm_, k_norm_;
  int64_t qkv_cols_ = 0;
  Tensor q_, k_, v_, o_, lse_, qn_, kn_;
  Tensor saved_x_;
};

}  // namespace

void register_gqa_attention(AttentionRegistry& registry) {
  registry.add("gqa", "causal grouped-query attention over packed documents, optional q/k RMSNorm",
               [](BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position) {
                 return std::make_unique<GqaAttention>(ctx, layer, position);
               });
}

}  // namespace kiln
