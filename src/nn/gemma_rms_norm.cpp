// Gemma's RMSNorm (registry name "gemma_rmsnorm"): y = x * rstd * (1 + w), w stored as the
// gain's offset from one and initialized to zero, as transformers' GemmaRMSNorm /
// Gemma3RMSNorm, all in fp32 or wider. Like "rmsnorm", w is not weight-decayed (rank-1
// parameters decay only when [optim.norm] says so), which here pulls the gain towards one
// only if asked. The math lives in ops/gemma_rms_norm/: the RMSNorm kernels with the gain
// 1 + w, formed by each forward (w changes with every step) into a buffer of its own.
#include "nn/block.h"
#include "nn/modules.h"
#include "ops/gemma_rms_norm/gemma_rms_norm.h"

namespace kiln {

namespace {

// Decode: the residual add, then the norm over the step's rows (the gain formed again each
// step, so a decoder made before an optimizer step still sees the current weight).
class GemmaRmsNormDecoder final : public NormDecoder {
 public:
  GemmaRmsNormDecoder(const Tensor& weight, double eps, DecodeContext& ctx)
      : weight_(weight), eps_(eps), exec_(ctx.exec), workspace_(ctx.workspace), wide_(ctx.wide), mixed_(ctx.mixed()) {
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.wide, Shape{ctx.max_rows}) +
                               Workspace::footprint(ctx.wide, weight.shape()));
  }

  void add_norm(const Tensor& x, const Tensor& add, const Tensor& y) override {
    const int64_t n = x.size(0);
    if (add.defined()) residual_add(exec_, x, add, mixed_);
    Workspace::Scope scope(workspace_);
    const Tensor gain = scope.take(wide_, weight_.shape());
    ops::gemma_rms_norm_forward(exec_, x, weight_, eps_, gain, y, scope.take(wide_, Shape{n}));
  }

 private:
  const Tensor& weight_;
  double eps_;
  const ExecContext& exec_;
  Workspace& workspace_;
  DType wide_;
  bool mixed_;
};

class GemmaRmsNorm final : public Norm {
 public:
  GemmaRmsNorm(BuildContext& ctx, const NormSpec& spec) : exec_(ctx.exec), eps_(spec.eps) {
    ctx.parameter(weight_, weight_grad_, spec.names("weight", "weight", "weight"), Shape{spec.dim}, ParamRole::norm,
                  Init::zeros());
    ctx.buffer(gain_, Shape{spec.dim}, ctx.master_dtype);
    ctx.saved_wide(rstd_, Shape{spec.rows});
    ctx.kept_view(saved_x_);
  }

  void forward(const Tensor& x, const Tensor& y) override {
    saved_x_ = x;
    ops::gemma_rms_norm_forward(exec_, x, weight_, eps_, gain_, y, rstd());
  }

  void forward_add(const Tensor& a, const Tensor& b, const Tensor& sum, const Tensor& y) override {
    saved_x_ = sum;
    ops::add_gemma_rms_norm_forward(exec_, a, b, weight_, eps_, gain_, sum, y, rstd());
  }

  void backward(const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dx_copy) override {
    ops::gemma_rms_norm_backward(exec_, saved_x_, gain_, rstd(), dy, dx, weight_grad_, accumulate_dx, dx_copy);
  }

  void recompute(const Tensor& y) override { ops::gemma_rms_norm_forward(exec_, saved_x_, weight_, eps_, gain_, y, rstd()); }

  std::unique_ptr<NormDecoder> make_decoder(DecodeContext& ctx) const override {
    return std::make_unique<GemmaRmsNormDecoder>(weight_, eps_, ctx);
  }

  // Gemma 2/3 (chosen by model.sandwich_norms) compute this norm; the other families scale
  // by w itself, and Gemma 1 (no sandwich norms) is not written. llama.cpp's gemma2/gemma3
  // multiply by the stored gain, so the GGUF export stores 1 + w (io/gguf_export.cpp).
  void export_config(ExportConfig& out) const override {
    if (out.gemma()) {
      if (out.format() == ExportConfig::Format::hf) return out.set("rms_norm_eps", eps_, "model.norm_eps");
      return out.set("attention.layer_norm_rms_epsilon", static_cast<float>(eps_), "model.norm_eps");
    }
    out.refuse("model.norm", "'gemma_rmsnorm'",
               "its gain is 1 + weight: kiln exports it as Gemma 2/3, which need model.sandwich_norms = true");
  }

 private:
  const ExecContext& exec_;
  Tensor rstd() const { return rstd_.rows(0, saved_x_.size(0)); }

  double eps_;
  Tensor weight_, weight_grad_;  // [dim]: the gain's offset from one
  Tensor gain_;                  // [dim]: 1 + weight, formed by each forward
  Tensor rstd_;                  // [rows] 1/rms of each row, saved for backward
  Tensor saved_x_;               // view of the caller's input, alive until backward
};

}  // namespace

void register_gemma_rms_norm(NormRegistry& registry) {
  registry.add("gemma_rmsnorm", "RMSNorm with gain 1 + w, w from zero (Gemma/Gemma 3)",
               [](BuildContext& ctx, const NormSpec& spec) { return std::make_unique<GemmaRmsNorm>(ctx, spec); });
}

}  // namespace kiln
