#include "nn/kda_mixer.h"

#include "nn/mup.h"
#include "ops/kda/kda.h"
#include "ops/kda/kda_gate.h"
#include "ops/kda/kda_mixer_ops.h"
#include "ops/short_conv/short_conv.h"

#include <cmath>

namespace kiln {

std::string kda_gpu_kernel(const std::string& setting, int64_t dk) {
  if (setting != "auto") return setting;
  return dk <= ops::kda_chunked_max_dk() ? "chunked_bf16" : "recurrent";
}

KdaMixer::KdaMixer(BuildContext& ctx, const LayerSpec& layer)
    : exec_(ctx.exec), workspace_(ctx.workspace), key_(mixer_key(layer)), cuda_(ctx.device == Device::cuda) {
  const ModelConfig& m = *layer.model;
  const KdaConfig& c = m.kda;
  hidden_ = m.hidden, h_ = c.heads > 0 ? c.heads : m.heads;
  dk_ = dv_ = c.head_dim > 0 ? c.head_dim : m.head_dim;
  rank_ = c.gate_rank > 0 ? c.gate_rank : dk_;
  kernel_ = c.conv_kernel, norm_eps_ = m.norm_eps;
  const std::string gpu_kernel = kda_gpu_kernel(c.gpu_kernel, dk_);
  chunked_gpu_ = cuda_ && (gpu_kernel == "chunked" || gpu_kernel == "chunked_bf16");
  bf16_grads_ = chunked_gpu_ && gpu_kernel == "chunked_bf16";
  conv_kernel_ = c.conv_gpu_kernel == "sweep" ? ops::ShortConvGpuKernel::sweep : ops::ShortConvGpuKernel::per_element;
  KILN_CHECK(!chunked_gpu_ || dk_ <= ops::kda_chunked_max_dk(), "model.kda.gpu_kernel",
             "= '{}' takes a head_dim up to {}, got {} (use 'recurrent' or 'auto')", c.gpu_kernel,
             ops::kda_chunked_max_dk(), dk_);
  // Decode keeps the last kernel - 1 inputs: a kernel of 1 would keep none (and mix nothing).
  KILN_CHECK(kernel_ >= 2, "model.kda.conv_kernel", "= {}: the short convolution needs at least 2 taps", kernel_);
  KILN_CHECK(!cuda_ || conv_kernel_ != ops::ShortConvGpuKernel::sweep || kernel_ <= 8, "model.kda.conv_gpu_kernel",
             "= 'sweep' keeps up to 8 taps in registers; model.kda.conv_kernel is {}", kernel_);
  const int64_t kc = h_ * dk_, vc = h_ * dv_, t = ctx.max_tokens;
  qkv_cols_ = 2 * kc + vc;
  // Kimi Linear's tensor names (self_attn.q_conv1d, f_a_proj, ...); llama.cpp has none.
  const NameScope n = layer.names.child("kda.", "self_attn.", "");
  const Init hidden_init = Init::normal(hidden_init_std(m));
  qkv_proj_.declare_fused(ctx,
                          {{n("q_proj.weight", "q_proj.weight", ""), kc},
                           {n("k_proj.weight", "k_proj.weight", ""), kc},
                           {n("v_proj.weight", "v_proj.weight", ""), vc}},
                          hidden_, ParamRole::matrix, hidden_init);
  // PyTorch's Conv1d init (kaiming uniform, fan_in = kernel for a depthwise filter), as FLA's.
  ctx.fused_parameter(conv_w_, conv_g_,
                      {{n("q_conv1d.weight", "q_conv1d.weight", ""), kc},
                       {n("k_conv1d.weight", "k_conv1d.weight", ""), kc},
                       {n("v_conv1d.weight", "v_conv1d.weight", ""), vc}},
                      kernel_, ParamRole::matrix, Init::uniform(1.0 / std::sqrt(static_cast<double>(kernel_))));
  f_a_proj_.declare(ctx, n("f_a_proj.weight", "f_a_proj.weight", ""), rank_, hidden_, ParamRole::matrix, hidden_init);
  f_b_proj_.declare(ctx, n("f_b_proj.weight", "f_b_proj.weight", ""), kc, rank_, ParamRole::matrix, hidden_init);
  b_proj_.declare(ctx, n("b_proj.weight", "b_proj.weight", ""), h_, hidden_, ParamRole::matrix, hidden_init);
  // Each head's time scale exp(A_log) in [1, 16] and each channel's dt in [0.001, 0.1]
  // (Mamba's and FLA's init); neither decays (ParamRole::bias, as FLA's _no_weight_decay).
  ctx.parameter(a_log_, a_log_g_, n("A_log", "A_log", ""), Shape{h_}, ParamRole::bias, Init::log_uniform(1, 16));
  ctx.parameter(dt_bias_, dt_bias_g_, n("dt_bias", "dt_bias", ""), Shape{kc}, ParamRole::bias,
                Init::inverse_softplus_log_uniform(0.001, 0.1));
  g_a_proj_.declare(ctx, n("g_a_proj.weight", "g_a_proj.weight", ""), rank_, hidden_, ParamRole::matrix, hidden_init);
  g_b_proj_.declare(ctx, n("g_b_proj.weight", "g_b_proj.weight", ""), vc, rank_, ParamRole::matrix, hidden_init);
  // The output gate's one bias, as Kimi Linear's g_proj (zero: sigmoid 1/2 at first).
  g_b_proj_.declare_bias(ctx, n("g_b_proj.bias", "g_b_proj.bias", ""), ParamRole::bias, Init::zeros());
  ctx.parameter(gain_, gain_g_, n("o_norm.weight", "o_norm.weight", ""), Shape{dv_}, ParamRole::norm, Init::ones());
  // The residual writer: scaled init keeps the residual stream's variance flat in depth.
  o_proj_.declare(ctx, n("o_proj.weight", "o_proj.weight", ""), hidden_, vc, ParamRole::matrix,
                  Init::normal(residual_init_std(m)));
  // q|k|v before the convolution only: backward recomputes its output into the workspace
  // (3 H d columns a token fewer to keep per layer; the same kernel on the same input).
  ctx.saved(qkv_raw_, Shape{t, qkv_cols_});
  ctx.saved(fa_, Shape{t, rank_});
  ctx.saved(graw_, Shape{t, kc});
  ctx.saved(braw_, Shape{t, h_});
  ctx.saved(o_, Shape{t, h_, dv_});
  ctx.saved(ga_, Shape{t, rank_});
  ctx.saved(gpre_, Shape{t, vc});
  // Backward's peak: d(gated output), d_o, dgpre, q, k, v, g, beta and their gradients, the
  // gate's input gradient, the convolution's recomputed output (whose buffer then takes its
  // input gradient) and output gradient (every piece at once, a bound; forward's q|k|v
  // after the convolution, q, k, v, g, beta and gated output fit inside it).
  auto bytes = [&](int64_t cols) { return Workspace::footprint(ctx.dtype, Shape{t, cols}); };
  // On the GPU the delta rule's f32 workspace too (the recurrent backward's, or the chunked
  // kernels' in both directions): it holds tiles per document and per 64 tokens, so it is
  // planned for one document per kTokensPerDoc tokens.
  int64_t delta_rule = 0;
  if (cuda_ && (ctx.training || chunked_gpu_)) {
    max_docs_ = t / kTokensPerDoc + 1;
    const int64_t elems = chunked_gpu_ ? ops::kda_chunked_workspace(t, h_, dk_, dv_, max_docs_)
                                       : ops::kda_backward_workspace(t, h_, dk_, dv_, max_docs_);
    delta_rule = Workspace::footprint(DType::f32, Shape{elems});
  }
  ctx.workspace.reserve_peak(6 * bytes(vc) + 7 * bytes(kc) + 3 * bytes(h_) + bytes(rank_) + 2 * bytes(qkv_cols_) +
                             delta_rule);
}

void KdaMixer::gate(const Tensor& graw, const Tensor& g) const {
  ops::kda_gate_forward(exec_, graw.view(Shape{graw.size(0), h_, dk_}), a_log_, dt_bias_2d(), g);
}

Tensor KdaMixer::delta_rule_workspace(Workspace::Scope& scope, const SeqInfo& seq, int64_t tokens,
                                      bool backward) const {
  if (!cuda_ || !(chunked_gpu_ || backward)) return Tensor();
  const int64_t docs = seq.cu_seqlens.size(0) - 1;
  KILN_CHECK(docs <= max_docs_, key_, "'kda' on the GPU plans its workspace for at most {} documents in {} tokens, got {}",
             max_docs_, qkv_raw_.size(0), docs);
  const int64_t elems = chunked_gpu_ ? ops::kda_chunked_workspace(tokens, h_, dk_, dv_, docs)
                                     : ops::kda_backward_workspace(tokens, h_, dk_, dv_, docs);
  return scope.take(DType::f32, Shape{elems});
}

void KdaMixer::forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) {
  const int64_t t = x.size(0);
  Workspace::Scope scope(workspace_);
  const DType dt = x.dtype();
  const Tensor qkv_raw = qkv_raw_.rows(0, t), fa = fa_.rows(0, t);
  const Tensor graw = graw_.rows(0, t), braw = braw_.rows(0, t), o = o_.rows(0, t), ga = ga_.rows(0, t);
  const Tensor gpre = gpre_.rows(0, t);
  qkv_proj_.forward(x, qkv_raw);
  const Tensor qkv_act = scope.take(dt, Shape{t, qkv_cols_});
  ops::short_conv_forward(exec_, qkv_raw, conv_w_, seq.cu_seqlens, qkv_act, conv_kernel_);
  const Tensor q = scope.take(dt, Shape{t, h_, dk_}), k = scope.take(dt, Shape{t, h_, dk_});
  const Tensor v = scope.take(dt, Shape{t, h_, dv_}), g = scope.take(dt, Shape{t, h_, dk_});
  const Tensor beta = scope.take(dt, Shape{t, h_});
  ops::kda_split_norm_forward(exec_, qkv_act, q, k, v);
  f_a_proj_.forward(x, fa);
  f_b_proj_.forward(fa, graw);
  gate(graw, g);
  b_proj_.forward(x, braw);
  ops::kda_beta_forward(exec_, braw, beta);
  // The delta rule: chunked on the CPU, on the GPU as model.kda.gpu_kernel says.
  if (cuda_ && !chunked_gpu_)
    ops::kda_recurrent_forward(exec_, q, k, v, g, beta, seq.cu_seqlens, Tensor(), {}, o);
  else
    ops::kda_chunked_forward(exec_, q, k, v, g, beta, seq.cu_seqlens, Tensor(), {}, o, Tensor(),
                             delta_rule_workspace(scope, seq, t, false));
  g_a_proj_.forward(x, ga);
  g_b_proj_.forward(ga, gpre);
  const Tensor y = scope.take(dt, Shape{t, h_ * dv_});
  ops::kda_output_gate_forward(exec_, o, gain_, gpre, norm_eps_, y);
  o_proj_.forward(y, out);
}

