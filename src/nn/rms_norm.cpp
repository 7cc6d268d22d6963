// RMSNorm module (registry name "rmsnorm"): a learned gain per feature, statistics in
// fp32 or wider, as transformers' Qwen3RMSNorm / LlamaRMSNorm.
#include "nn/modules.h"
#include "ops/rms_norm/rms_norm.h"

namespace kiln {

namespace {

class RmsNorm final : public Norm {
 public:
  RmsNorm(BuildContext& ctx, const NormSpec& spec) : eps_(spec.eps) {
    ctx.parameter(weight_, weight_grad_, spec.name + ".weight", Shape{spec.dim}, false, Init::ones());
    ctx.saved_wide(rstd_, Shape{spec.rows});
  }

  void forward(const Tensor& x, const Tensor& y) override {
    saved_x_ = x;
    ops::rms_norm_forward(x, weight_, eps_, y, rstd_.rows(0, x.size(0)));
  }

  void forward_add(const Tensor& a, const Tensor& b, const Tensor& sum, const Tensor& y) override {
    saved_x_ = sum;
    ops::add_rms_norm_forward(a, b, weight_, eps_, sum, y, rstd_.rows(0, sum.size(0)));
  }

  void backward(const Tensor& dy, const Tensor& dx, bool accumulate_dx, const Tensor& dx_copy) override {
    ops::rms_norm_backward(saved_x_, weight_, rstd_.rows(0, saved_x_.size(0)), dy, dx, weight_grad_,
                           accumulate_dx, dx_copy);
  }

  void recompute(const Tensor& y) override {
    ops::rms_norm_forward(saved_x_, weight_, eps_, y, rstd_.rows(0, saved_x_.size(0)));
  }

 private:
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
