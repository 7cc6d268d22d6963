// Gated MLPs: down(act(gate(x)) * up(x)), as transformers' Qwen3MLP / LlamaMLP / GemmaMLP.
// Registry names "swiglu" (act = silu) and "geglu" (act = tanh-approximate GELU, hidden_act
// "gelu_pytorch_tanh"). gate and up share one fused [2F, hidden] weight (one GEMM) while
// keeping their own names. Only gate|up is saved: backward rebuilds the activation (for the
// down projection's weight gradient) in the same pass that differentiates it.
//
// Decode: the same ops over the step's rows; for the captured decode steps on the GPU, a
// SwiGLU branch runs whole on the fused projections (the pre-norm and SwiGLU folded into the
// gate|up product, the residual add into the down product).
#include "core/op_profiler.h"
#include "nn/modules.h"
#include "nn/mup.h"
#include "ops/geglu/geglu.h"
#include "nn/linear_layer.h"
#include "ops/swiglu/swiglu.h"

#if KILN_WITH_CUDA
#include "ops/decode/decode_kernels.h"
#endif

#include <algorithm>
#include <cmath>

namespace kiln {

namespace {

// An activation of the gated form: its ops, its name in Hugging Face configs, and whether the
// fused decode projections compute it.
struct GatedActivation {
  // `amax`: where the op leaves max |output| (f32 [1]), given only when reports_amax.
  void (*forward)(const ExecContext& ctx, const Tensor& gate_up, const Tensor& out, const Tensor& amax);
  void (*backward)(const ExecContext& ctx, const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up,
                   const Tensor& out, const Tensor& amax);
  const char* hf_act;       // config.json's hidden_act
  bool llama_cpp;           // llama.cpp's llama/qwen2/qwen3 graphs compute it (they hard-code silu;
                            // its gemma2/gemma3 hard-code GELU: the other one)
  bool fused_decode;        // ops/decode's norm_gemv_swiglu computes it
  bool reports_amax;        // its ops write max |output| for an FP8 projection's quantize
};

constexpr GatedActivation kSwiglu{ops::swiglu_forward, ops::swiglu_backward, "silu", true, true, true};
constexpr GatedActivation kGeglu{
    [](const ExecContext& ctx, const Tensor& gate_up, const Tensor& out, const Tensor&) {
      ops::geglu_forward(ctx, gate_up, out);
    },
    [](const ExecContext& ctx, const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up, const Tensor& out,
       const Tensor&) { ops::geglu_backward(ctx, gate_up, dout, dgate_up, out); },
    "gelu_pytorch_tanh", false, false, false};

class GatedDecoder final : public BranchDecoder {
 public:
  GatedDecoder(const GatedActivation& act, const LinearLayer& gate_up, const LinearLayer& down, DecodeContext& ctx,
               const Norm& pre_norm)
      : act_(act), gate_up_proj_(gate_up), down_proj_(down), exec_(ctx.exec), workspace_(ctx.workspace),
        dtype_(ctx.dtype) {
    const int64_t r = ctx.max_rows, f = down.in_features();
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.dtype, Shape{r, 2 * f}) +
                               Workspace::footprint(ctx.dtype, Shape{r, f}));
#if KILN_WITH_CUDA
    const std::optional<RmsNormForm> norm = pre_norm.rms_form();
    const int64_t rows = std::min<int64_t>(ctx.fused_branch_rows, r);
    fused_branch_ = act.fused_decode && ctx.device == Device::cuda && ctx.fuse && rows > 0 && dtype_ == DType::bf16 && norm &&
                    cuda::decode_gemv_fits(rows, down.out_features()) && cuda::decode_gemv_fits(rows, f);
    if (fused_branch_) norm_ = *norm;
#else
    (void)pre_norm;
#endif
  }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    const int64_t n = rows.count, f = down_proj_.in_features();
    Workspace::Scope scope(workspace_);
    const Tensor gate_up = scope.take(dtype_, Shape{n, 2 * f}), act = scope.take(dtype_, Shape{n, f});
    gate_up_proj_.forward(exec_, h, gate_up);
    act_.forward(exec_, gate_up, act, Tensor());
    down_proj_.forward(exec_, act, out);
  }

  bool fused_branch() const override { return fused_branch_; }

  void forward_fused([[maybe_unused]] const Tensor& x, [[maybe_unused]] const DecodeRows& rows) override {
#if KILN_WITH_CUDA
    const int64_t n = rows.count, d = down_proj_.out_features(), f = down_proj_.in_features();
    Workspace::Scope scope(workspace_);
    const Tensor act = scope.take(dtype_, Shape{n, f});
    {
      OpScope op("norm + gate|up + swiglu (fused)", Device::cuda);
      cuda::norm_gemv_swiglu(exec_, x.data<float>(), norm_.gain.data<float>(), static_cast<float>(norm_.eps), n, d,
                             gate_up_proj_.weight().raw(), f, act.raw());
    }
    OpScope op("down projection + residual (fused)", Device::cuda);
    cuda::gemv_add_residual(exec_, act.raw(), n, f, down_proj_.weight().raw(), d, x.data<float>());
#endif
  }

 private:
  const GatedActivation& act_;
  LinearLayer gate_up_proj_, down_proj_;  // [2F, hidden], [hidden, F] (the module's)
  const ExecContext& exec_;
  Workspace& workspace_;
  DType dtype_;
  bool fused_branch_ = false;
  RmsNormForm norm_;
};

