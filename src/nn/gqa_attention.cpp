#include "nn/gqa_attention.h"

#include "nn/mup.h"
#include "ops/dropout/dropout_mask.h"
#include "ops/dyt/dyt.h"
#include "ops/gemma_rms_norm/gemma_rms_norm.h"
#include "ops/rope/rope.h"

#include <algorithm>
#include <cmath>

namespace kiln {

GqaAttention::GqaAttention(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position)
    : position_(position), exec_(ctx.exec), workspace_(ctx.workspace), losses_(ctx.losses) {
  const ModelConfig& m = *layer.model;
  const int64_t t = ctx.max_tokens;
  layer_ = layer.index, hidden_ = m.hidden, hq_ = m.heads, hkv_ = m.kv_heads, d_ = m.head_dim;
  rotary_ = layer.choices.rotary;
  qk_norm_ = m.qk_norm, bias_ = m.attention_bias;
  const int64_t q_cols = hq_ * d_, kv_cols = hkv_ * d_, qkv_cols = q_cols + 2 * kv_cols;
  const NameScope n = layer.names.child("attn.", "self_attn.", "");
  // llama.cpp pairs RoPE's dims otherwise than kiln where the family is "llama"
  // (interleaved) or the rotation partial (the first dims): its exporter reorders the q and
  // k rows of rotating layers, and their biases and norm gains with them.
  const GgufLayout rope_rows = rotary_ ? GgufLayout::rope_rows : GgufLayout::plain;
  const Tensor& qkv_master =
      qkv_proj_.declare_fused(ctx,
                              {{n("q_proj.weight", "q_proj.weight", "attn_q.weight", rope_rows), q_cols},
                               {n("k_proj.weight", "k_proj.weight", "attn_k.weight", rope_rows), kv_cols},
                               {n("v_proj.weight", "v_proj.weight", "attn_v.weight"), kv_cols}},
                              m.hidden, ParamRole::matrix, Init::normal(hidden_init_std(m)));
  if (m.attention_bias)
    qkv_proj_.declare_fused_bias(ctx,
                                 {{n("q_proj.bias", "q_proj.bias", "attn_q.bias", rope_rows), q_cols},
                                  {n("k_proj.bias", "k_proj.bias", "attn_k.bias", rope_rows), kv_cols},
                                  {n("v_proj.bias", "v_proj.bias", "attn_v.bias"), kv_cols}},
                                 ParamRole::bias, Init::zeros());
  // Output projection: scaled init keeps the residual stream's variance flat in depth.
  o_proj_.declare(ctx, n("o_proj.weight", "o_proj.weight", "attn_output.weight"), m.hidden, q_cols, ParamRole::matrix,
                  Init::normal(residual_init_std(m)));
  // Their backward reads the x their forward did (the block's normed input, the attention's
  // saved output): in FP8 each keeps its x's operand rather than quantizing x twice.
  qkv_proj_.keep_fp8_input(ctx);
  o_proj_.keep_fp8_input(ctx);
  options_.deterministic = ctx.deterministic;
  options_.window = layer.choices.window;
  options_.softcap = m.attention_softcap;
  options_.dropout.p = m.attention_dropout;  // drawn only where a batch's key is given (training)
  options_.dropout.site = dropout::attention_site(layer_);
  if (m.attention_sinks) {
    // On the GPU the sink-free kernels' output and lse are corrected for the sink
    // (ops/attention/attention_sinks_cuda.h); the decode kernels add it to their softmax.
    // Zero: at first the sink is one more key of logit 0 (GPT-OSS draws N(0, std) instead).
    ctx.parameter(options_.sinks, sinks_grad_, n("sinks", "sinks", "attn_sinks.weight"), Shape{hq_}, ParamRole::bias,
                  Init::zeros());
  }
  prepare_.q_heads = hq_, prepare_.kv_heads = hkv_, prepare_.head_dim = d_;
  if (m.qk_norm) {
    const ParamName q_w = n("q_norm.weight", "q_norm.weight", "attn_q_norm.weight", rope_rows);
    const ParamName k_w = n("k_norm.weight", "k_norm.weight", "attn_k_norm.weight", rope_rows);
    qk_kind_ = m.qk_norm_type == "gemma_rmsnorm" ? QkNormKind::gemma_rmsnorm
               : m.qk_norm_type == "dyt"         ? QkNormKind::dyt
                                                 : QkNormKind::rmsnorm;
    KILN_CHECK(qk_kind_ != QkNormKind::rmsnorm || m.qk_norm_type == "rmsnorm", "model.qk_norm_type",
               "unknown q/k norm '{}' (known: rmsnorm, gemma_rmsnorm, dyt)", m.qk_norm_type);
    switch (qk_kind_) {
      case QkNormKind::rmsnorm:
        ctx.parameter(prepare_.q_gain, q_gain_grad_, q_w, Shape{d_}, ParamRole::norm, Init::ones());
        ctx.parameter(prepare_.k_gain, k_gain_grad_, k_w, Shape{d_}, ParamRole::norm, Init::ones());
        break;
      case QkNormKind::gemma_rmsnorm:
        ctx.parameter(q_weight_, q_gain_grad_, q_w, Shape{d_}, ParamRole::norm, Init::zeros());
        ctx.parameter(k_weight_, k_gain_grad_, k_w, Shape{d_}, ParamRole::norm, Init::zeros());
        ctx.buffer(prepare_.q_gain, Shape{d_}, ctx.master_dtype);
        ctx.buffer(prepare_.k_gain, Shape{d_}, ctx.master_dtype);
        break;
      case QkNormKind::dyt:
        ctx.parameter(q_alpha_, q_alpha_grad_, n("q_norm.alpha", "q_norm.alpha", "attn_q_norm.alpha"), Shape{1},
                      ParamRole::norm, Init::constant(m.dyt_alpha));
        ctx.parameter(q_weight_, q_gain_grad_, q_w, Shape{d_}, ParamRole::norm, Init::ones());
        ctx.parameter(q_bias_, q_bias_grad_, n("q_norm.bias", "q_norm.bias", "attn_q_norm.bias"), Shape{d_},
                      ParamRole::bias, Init::zeros());
        ctx.parameter(k_alpha_, k_alpha_grad_, n("k_norm.alpha", "k_norm.alpha", "attn_k_norm.alpha"), Shape{1},
                      ParamRole::norm, Init::constant(m.dyt_alpha));
        ctx.parameter(k_weight_, k_gain_grad_, k_w, Shape{d_}, ParamRole::norm, Init::ones());
        ctx.parameter(k_bias_, k_bias_grad_, n("k_norm.bias", "k_norm.bias", "attn_k_norm.bias"), Shape{d_},
                      ParamRole::bias, Init::zeros());
        break;
    }
    prepare_.eps = m.norm_eps;
  }
  qkv_cols_ = qkv_cols;
  if (ctx.training && ctx.qk_clip_tau > 0) {
    // What sets the logits' scale: the projections' q and k rows, or under q/k norms
    // (which normalize those away) the norms' own weights.
    QkClipWeights w;
    w.qkv_master = &qkv_master;
    w.qkv_bias = bias_ ? &qkv_proj_.bias() : nullptr;
    if (qk_norm_) {
      switch (qk_kind_) {
        case QkNormKind::rmsnorm: w.q_gains = {&prepare_.q_gain}, w.k_gains = {&prepare_.k_gain}; break;
        case QkNormKind::gemma_rmsnorm:
          w.q_gains = {&q_weight_}, w.k_gains = {&k_weight_}, w.gain_offset = true;
          break;
        case QkNormKind::dyt: w.q_gains = {&q_weight_, &q_bias_}, w.k_gains = {&k_weight_, &k_bias_}; break;
      }
    }
    clip_ = std::make_unique<QkClip>(ctx, layer_, hq_, hkv_, d_, qk_norm_);
    clip_->set_weights(std::move(w));
  }
  ctx.saved(qkv_, Shape{t, qkv_cols});
  ctx.saved(o_, Shape{t, hq_, d_});
  ctx.saved_wide(lse_, Shape{t, hq_});
  // Scratch: forward takes q|k|v; backward takes d_o, q|k|v again, dq|dk|dv and dqkv. DyT's
  // q/k norm takes the split q|k besides, in both.
  const size_t parts = Workspace::footprint(ctx.dtype, Shape{t, q_cols}) +
                       2 * Workspace::footprint(ctx.dtype, Shape{t, kv_cols});
  const size_t raw_qk = dyt() ? Workspace::footprint(ctx.dtype, Shape{t, q_cols}) +
                                    Workspace::footprint(ctx.dtype, Shape{t, kv_cols})
                              : 0;
  ctx.workspace.reserve_peak(Workspace::footprint(ctx.dtype, Shape{t, q_cols}) + 2 * parts + raw_qk +
                             Workspace::footprint(ctx.dtype, Shape{t, qkv_cols}));
}

void GqaAttention::forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) {
  const int64_t t = x.size(0);
  Workspace::Scope scope(workspace_);
  Tensor qkv = qkv_.rows(0, t);
  qkv_proj_.forward(x, qkv);
  Tensor q = scope.take(qkv.dtype(), Shape{t, hq_, d_});
  Tensor k = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
  Tensor v = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
  const Tensor q_raw = dyt() ? scope.take(qkv.dtype(), q.shape()) : Tensor();
  const Tensor k_raw = dyt() ? scope.take(qkv.dtype(), k.shape()) : Tensor();
  prepare_qkv(qkv, seq.positions, q, k, v, q_raw, k_raw);
  if (clip_ && losses_->backward && !losses_->recomputing)  // a training forward, measured once
    clip_->measure(q, k, seq.cu_seqlens, attention_options(seq));
  Tensor o = o_.rows(0, t);
  ops::attention_forward(exec_, q, k, v, seq.cu_seqlens, attention_options(seq), o, lse_.rows(0, t));
  o_proj_.forward(o.view(Shape{t, hq_ * d_}), out);
}

