// Causal grouped-query self-attention (registry name "gqa"), Qwen3/Llama shaped:
//   qkv = x Wqkv^T (one fused GEMM; q/k/v stay separately named parameters)
//   q, k <- per-head RMSNorm (if model.qk_norm; gains shared by the heads, as Qwen3's
//           q_norm / k_norm) -> rotary position encoding (if the model has one)
//   o = attention(q, k, v) over packed sequences;  out = o Wo^T
// The per-head steps are one fused op (ops/attention/qkv_prepare.h). Only the raw
// projection is saved: q, k, v are rebuilt from it in backward (one cheap pass), which
// saves keeping both raw and normed copies of q and k.
#include "nn/modules.h"
#include "ops/attention/attention.h"
#include "ops/attention/qkv_prepare.h"
#include "ops/linear/linear.h"

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
    options_.deterministic = ctx.deterministic;
    options_.window = m.sliding_window;
    options_.softcap = m.attention_softcap;
    prepare_.q_heads = hq_, prepare_.kv_heads = hkv_, prepare_.head_dim = d_;
    if (m.qk_norm) {
      ctx.parameter(prepare_.q_gain, q_gain_grad_, p + "q_norm.weight", Shape{d_}, false, Init::ones());
      ctx.parameter(prepare_.k_gain, k_gain_grad_, p + "k_norm.weight", Shape{d_}, false, Init::ones());
      prepare_.eps = m.norm_eps;
    }
    qkv_cols_ = qkv_cols;
    ctx.saved(qkv_, Shape{t, qkv_cols});
    ctx.saved(o_, Shape{t, hq_, d_});
    ctx.saved_wide(lse_, Shape{t, hq_});
    // Scratch: forward takes q|k|v; backward takes d_o, q|k|v again, dq|dk|dv and dqkv.
    const size_t parts = Workspace::footprint(ctx.dtype, Shape{t, q_cols}) +
                         2 * Workspace::footprint(ctx.dtype, Shape{t, kv_cols});
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.dtype, Shape{t, q_cols}) + 2 * parts +
                               Workspace::footprint(ctx.dtype, Shape{t, qkv_cols}));
  }

  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) override {
    const int64_t t = x.size(0);
    Workspace::Scope scope(workspace_);
    Tensor qkv = qkv_.rows(0, t);
    ops::linear_forward(x, qkv_w_, qkv_b_, qkv);
    Tensor q = scope.take(qkv.dtype(), Shape{t, hq_, d_});
    Tensor k = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
    Tensor v = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
    ops::qkv_prepare_forward(qkv, prepare_for(seq), q, k, v);
    Tensor o = o_.rows(0, t);
    ops::attention_forward(q, k, v, seq.cu_seqlens, attention_options(seq), o, lse_.rows(0, t));
    ops::linear_forward(o.view(Shape{t, hq_ * d_}), o_w_, Tensor(), out);
  }

  void backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) override {
    const int64_t t = dout.size(0);
    Workspace::Scope scope(workspace_);
    Tensor d_o = scope.take(dout.dtype(), Shape{t, hq_, d_});
    Tensor o = o_.rows(0, t), qkv = qkv_.rows(0, t);
    ops::linear_backward(o.view(Shape{t, hq_ * d_}), o_w_, dout, d_o.view(Shape{t, hq_ * d_}), o_g_, Tensor());
    // q, k, v exactly as forward computed them (same kernel, same input).
    const ops::QkvPrepare prepare = prepare_for(seq);
    Tensor q = scope.take(qkv.dtype(), Shape{t, hq_, d_});
    Tensor k = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
    Tensor v = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
    ops::qkv_prepare_forward(qkv, prepare, q, k, v);
    Tensor dq = scope.take(dout.dtype(), Shape{t, hq_, d_});
    Tensor dk = scope.take(dout.dtype(), Shape{t, hkv_, d_});
    Tensor dv = scope.take(dout.dtype(), Shape{t, hkv_, d_});
    ops::attention_backward(q, k, v, o, lse_.rows(0, t), d_o, seq.cu_seqlens, attention_options(seq), dq, dk, dv);
    Tensor dqkv = scope.take(dout.dtype(), Shape{t, qkv_cols_});
    ops::qkv_prepare_backward(qkv, prepare, dq, dk, dv, dqkv, q_gain_grad_, k_gain_grad_);
    ops::linear_backward(x, qkv_w_, dqkv, dx, qkv_g_, qkv_bg_);
  }

 private:
  ops::QkvPrepare prepare_for(const SeqInfo& seq) {
    ops::QkvPrepare p = prepare_;
    const RotaryTables tables = position_.rotary();
    p.cos = tables.cos, p.sin = tables.sin, p.positions = seq.positions;
    return p;
  }

  ops::AttentionOptions attention_options(const SeqInfo& seq) const {
    ops::AttentionOptions o = options_;
    o.max_seqlen = seq.max_seqlen;
    o.uniform = seq.uniform;
    return o;
  }

  PositionEncoding& position_;
  Workspace& workspace_;
  int64_t hq_ = 0, hkv_ = 0, d_ = 0, qkv_cols_ = 0;
  ops::AttentionOptions options_;
  ops::QkvPrepare prepare_;  // heads and gains; tables and positions per call
  Tensor qkv_w_, qkv_g_, qkv_b_, qkv_bg_, o_w_, o_g_, q_gain_grad_, k_gain_grad_;
  Tensor qkv_, o_, lse_;     // saved: raw projection, attention output, softmax statistics
};

}  // namespace

void register_gqa_attention(AttentionRegistry& registry) {
  registry.add("gqa", "causal grouped-query attention over packed documents, optional q/k RMSNorm",
               [](BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position) {
                 return std::make_unique<GqaAttention>(ctx, layer, position);
               });
}

}  // namespace kiln
