// Dynamic Tanh (registry name "dyt"; Zhu et al. 2025): y = tanh(alpha x) * w + b in place of
// a norm, alpha one learnable scalar (initialized to model.dyt_alpha), w from ones, b from
// zeros; none weight-decayed (norm gains and biases decay only when [optim.norm] and [optim.bias] say so). No
// statistics: nothing but the input is kept for backward. The math lives in ops/dyt/.
#include "nn/block.h"
#include "nn/modules.h"
#include "ops/dyt/dyt.h"
#include "ops/elementwise/elementwise.h"

namespace kiln {

namespace {

// Decode: the residual add, then DyT over the step's rows.
class DytDecoder final : public NormDecoder {
 public:
  DytDecoder(const Tensor& alpha, const Tensor& weight, const Tensor& bias, DecodeContext& ctx)
      : exec_(ctx.exec), alpha_(alpha), weight_(weight), bias_(bias), mixed_(ctx.mixed()) {}

  void add_norm(const Tensor& x, const Tensor& add, const Tensor& y) override {
    if (add.defined()) residual_add(exec_, x, add, mixed_);
    ops::dyt_forward(exec_, x, alpha_, weight_, bias_, y);
  }

 private:
  const ExecContext& exec_;
  const Tensor& alpha_;
  const Tensor& weight_;
  const Tensor& bias_;
  bool mixed_;
};

class DytNorm final : public Norm {
 public:
  DytNorm(BuildContext& ctx, const NormSpec& spec) : exec_(ctx.exec) {
    ctx.parameter(alpha_, alpha_grad_, spec.names("alpha", "alpha", "alpha"), Shape{1}, ParamRole::norm,
                  Init::constant(spec.alpha_init));
    ctx.parameter(weight_, weight_grad_, spec.names("weight", "weight", "weight"), Shape{spec.dim}, ParamRole::norm,
                  Init::ones());
    ctx.parameter(bias_, bias_grad_, spec.names("bias", "bias", "bias"), Shape{spec.dim}, ParamRole::bias,
                  Init::zeros());
    ctx.kept_view(saved_x_);
  }

  void forward(const Tensor& x, const Tensor& y) override {
    saved_x_ = x;
    ops::dyt_forward(exec_, x, alpha_, weight_, bias_, y);
  }

  // Two passes (the add, then DyT): DyT has no reduction for a fused kernel to share.
  void forward_add(const Tensor& a, const Tensor& b, const Tensor& sum, const Tensor& y) override {
    ops::add(exec_, a, b, sum);
    forward(sum, y);
  }

  void backward(const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dx_copy) override {
    ops::dyt_backward(exec_, saved_x_, alpha_, weight_, dy, dx, alpha_grad_, weight_grad_, bias_grad_, accumulate_dx, dx_copy);
  }

  void recompute(const Tensor& y) override { ops::dyt_forward(exec_, saved_x_, alpha_, weight_, bias_, y); }

  std::unique_ptr<NormDecoder> make_decoder(DecodeContext& ctx) const override {
    return std::make_unique<DytDecoder>(alpha_, weight_, bias_, ctx);
  }

  void export_config(ExportConfig& out) const override {
    out.refuse("model.norm", "'dyt'", "no stock Hugging Face or llama.cpp family has Dynamic Tanh norms");
  }

 private:
  const ExecContext& exec_;
  Tensor alpha_, alpha_grad_;    // [1]
  Tensor weight_, weight_grad_;  // [dim]
  Tensor bias_, bias_grad_;      // [dim]
  Tensor saved_x_;               // view of the caller's input, alive until backward
};

}  // namespace

void register_dyt_norm(NormRegistry& registry) {
  registry.add("dyt", "Dynamic Tanh: tanh(alpha x) * w + b, no statistics (Zhu et al. 2025)",
               [](BuildContext& ctx, const NormSpec& spec) { return std::make_unique<DytNorm>(ctx, spec); });
}

}  // namespace kiln