void GqaAttention::backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) {
  const int64_t t = dout.size(0);
  Workspace::Scope scope(workspace_);
  Tensor d_o = scope.take(dout.dtype(), Shape{t, hq_, d_});
  Tensor o = o_.rows(0, t), qkv = qkv_.rows(0, t);
  o_proj_.backward(o.view(Shape{t, hq_ * d_}), dout, d_o.view(Shape{t, hq_ * d_}));
  // q, k, v exactly as forward computed them (same kernels, same input).
  Tensor q = scope.take(qkv.dtype(), Shape{t, hq_, d_});
  Tensor k = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
  Tensor v = scope.take(qkv.dtype(), Shape{t, hkv_, d_});
  const Tensor q_raw = dyt() ? scope.take(qkv.dtype(), q.shape()) : Tensor();
  const Tensor k_raw = dyt() ? scope.take(qkv.dtype(), k.shape()) : Tensor();
  prepare_qkv(qkv, seq.positions, q, k, v, q_raw, k_raw);
  Tensor dq = scope.take(dout.dtype(), Shape{t, hq_, d_});
  Tensor dk = scope.take(dout.dtype(), Shape{t, hkv_, d_});
  Tensor dv = scope.take(dout.dtype(), Shape{t, hkv_, d_});
  ops::attention_backward(exec_, q, k, v, o, lse_.rows(0, t), d_o, seq.cu_seqlens, attention_options(seq), dq, dk, dv,
                          sinks_grad_);
  Tensor dqkv = scope.take(dout.dtype(), Shape{t, qkv_cols_});
  if (!dyt()) {
    ops::qkv_prepare_backward(exec_, qkv, prepare_at(seq.positions), dq, dk, dv, dqkv, q_gain_grad_, k_gain_grad_);
  } else {
    // Back through RoPE (the transposed rotation), then DyT into q and k's buffers (free now),
    // then the split.
    if (rotary_) {
      const RotaryTables tables = position_.rotary();
      ops::rope_apply(exec_, dq, seq.positions, tables.cos, tables.sin, true);
      ops::rope_apply(exec_, dk, seq.positions, tables.cos, tables.sin, true);
    }
    ops::dyt_backward(exec_, q_raw.view(Shape{t * hq_, d_}), q_alpha_, q_weight_, dq.view(Shape{t * hq_, d_}),
                      q.view(Shape{t * hq_, d_}), q_alpha_grad_, q_gain_grad_, q_bias_grad_);
    ops::dyt_backward(exec_, k_raw.view(Shape{t * hkv_, d_}), k_alpha_, k_weight_, dk.view(Shape{t * hkv_, d_}),
                      k.view(Shape{t * hkv_, d_}), k_alpha_grad_, k_gain_grad_, k_bias_grad_);
    ops::QkvPrepare split = prepare_;
    split.positions = seq.positions;
    ops::qkv_prepare_backward(exec_, qkv, split, q, k, dv, dqkv, Tensor(), Tensor());
  }
  qkv_proj_.backward(x, dqkv, dx);
}