class GatedMlp final : public Mlp {
 public:
  GatedMlp(BuildContext& ctx, const LayerSpec& layer, const GatedActivation& act, const char* key)
      : act_(act), key_(key), layer_(layer.index), exec_(ctx.exec), workspace_(ctx.workspace) {
    const ModelConfig& m = *layer.model;
    const int64_t t = ctx.max_tokens, f = m.ffn_hidden;
    const NameScope n = layer.names.child("mlp.", "mlp.", "");
    gate_up_proj_.declare_fused(ctx,
                                {{n("gate_proj.weight", "gate_proj.weight", "ffn_gate.weight"), f},
                                 {n("up_proj.weight", "up_proj.weight", "ffn_up.weight"), f}},
                                m.hidden, ParamRole::matrix, Init::normal(hidden_init_std(m)));
    down_proj_.declare(ctx, n("down_proj.weight", "down_proj.weight", "ffn_down.weight"), m.hidden, f,
                       ParamRole::matrix, Init::normal(residual_init_std(m)));
    // In FP8 both keep x's operand: backward gets gate_up's x again, and down's weight
    // gradient would otherwise quantize the rebuilt activation the forward quantized.
    gate_up_proj_.keep_fp8_input(ctx);
    down_proj_.keep_fp8_input(ctx);
    ctx.saved(gate_up_, Shape{t, 2 * f});
    // Forward scratch: the activation [t, f]. Backward: d(act) [t, f] (then the activation
    // again, in place) and d(gate_up) [t, 2f]. Either: an amax for an FP8 projection.
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.dtype, Shape{t, f}) +
                               Workspace::footprint(ctx.dtype, Shape{t, 2 * f}) +
                               Workspace::footprint(DType::f32, Shape{1}));
  }

  void forward(const Tensor& x, const Tensor& out) override {
    const int64_t t = x.size(0);
    Workspace::Scope scope(workspace_);
    Tensor gate_up = gate_up_.rows(0, t), act = scope.take(gate_up.dtype(), Shape{t, gate_up.size(1) / 2});
    const Tensor act_amax = amax_for(down_proj_, scope);
    gate_up_proj_.forward(x, gate_up);
    act_.forward(exec_, gate_up, act, act_amax);
    down_proj_.forward(act, out, act_amax);
  }

  void backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    const int64_t t = dout.size(0);
    Workspace::Scope scope(workspace_);
    const Tensor gate_up = gate_up_.rows(0, t);
    Tensor dact = scope.take(dout.dtype(), Shape{t, gate_up.size(1) / 2});
    Tensor dgate_up = scope.take(dout.dtype(), gate_up.shape());
    const Tensor dgate_up_amax = amax_for(gate_up_proj_, scope);
    if (down_proj_.weight_grad_reads_x(t)) {
      // d(act) = dout Wdown (x is only read for a weight gradient: none is asked here); then
      // dact is overwritten by the activation itself, which the weight gradient reads.
      down_proj_.backward_input(dout, dact);
      act_.backward(exec_, gate_up, dact, dgate_up, dact, dgate_up_amax);
      down_proj_.backward_weight(dact, dout);
    } else {
      // The weight gradient reads the activation's FP8 operand kept from the forward: one
      // call, dy quantized once, and the activation is not rebuilt.
      down_proj_.backward(dact, dout, dact);
      act_.backward(exec_, gate_up, dact, dgate_up, Tensor(), dgate_up_amax);
    }
    gate_up_proj_.backward(x, dgate_up, dx, false, dgate_up_amax);
  }

  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const override {
    return std::make_unique<GatedDecoder>(act_, gate_up_proj_, down_proj_, ctx, pre_norm);
  }

  // The stock families here take any hidden_act for their gated MLP (ACT2FN); llama.cpp's
  // graphs of them compute silu only.
  void export_config(ExportConfig& out) const override {
    const int64_t width = down_proj_.in_features();
    if (out.format() == ExportConfig::Format::gguf) {
      // llama.cpp's gemma2/gemma3 gate with GELU (tanh form, LLM_FFN_GELU), the others with silu.
      if (out.gemma() && act_.llama_cpp)
        out.refuse(key_, "'swiglu'", "llama.cpp's gemma2/gemma3 gate with GELU (model.mlp = 'geglu')");
      if (!out.gemma() && !act_.llama_cpp)
        out.refuse(key_, "'geglu'", "llama.cpp's graph of this family gates with silu");
      if (out.is("qwen3_moe"))
        out.refuse("model.alt_mlp_layers", std::to_string(layer_), "llama.cpp's qwen3moe has sparse layers only");
      return out.set("feed_forward_length", width, "model.ffn_hidden");
    }
    out.set("intermediate_size", width, "model.ffn_hidden");
    out.set("hidden_act", act_.hf_act, key_);
    if (out.gemma()) out.set("hidden_activation", act_.hf_act, key_);  // what they read
    if (out.is("llama")) out.set("mlp_bias", false, key_);
    if (out.is("qwen3_moe")) out.append("mlp_only_layers", layer_);  // a dense layer among sparse ones
  }

 private:
  // Where the activation's op leaves max |output| for `layer`'s FP8 quantize, when both do
  // that; else undefined (the layer finds its amax itself).
  Tensor amax_for(const LinearLayer& layer, Workspace::Scope& scope) const {
    return act_.reports_amax ? layer.amax_slot(scope) : Tensor();
  }

  const GatedActivation& act_;
  const char* key_;  // the config key that chose it (model.mlp or model.alt_mlp), for refusals
  int64_t layer_;
  const ExecContext& exec_;
  Workspace& workspace_;
  LinearLayer gate_up_proj_;  // [2F, hidden]: gate rows, then up rows
  LinearLayer down_proj_;     // [hidden, F]
  Tensor gate_up_;                // saved [t, 2F]: the pre-activation
};

const char* key_of(const LayerSpec& layer) {
  return layer.choices.mlp == layer.model->mlp ? "model.mlp" : "model.alt_mlp";
}

}  // namespace

void register_swiglu_mlp(MlpRegistry& registry) {
  registry.add("swiglu", "down(silu(gate(x)) * up(x)) (Qwen3/Llama MLP)", [](BuildContext& ctx, const LayerSpec& layer) {
    return std::make_unique<GatedMlp>(ctx, layer, kSwiglu, key_of(layer));
  });
}

void register_geglu_mlp(MlpRegistry& registry) {
  registry.add("geglu", "down(gelu_tanh(gate(x)) * up(x)) (Gemma MLP, gelu_pytorch_tanh)",
               [](BuildContext& ctx, const LayerSpec& layer) {
                 return std::make_unique<GatedMlp>(ctx, layer, kGeglu, key_of(layer));
               });
}

}  // namespace kiln
