#include "nn/gqa_attention.h"

#include "ops/linear/linear.h"

#include <algorithm>
#include <cmath>

namespace kiln {

GqaAttention::GqaAttention(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position)
    : position_(position), workspace_(ctx.workspace) {
  const ModelConfig& m = *layer.model;
  const int64_t t = ctx.max_tokens;
  layer_ = layer.index, hidden_ = m.hidden, hq_ = m.heads, hkv_ = m.kv_heads, d_ = m.head_dim;
  rotary_ = layer.choices.rotary;
  qk_norm_ = m.qk_norm, bias_ = m.attention_bias;
  const int64_t q_cols = hq_ * d_, kv_cols = hkv_ * d_, qkv_cols = q_cols + 2 * kv_cols;
  const NameScope n = layer.names.child("attn.", "self_attn.", "");
  // llama.cpp's llama architecture pairs RoPE's rows interleaved: its exporter permutes
  // the q and k rows of rotating layers.
  const GgufLayout rope_rows = rotary_ ? GgufLayout::rope_rows : GgufLayout::plain;
  ctx.fused_parameter(qkv_w_, qkv_g_,
                      {{n("q_proj.weight", "q_proj.weight", "attn_q.weight", rope_rows), q_cols},
                       {n("k_proj.weight", "k_proj.weight", "attn_k.weight", rope_rows), kv_cols},
                       {n("v_proj.weight", "v_proj.weight", "attn_v.weight"), kv_cols}},
                      m.hidden, true, Init::normal(m.init_std));
  if (m.attention_bias)
    ctx.fused_parameter(qkv_b_, qkv_bg_,
                        {{n("q_proj.bias", "q_proj.bias", "attn_q.bias"), q_cols},
                         {n("k_proj.bias", "k_proj.bias", "attn_k.bias"), kv_cols},
                         {n("v_proj.bias", "v_proj.bias", "attn_v.bias"), kv_cols}},
                        0, false, Init::zeros());
  // Output projection: scaled init keeps the residual stream's variance flat in depth.
  ctx.parameter(o_w_, o_g_, n("o_proj.weight", "o_proj.weight", "attn_output.weight"), Shape{m.hidden, q_cols}, true,
                Init::normal(m.init_std / std::sqrt(2.0 * static_cast<double>(m.layers))));
  options_.deterministic = ctx.deterministic;
  options_.window = layer.choices.window;
  options_.softcap = m.attention_softcap;
  prepare_.q_heads = hq_, prepare_.kv_heads = hkv_, prepare_.head_dim = d_;
  if (m.qk_norm) {
    ctx.parameter(prepare_.q_gain, q_gain_grad_, n("q_norm.weight", "q_norm.weight", "attn_q_norm.weight"), Shape{d_},
                  false, Init::ones());
    ctx.parameter(prepare_.k_gain, k_gain_grad_, n("k_norm.weight", "k_norm.weight", "attn_k_norm.weight"), Shape{d_},
                  false, Init::ones());
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

void GqaAttention::forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) {
  const int64_t t = x.size(0);
  Workspace::Scope scope(workspace_);
  Tensor qkv = qkv_.rows(0, t);
  ops::linear_forward(x, qkv_w_, qkv_b_, qkv);
  Tensor q = scope.take(qkv.dtype(), Shape{t, hq_, d_});
  Tensor k = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
  Tensor v = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
  ops::qkv_prepare_forward(qkv, prepare_at(seq.positions), q, k, v);
  Tensor o = o_.rows(0, t);
  ops::attention_forward(q, k, v, seq.cu_seqlens, attention_options(seq), o, lse_.rows(0, t));
  ops::linear_forward(o.view(Shape{t, hq_ * d_}), o_w_, Tensor(), out);
}

void GqaAttention::backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) {
  const int64_t t = dout.size(0);
  Workspace::Scope scope(workspace_);
  Tensor d_o = scope.take(dout.dtype(), Shape{t, hq_, d_});
  Tensor o = o_.rows(0, t), qkv = qkv_.rows(0, t);
  ops::linear_backward(o.view(Shape{t, hq_ * d_}), o_w_, dout, d_o.view(Shape{t, hq_ * d_}), o_g_, Tensor());
  // q, k, v exactly as forward computed them (same kernel, same input).
  const ops::QkvPrepare prepare = prepare_at(seq.positions);
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

// Scores (q k^T) and weighted values (p v): 2 x 2 x Hq x D FLOPs per key a query sees. A
// causal query at position p sees min(p + 1, window) keys; over a sequence of S tokens that
// averages S / 2 without a window (the usual convention, which the benchmarks' MFU uses)
// and window - window^2 / (2 S) with one shorter than S.
double GqaAttention::extra_forward_flops_per_token(int64_t seq_len) const {
  const auto s = static_cast<double>(seq_len);
  const auto w = static_cast<double>(options_.window);
  const double keys = options_.window > 0 && w < s ? w - w * w / (2.0 * s) : s / 2.0;
  return 4.0 * static_cast<double>(hq_ * d_) * keys;
}

// Qwen3 is the family with q/k norms and no biases; Qwen2 biases q, k and v (never o);
// Llama has neither (its attention_bias would bias o_proj too). None has a softcap, NoPE
// layers, or (not yet verified against transformers: Qwen2/3 describe them by
// layer_types) windowed layers.
void GqaAttention::export_config(ExportConfig& out) const {
  const bool qk_norm = qk_norm_, bias = bias_;
  if (options_.softcap > 0) out.refuse("model.attention_softcap", fmt::format("{}", options_.softcap), "no softcap");
  if (!rotary_) out.refuse("model.nope_layers", fmt::format("layer {}", layer_), "every layer rotates");
  if (options_.window > 0)
    out.refuse("model.sliding_window", std::to_string(options_.window),
               "windowed attention is not exported yet (no verified mapping to a stock class)");
  const bool qwen3 = out.is("qwen3") || out.is("qwen3_moe"), qwen2 = out.is("qwen2");
  if (qk_norm != qwen3) out.refuse("model.qk_norm", qk_norm ? "true" : "false", "only Qwen3 has q/k norms");
  if (bias != qwen2)
    out.refuse("model.attention_bias", bias ? "true" : "false",
               bias ? "Qwen3's and Llama's attention_bias also biases o_proj" : "Qwen2 biases q, k and v");
  if (out.format() == ExportConfig::Format::gguf) {
    out.set("attention.head_count", hq_, "model.heads");
    out.set("attention.head_count_kv", hkv_, "model.kv_heads");
    out.set("attention.key_length", d_, "model.head_dim");
    out.set("attention.value_length", d_, "model.head_dim");
    return;
  }
  out.set("num_attention_heads", hq_, "model.heads");
  out.set("num_key_value_heads", hkv_, "model.kv_heads");
  out.set("head_dim", d_, "model.head_dim");
  out.set("attention_dropout", 0.0, "model.attention");
  if (!qwen2) out.set("attention_bias", false, "model.attention_bias");
  if (out.is("llama")) out.set("pretraining_tp", 1, "model.attention");
  if (qwen3 || qwen2) {
    out.set("use_sliding_window", false, "model.sliding_window");
    out.set("sliding_window", nullptr, "model.sliding_window");
    out.set_layer("layer_types", layer_, "full_attention");
  }
}

ops::QkvPrepare GqaAttention::prepare_at(const Tensor& positions) const {
  ops::QkvPrepare p = prepare_;
  if (rotary_) {
    const RotaryTables tables = position_.rotary();
    p.cos = tables.cos, p.sin = tables.sin;
  }
  p.positions = positions;
  return p;
}

ops::AttentionOptions GqaAttention::attention_options(const SeqInfo& seq) const {
  ops::AttentionOptions o = options_;
  o.max_seqlen = seq.max_seqlen;
  o.uniform = seq.uniform;
  return o;
}

void register_gqa_attention(AttentionRegistry& registry) {
  registry.add("gqa", "causal grouped-query attention over packed documents, optional q/k RMSNorm",
               [](BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position) {
                 return std::make_unique<GqaAttention>(ctx, layer, position);
               });
}

}  // namespace kiln