void KdaMixer::backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) {
  const int64_t t = dout.size(0);
  Workspace::Scope scope(workspace_);
  const DType dt = dout.dtype();
  const Tensor qkv_raw = qkv_raw_.rows(0, t), fa = fa_.rows(0, t);
  const Tensor graw = graw_.rows(0, t), braw = braw_.rows(0, t), o = o_.rows(0, t), ga = ga_.rows(0, t);
  const Tensor gpre = gpre_.rows(0, t);
  // Output side: Wo, then the gated norm, then the output gate's low-rank pair.
  const Tensor y = scope.take(dt, Shape{t, h_ * dv_}), dy = scope.take(dt, Shape{t, h_ * dv_});
  ops::kda_output_gate_forward(exec_, o, gain_, gpre, norm_eps_, y);
  o_proj_.backward(y, dout, dy);
  const Tensor d_o = scope.take(dt, Shape{t, h_, dv_}), dgpre = scope.take(dt, Shape{t, h_ * dv_});
  ops::kda_output_gate_backward(exec_, o, gain_, gpre, norm_eps_, dy, d_o, dgpre, gain_g_);
  const Tensor dlow = scope.take(dt, Shape{t, rank_});
  g_b_proj_.backward(ga, dgpre, dlow);
  g_a_proj_.backward(x, dlow, dx);
  // The delta rule, its inputs rebuilt from what forward saved: q|k|v after the convolution
  // and SiLU too, by forward's kernel on forward's input (the same bytes), on exec_ as all
  // the rest (inside a captured step's graph too).
  const Tensor qkv_act = scope.take(dt, Shape{t, qkv_cols_});
  ops::short_conv_forward(exec_, qkv_raw, conv_w_, seq.cu_seqlens, qkv_act, conv_kernel_);
  const Tensor q = scope.take(dt, Shape{t, h_, dk_}), k = scope.take(dt, Shape{t, h_, dk_});
  const Tensor v = scope.take(dt, Shape{t, h_, dv_}), g = scope.take(dt, Shape{t, h_, dk_});
  const Tensor beta = scope.take(dt, Shape{t, h_});
  ops::kda_split_norm_forward(exec_, qkv_act, q, k, v);
  gate(graw, g);
  ops::kda_beta_forward(exec_, braw, beta);
  const Tensor dq = scope.take(dt, q.shape()), dk = scope.take(dt, k.shape()), dv = scope.take(dt, v.shape());
  const Tensor dg = scope.take(dt, g.shape()), dbeta = scope.take(dt, beta.shape());
  const Tensor work = delta_rule_workspace(scope, seq, t, true);
  if (cuda_ && !chunked_gpu_)
    ops::kda_recurrent_backward(exec_, q, k, v, g, beta, seq.cu_seqlens, Tensor(), d_o, Tensor(), {}, dq, dk, dv, dg,
                                dbeta, Tensor(), work);
  else
    ops::kda_chunked_backward(exec_, q, k, v, g, beta, seq.cu_seqlens, Tensor(), d_o, Tensor(),
                              ops::KdaOptions{.gpu_bf16_grads = bf16_grads_}, dq, dk, dv, dg, dbeta, Tensor(), work);
  // The decay gate: through softplus into its low-rank pair.
  const Tensor dgraw = scope.take(dt, Shape{t, h_ * dk_});
  ops::kda_gate_backward(exec_, graw.view(Shape{t, h_, dk_}), a_log_, dt_bias_2d(), dg,
                         dgraw.view(Shape{t, h_, dk_}), a_log_g_, dt_bias_g_.view(Shape{h_, dk_}));
  f_b_proj_.backward(fa, dgraw, dlow);
  f_a_proj_.backward(x, dlow, dx, true);
  const Tensor dbraw = scope.take(dt, Shape{t, h_});
  ops::kda_beta_backward(exec_, braw, dbeta, dbraw);
  b_proj_.backward(x, dbraw, dx, true);
  // q, k, v: the per-head norm, the convolution and SiLU, the projection.
  const Tensor dact = scope.take(dt, Shape{t, qkv_cols_});
  ops::kda_split_norm_backward(exec_, qkv_act, dq, dk, dv, dact);
  const Tensor draw = qkv_act;  // read for the last time above: its buffer takes d(q|k|v raw)
  ops::short_conv_backward(exec_, qkv_raw, conv_w_, seq.cu_seqlens, dact, draw, conv_g_, conv_kernel_);
  qkv_proj_.backward(x, draw, dx, true);
}

// Per token and head the recurrence decays S, reads k^T S, writes the rank-one update and
// reads S^T q: about 4 x 2 d_k d_v FLOPs; the convolution 2 x kernel per channel.
double KdaMixer::extra_forward_flops_per_token(int64_t seq_len) const {
  (void)seq_len;  // linear in the sequence: no term grows with it
  return 8.0 * static_cast<double>(h_ * dk_ * dv_) + 2.0 * static_cast<double>(kernel_ * qkv_cols_);
}

void KdaMixer::export_config(ExportConfig& out) const {
  out.refuse(key_, "'kda'",
             out.format() == ExportConfig::Format::gguf
                 ? "llama.cpp's architectures kiln writes have no KDA layer"
                 : "no stock transformers class computes KDA (Kimi Linear's checkpoints need remote code)");
}

void register_kda_mixer(MixerRegistry& registry) {
  registry.add("kda",
               "Kimi Delta Attention: gated delta rule with a fixed-size state, short conv, low-rank gates ([model.kda]; "
               "decode keeps the state per slot)",
               [](BuildContext& ctx, const LayerSpec& layer, PositionEncoding&) {
                 return std::make_unique<KdaMixer>(ctx, layer);
               });
}

}  // namespace kiln
