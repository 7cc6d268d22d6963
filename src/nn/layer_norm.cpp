// LayerNorm modules (registry names "layernorm" and "layernorm_nobias"): a learned gain per
// feature and, for "layernorm", a learned bias, as torch.nn.LayerNorm(dim, eps,
// bias=...); statistics in fp32 or wider. The gain starts at ones and the bias at zeros;
// neither is weight-decayed (norm gains and biases decay only when [optim.norm] and [optim.bias] say so). The math
// lives in ops/layer_norm/; this class plans the memory and calls it.
#include "nn/block.h"
#include "nn/modules.h"
#include "ops/layer_norm/layer_norm.h"

namespace kiln {

namespace {

// Decode: the residual add, then the norm over the step's rows.
class LayerNormDecoder final : public NormDecoder {
 public:
  LayerNormDecoder(const Tensor& weight, const Tensor& bias, double eps, DecodeContext& ctx)
      : weight_(weight), bias_(bias), eps_(eps), exec_(ctx.exec), workspace_(ctx.workspace), wide_(ctx.wide), mixed_(ctx.mixed()) {
    ctx.workspace.reserve_peak(2 * Workspace::footprint(ctx.wide, Shape{ctx.max_rows}));
  }

  void add_norm(const Tensor& x, const Tensor& add, const Tensor& y) override {
    const int64_t n = x.size(0);
    if (add.defined()) residual_add(exec_, x, add, mixed_);
    Workspace::Scope scope(workspace_);
    ops::layer_norm_forward(exec_, x, weight_, bias_, eps_, y, scope.take(wide_, Shape{n}), scope.take(wide_, Shape{n}));
  }

 private:
  const Tensor& weight_;
  const Tensor& bias_;
  double eps_;
  const ExecContext& exec_;
  Workspace& workspace_;
  DType wide_;
  bool mixed_;
};

class LayerNorm final : public Norm {
 public:
  LayerNorm(BuildContext& ctx, const NormSpec& spec, bool bias) : exec_(ctx.exec), eps_(spec.eps), bias_on_(bias) {
    ctx.parameter(weight_, weight_grad_, spec.names("weight", "weight", "weight"), Shape{spec.dim}, ParamRole::norm,
                  Init::ones());
    if (bias)
      ctx.parameter(bias_, bias_grad_, spec.names("bias", "bias", "bias"), Shape{spec.dim}, ParamRole::bias,
                    Init::zeros());
    ctx.saved_wide(mean_, Shape{spec.rows});
    ctx.saved_wide(rstd_, Shape{spec.rows});
    ctx.kept_view(saved_x_);
  }

  void forward(const Tensor& x, const Tensor& y) override {
    saved_x_ = x;
    ops::layer_norm_forward(exec_, x, weight_, bias_, eps_, y, mean(), rstd());
  }

  void forward_add(const Tensor& a, const Tensor& b, const Tensor& sum, const Tensor& y) override {
    saved_x_ = sum;
    ops::add_layer_norm_forward(exec_, a, b, weight_, bias_, eps_, sum, y, mean(), rstd());
  }

  void backward(const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dx_copy) override {
    ops::layer_norm_backward(exec_, saved_x_, weight_, mean(), rstd(), dy, dx, weight_grad_, bias_grad_, accumulate_dx,
                             dx_copy);
  }

  void recompute(const Tensor& y) override { ops::layer_norm_forward(exec_, saved_x_, weight_, bias_, eps_, y, mean(), rstd()); }

  std::unique_ptr<NormDecoder> make_decoder(DecodeContext& ctx) const override {
    return std::make_unique<LayerNormDecoder>(weight_, bias_, eps_, ctx);
  }

  // The stock families kiln exports to normalize with RMSNorm (a LayerNorm family such as
  // StableLM would take layer_norm_eps and these tensors under the same names).
  void export_config(ExportConfig& out) const override {
    out.refuse("model.norm", bias_on_ ? "'layernorm'" : "'layernorm_nobias'", "its norms are RMSNorm");
  }

 private:
  const ExecContext& exec_;
  // The statistics of the rows the last forward saw.
  Tensor mean() const { return mean_.rows(0, saved_x_.size(0)); }
  Tensor rstd() const { return rstd_.rows(0, saved_x_.size(0)); }

  double eps_;
  bool bias_on_;
  Tensor weight_, weight_grad_;  // [dim]
  Tensor bias_, bias_grad_;      // [dim]; undefined for layernorm_nobias
  Tensor mean_, rstd_;           // [rows] each row's mean and 1/std, saved for backward
  Tensor saved_x_;               // view of the caller's input, alive until backward
};

}  // namespace

void register_layer_norm(NormRegistry& registry) {
  registry.add("layernorm", "LayerNorm with a learned gain and bias (torch.nn.LayerNorm)",
               [](BuildContext& ctx, const NormSpec& spec) { return std::make_unique<LayerNorm>(ctx, spec, true); });
  registry.add("layernorm_nobias", "LayerNorm with a learned gain, no bias (torch.nn.LayerNorm(bias=False))",
               [](BuildContext& ctx, const NormSpec& spec) { return std::make_unique<LayerNorm>(ctx, spec, false); });
}

}  // namespace kiln