void GqaAttention::after_step(bool applied) {
  if (clip_) clip_->after_step(applied);
}

void GqaAttention::report(std::vector<std::pair<std::string, double>>& out) const {
  if (clip_) clip_->report(out);
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
// Llama has neither (its attention_bias would bias o_proj too). Gemma 2 has neither q/k norms
// nor biases but softcaps; Gemma 3 has Gemma's q/k norms (gain 1 + w) and may softcap too.
// None has NoPE layers. Windowed layers: Qwen2, Qwen3, Dots1 and Gemma 2/3 name each layer's
// kind in layer_types ("sliding_attention" with the one sliding_window, or "full_attention");
// Qwen3-MoE windows every layer or none; Llama and llama.cpp's architectures have no windows.
void GqaAttention::export_config(ExportConfig& out) const {
  const bool qk_norm = qk_norm_, bias = bias_;
  const bool hf = out.format() == ExportConfig::Format::hf;
  const bool gemma = out.gemma(), gemma3 = out.is("gemma3_text");
  if (options_.softcap > 0 && !gemma)
    out.refuse("model.attention_softcap", fmt::format("{}", options_.softcap), "no softcap");
  // transformers' GptOssForCausalLM and llama.cpp's gpt-oss carry sinks, but kiln exports
  // no GPT-OSS family (its MoE, biases and alternating windows are another model).
  if (options_.sinks.defined())
    out.refuse("model.attention_sinks", "true",
               out.format() == ExportConfig::Format::gguf ? "kiln's GGUF architectures have no attention sinks"
                                                          : "no attention sinks in this architecture");
  if (!rotary_) out.refuse("model.nope_layers", fmt::format("layer {}", layer_), "every layer rotates");
  const bool windowed_family =
      gemma || (hf && (out.is("qwen2") || out.is("qwen3") || out.is("qwen3_moe") || out.is("dots1")));
  if (options_.window > 0 && !windowed_family)
    out.refuse("model.sliding_window", std::to_string(options_.window),
               out.format() == ExportConfig::Format::gguf ? "llama.cpp's architecture has no sliding window"
                                                          : "no sliding window in this architecture");
  // Qwen3's attention: also Qwen3-MoE's and Dots1's; Gemma 3's with its own norm kind.
  const bool qwen3 = out.is("qwen3") || out.is("qwen3_moe") || out.is("dots1"), qwen2 = out.is("qwen2");
  if (qk_norm != (qwen3 || gemma3))
    out.refuse("model.qk_norm", qk_norm ? "true" : "false", "only Qwen3 and Gemma 3 have q/k norms");
  const QkNormKind family_kind = gemma3 ? QkNormKind::gemma_rmsnorm : QkNormKind::rmsnorm;
  if (qk_norm && qk_kind_ != family_kind)
    out.refuse("model.qk_norm_type",
               fmt::format("'{}'", qk_kind_ == QkNormKind::dyt             ? "dyt"
                                   : qk_kind_ == QkNormKind::gemma_rmsnorm ? "gemma_rmsnorm"
                                                                           : "rmsnorm"),
               gemma3 ? "Gemma 3's q/k norms have the gain 1 + w (gemma_rmsnorm)"
                      : "Qwen3's q/k norms are RMSNorm with a plain gain");
  if (bias != qwen2)
    out.refuse("model.attention_bias", bias ? "true" : "false",
               bias ? "Qwen3's, Llama's and Gemma's attention_bias also biases o_proj" : "Qwen2 biases q, k and v");
  if (out.format() == ExportConfig::Format::gguf) {
    if (out.is("dots1") && hkv_ != hq_)  // llama_model_dots1::load_arch_tensors: k, v of n_head heads
      out.refuse("model.kv_heads", std::to_string(hkv_),
                 fmt::format("llama.cpp's dots1 reads k and v with as many heads as q ({}): no grouped-query "
                             "attention",
                             hq_));
    out.set("attention.head_count", hq_, "model.heads");
    out.set("attention.head_count_kv", hkv_, "model.kv_heads");
    out.set("attention.key_length", d_, "model.head_dim");
    out.set("attention.value_length", d_, "model.head_dim");
    if (gemma) export_gemma_gguf(out);
    return;
  }
  out.set("num_attention_heads", hq_, "model.heads");
  out.set("num_key_value_heads", hkv_, "model.kv_heads");
  out.set("head_dim", d_, "model.head_dim");
  out.set("attention_dropout", options_.dropout.p, "model.attention_dropout");
  if (!qwen2) out.set("attention_bias", false, "model.attention_bias");
  if (out.is("llama")) out.set("pretraining_tp", 1, "model.attention");
  if (gemma3 && options_.softcap > 0)  // Gemma3Attention keeps the key but never passes it on
    out.refuse("model.attention_softcap", fmt::format("{}", options_.softcap),
               "transformers' Gemma3ForCausalLM does not apply attn_logit_softcapping (Gemma 2 does)");
  if (gemma) {
    // Gemma scales q.k by query_pre_attn_scalar^-0.5, kiln by head_dim^-0.5; transformers'
    // Gemma2Config defaults both softcaps on (50, 30), so "off" is written as null.
    out.set("query_pre_attn_scalar", d_, "model.head_dim");
    out.set("attn_logit_softcapping", options_.softcap > 0 ? nlohmann::json(options_.softcap) : nlohmann::json(nullptr),
            "model.attention_softcap");
    if (options_.window > 0) out.set("sliding_window", options_.window, "model.sliding_window");
    out.set_layer("layer_types", layer_, options_.window > 0 ? "sliding_attention" : "full_attention");
  } else if (out.is("qwen3_moe")) {  // one setting for every layer: a mixed model is refused here
    out.set("use_sliding_window", options_.window > 0, "model.full_attention_layers");
    out.set("sliding_window", options_.window > 0 ? nlohmann::json(options_.window) : nlohmann::json(nullptr),
            "model.full_attention_layers");
  } else if (qwen3 || qwen2) {
    // A full layer leaves use_sliding_window and sliding_window to the windowed ones (the
    // export writes false and null when there are none).
    if (options_.window > 0) {
      out.set("use_sliding_window", true, "model.sliding_window");
      out.set("sliding_window", options_.window, "model.sliding_window");
    }
    out.set_layer("layer_types", layer_, options_.window > 0 ? "sliding_attention" : "full_attention");
  }
}

// llama.cpp's gemma2/gemma3 (src/models/gemma2.cpp, gemma3.cpp): q scaled by 1/sqrt(head_dim)
// as kiln's, except at the layer counts of Gemma 2 27B (46) and Gemma 3 27B (62), where it is
// 1/sqrt(hidden / heads); gemma2 caps every score (tanh(x / cap) * cap, so a cap of 0 divides
// by zero), gemma3 none. Windows: one sliding_window and a per-layer pattern (true = sliding;
// load_swa_pattern reads the array before any default), so any interleave is written as it is.
void GqaAttention::export_gemma_gguf(ExportConfig& out) const {
  const bool gemma3 = out.is("gemma3_text");
  if (out.layers() == (gemma3 ? 62 : 46) && hidden_ / hq_ != d_)
    out.refuse("model.head_dim", std::to_string(d_),
               fmt::format("llama.cpp's {} scales q by 1/sqrt(hidden / heads) = 1/sqrt({}) at {} layers (its 27B), "
                           "kiln by 1/sqrt(head_dim)",
                           gemma3 ? "gemma3" : "gemma2", hidden_ / hq_, out.layers()));
  if (gemma3 && options_.softcap > 0)
    out.refuse("model.attention_softcap", fmt::format("{}", options_.softcap),
               "llama.cpp's gemma3 does not softcap the attention scores");
  if (!gemma3 && options_.softcap <= 0)
    out.refuse("model.attention_softcap", "0", "llama.cpp's gemma2 always softcaps the attention scores (set a cap)");
  if (!gemma3) out.set("attn_logit_softcapping", static_cast<float>(options_.softcap), "model.attention_softcap");
  if (options_.window > 0) out.set("attention.sliding_window", options_.window, "model.sliding_window");
  out.set_layer("attention.sliding_window_pattern", layer_, options_.window > 0);
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

void GqaAttention::form_gemma_gains() const {
  if (qk_kind_ != QkNormKind::gemma_rmsnorm) return;
  ops::gemma_gain(exec_, q_weight_, prepare_.q_gain);
  ops::gemma_gain(exec_, k_weight_, prepare_.k_gain);
}

void GqaAttention::prepare_qkv(const Tensor& qkv, const Tensor& positions, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& q_raw, const Tensor& k_raw) const {
  form_gemma_gains();
  if (!dyt()) return ops::qkv_prepare_forward(exec_, qkv, prepare_at(positions), q, k, v);
  ops::QkvPrepare split = prepare_;  // no gains: the op only splits
  split.positions = positions;
  ops::qkv_prepare_forward(exec_, qkv, split, q_raw, k_raw, v);
  const int64_t n = qkv.size(0);
  ops::dyt_forward(exec_, q_raw.view(Shape{n * hq_, d_}), q_alpha_, q_weight_, q_bias_, q.view(Shape{n * hq_, d_}));
  ops::dyt_forward(exec_, k_raw.view(Shape{n * hkv_, d_}), k_alpha_, k_weight_, k_bias_, k.view(Shape{n * hkv_, d_}));
  if (!rotary_) return;
  const RotaryTables tables = position_.rotary();
  ops::rope_apply(exec_, q, positions, tables.cos, tables.sin, false);
  ops::rope_apply(exec_, k, positions, tables.cos, tables.sin, false);
}

ops::AttentionOptions GqaAttention::attention_options(const SeqInfo& seq) const {
  ops::AttentionOptions o = options_;
  o.max_seqlen = seq.max_seqlen;
  o.uniform = seq.uniform;
  o.dropout.key = seq.dropout_key;  // defined only for a batch that runs a backward
  return o;
}

void register_gqa_attention(MixerRegistry& registry) {
  registry.add("gqa", "causal grouped-query attention over packed documents, optional q/k norm (model.qk_norm_type)",
               [](BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position) {
                 return std::make_unique<GqaAttention>(ctx, layer, position);
               });
}

}  // namespace kiln
