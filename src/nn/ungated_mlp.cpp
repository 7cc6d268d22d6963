// Ungated MLPs: down(act(up(x))), as GPT-2's MLP. Registry names "gelu" (act = tanh-
// approximate GELU, GPT-2's "gelu_new") and "relu2" (act = squared ReLU, Primer's). The
// width is model.ungated_ffn_hidden (0: 4 x hidden, GPT-2's) rather than model.ffn_hidden,
// the gated MLPs' width: a gated MLP of width F has the parameters of an ungated one of 1.5 F.
// Only up(x) is saved: backward rebuilds the activation (for the down projection's weight
// gradient) in the same pass that differentiates it, unless the down projection kept its
// FP8 operand from the forward.
//
// Decode: the same ops over the step's rows.
#include "nn/modules.h"
#include "nn/mup.h"
#include "ops/activation/activation.h"
#include "nn/linear_layer.h"

#include <cmath>

namespace kiln {

namespace {

using activation::Kind;

class UngatedDecoder final : public BranchDecoder {
 public:
  UngatedDecoder(Kind kind, const LinearLayer& up, const LinearLayer& down, DecodeContext& ctx)
      : kind_(kind), up_proj_(up), down_proj_(down), exec_(ctx.exec), workspace_(ctx.workspace), dtype_(ctx.dtype) {
    ctx.workspace.reserve_peak(2 * Workspace::footprint(ctx.dtype, Shape{ctx.max_rows, up.out_features()}));
  }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    const int64_t n = rows.count, f = up_proj_.out_features();
    Workspace::Scope scope(workspace_);
    const Tensor up = scope.take(dtype_, Shape{n, f}), act = scope.take(dtype_, Shape{n, f});
    up_proj_.forward(exec_, h, up);
    ops::activation_forward(exec_, kind_, up, act);
    down_proj_.forward(exec_, act, out);
  }

 private:
  Kind kind_;
  LinearLayer up_proj_, down_proj_;  // [F, hidden], [hidden, F] (the module's)
  const ExecContext& exec_;
  Workspace& workspace_;
  DType dtype_;
};

class UngatedMlp final : public Mlp {
 public:
  UngatedMlp(BuildContext& ctx, const LayerSpec& layer, Kind kind, const char* key)
      : kind_(kind), key_(key), exec_(ctx.exec), workspace_(ctx.workspace) {
    const ModelConfig& m = *layer.model;
    const int64_t t = ctx.max_tokens, f = m.ungated_ffn_hidden > 0 ? m.ungated_ffn_hidden : 4 * m.hidden;
    const NameScope n = layer.names.child("mlp.", "mlp.", "");
    up_proj_.declare(ctx, n("up_proj.weight", "up_proj.weight", "ffn_up.weight"), f, m.hidden, ParamRole::matrix,
                     Init::normal(hidden_init_std(m)));
    down_proj_.declare(ctx, n("down_proj.weight", "down_proj.weight", "ffn_down.weight"), m.hidden, f,
                       ParamRole::matrix, Init::normal(residual_init_std(m)));
    up_proj_.keep_fp8_input(ctx);  // in FP8, x's operand from forward to backward (gated_mlp.cpp)
    down_proj_.keep_fp8_input(ctx);
    ctx.saved(up_, Shape{t, f});
    // Forward scratch: the activation [t, f]. Backward: d(act) [t, f] (then the activation
    // again, in place) and d(up) [t, f].
    ctx.workspace.reserve_peak(2 * Workspace::footprint(ctx.dtype, Shape{t, f}));
  }

  void forward(const Tensor& x, const Tensor& out) override {
    const int64_t t = x.size(0);
    Workspace::Scope scope(workspace_);
    Tensor up = up_.rows(0, t), act = scope.take(up.dtype(), up.shape());
    up_proj_.forward(x, up);
    ops::activation_forward(exec_, kind_, up, act);
    down_proj_.forward(act, out);
  }

  void backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    const int64_t t = dout.size(0);
    Workspace::Scope scope(workspace_);
    const Tensor up = up_.rows(0, t);
    Tensor dact = scope.take(dout.dtype(), up.shape()), dup = scope.take(dout.dtype(), up.shape());
    if (down_proj_.weight_grad_reads_x(t)) {
      // d(act) = dout Wdown; then dact is overwritten by the activation itself, which the
      // down projection's weight gradient reads.
      down_proj_.backward_input(dout, dact);
      ops::activation_backward(exec_, kind_, up, dact, dup, dact);
      down_proj_.backward_weight(dact, dout);
    } else {
      // The weight gradient reads the activation's FP8 operand kept from the forward: one
      // call (dout quantized once), and the activation is not rebuilt.
      down_proj_.backward(dact, dout, dact);
      ops::activation_backward(exec_, kind_, up, dact, dup);
    }
    up_proj_.backward(x, dup, dx);
  }

  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const override {
    (void)pre_norm;  // no fused decode projection computes these activations
    return std::make_unique<UngatedDecoder>(kind_, up_proj_, down_proj_, ctx);
  }

  // Qwen3, Llama, Qwen2 and Qwen3-MoE (the families kiln writes) gate their MLPs; GPT-2's
  // family would express "gelu" but is not written (its fused c_attn and LayerNorm differ).
  void export_config(ExportConfig& out) const override {
    out.refuse(key_, fmt::format("'{}'", kind_ == Kind::gelu_tanh ? "gelu" : "relu2"),
               "its MLP is ungated (the stock families kiln writes gate theirs)");
  }

 private:
  Kind kind_;
  const char* key_;  // the config key that chose it (model.mlp or model.alt_mlp), for refusals
  const ExecContext& exec_;
  Workspace& workspace_;
  LinearLayer up_proj_;    // [F, hidden]
  LinearLayer down_proj_;  // [hidden, F]
  Tensor up_;               // saved [t, F]: the pre-activation
};

const char* key_of(const LayerSpec& layer) {
  return layer.choices.mlp == layer.model->mlp ? "model.mlp" : "model.alt_mlp";
}

}  // namespace

void register_ungated_mlps(MlpRegistry& registry) {
  registry.add("gelu", "down(gelu_tanh(up(x))), ungated (GPT-2 MLP; width model.ungated_ffn_hidden)",
               [](BuildContext& ctx, const LayerSpec& layer) {
                 return std::make_unique<UngatedMlp>(ctx, layer, Kind::gelu_tanh, key_of(layer));
               });
  registry.add("relu2", "down(relu(up(x))^2), ungated (Primer; width model.ungated_ffn_hidden)",
               [](BuildContext& ctx, const LayerSpec& layer) {
                 return std::make_unique<UngatedMlp>(ctx, layer, Kind::relu2, key_of(layer));
               });
}

}  // namespace kiln
