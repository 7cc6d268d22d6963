// RMSNorm module (registry name "rmsnorm"): a learned gain per feature, statistics in
// fp32 or wider, as transformers' Qwen3RMSNorm / LlamaRMSNorm.
#include "core/op_profiler.h"
#include "nn/modules.h"
#include "ops/elementwise/elementwise.h"
#include "ops/rms_norm/rms_norm.h"

#if KILN_WITH_CUDA
#include "ops/decode/decode_kernels.h"
#endif

namespace kiln {

namespace {

// Decode: the residual add and the norm, as one kernel with the GPU's fused kernels.
class RmsNormDecoder final : public NormDecoder {
 public:
  RmsNormDecoder(const Tensor& weight, double eps, DecodeContext& ctx)
      : weight_(weight), eps_(eps), exec_(ctx.exec), workspace_(ctx.workspace), wide_(ctx.wide), mixed_(ctx.mixed()),
        fuse_(ctx.device == Device::cuda && ctx.fuse) {
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.wide, Shape{ctx.max_rows}));
  }

  void add_norm(const Tensor& x, const Tensor& add, const Tensor& y) override {
    const int64_t n = x.size(0);
    if (fuse_) {
#if KILN_WITH_CUDA
      OpScope op("add_rms_norm (fused)", Device::cuda);
      cuda::add_rms_norm(exec_, y.dtype(), x.data<float>(), add.defined() ? add.raw() : nullptr, weight_.data<float>(),
                         static_cast<float>(eps_), n, x.size(1), y.raw());
#endif
      return;
    }
    // x += add: in place, or wide + compute dtype -> wide on the mixed path.
    if (add.defined()) mixed_ ? ops::add(exec_, x, add, x) : ops::add_inplace(exec_, x, add);
    Workspace::Scope scope(workspace_);
    ops::rms_norm_forward(exec_, x, weight_, eps_, y, scope.take(wide_, Shape{n}));
  }

 private:
  Tensor weight_;
  double eps_;
  const ExecContext& exec_;
  Workspace& workspace_;
  DType wide_;
  bool mixed_, fuse_;
};

class RmsNorm final : public Norm {
 public:
  RmsNorm(BuildContext& ctx, const NormSpec& spec) : exec_(ctx.exec), eps_(spec.eps) {
    ctx.parameter(weight_, weight_grad_, spec.names("weight", "weight", "weight"), Shape{spec.dim}, ParamRole::norm,
                  Init::ones());
    ctx.saved_wide(rstd_, Shape{spec.rows});
    ctx.kept_view(saved_x_);
  }

  void forward(const Tensor& x, const Tensor& y) override {
    saved_x_ = x;
    ops::rms_norm_forward(exec_, x, weight_, eps_, y, rstd_.rows(0, x.size(0)));
  }

  void forward_add(const Tensor& a, const Tensor& b, const Tensor& sum, const Tensor& y) override {
    saved_x_ = sum;
    ops::add_rms_norm_forward(exec_, a, b, weight_, eps_, sum, y, rstd_.rows(0, sum.size(0)));
  }

  void backward(const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dx_copy) override {
    ops::rms_norm_backward(exec_, saved_x_, weight_, rstd_.rows(0, saved_x_.size(0)), dy, dx, weight_grad_,
                           accumulate_dx, dx_copy);
  }

  void recompute(const Tensor& y) override {
    ops::rms_norm_forward(exec_, saved_x_, weight_, eps_, y, rstd_.rows(0, saved_x_.size(0)));
  }

  std::unique_ptr<NormDecoder> make_decoder(DecodeContext& ctx) const override {
    return std::make_unique<RmsNormDecoder>(weight_, eps_, ctx);
  }

  std::optional<RmsNormForm> rms_form() const override { return RmsNormForm{weight_, eps_}; }

  void export_config(ExportConfig& out) const override {
    if (out.is("gemma2") || out.is("gemma3_text"))
      out.refuse("model.norm", "'rmsnorm'", "Gemma's norms have the gain 1 + weight (model.norm = 'gemma_rmsnorm')");
    if (out.format() == ExportConfig::Format::hf) out.set("rms_norm_eps", eps_, "model.norm_eps");
    else out.set("attention.layer_norm_rms_epsilon", static_cast<float>(eps_), "model.norm_eps");
  }

 private:
  const ExecContext& exec_;
  double eps_;
  Tensor weight_, weight_grad_;
  Tensor rstd_;     // [rows] 1/rms of each row, saved for backward
  Tensor saved_x_;  // view of the caller's input, alive until backward
};

}  // namespace

void register_rms_norm(NormRegistry& registry) {
  registry.add("rmsnorm", "RMSNorm with a learned gain (Qwen3/Llama)",
               [](BuildContext& ctx, const NormSpec& spec) { return std::make_unique<RmsNorm>(ctx, spec); });
}

}  // namespace kiln
