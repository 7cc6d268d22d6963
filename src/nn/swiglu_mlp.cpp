// SwiGLU MLP (registry name "swiglu"): down(silu(gate(x)) * up(x)), as transformers'
// Qwen3MLP / LlamaMLP. gate and up share one fused [2F, hidden] weight (one GEMM) while
// keeping their own names.
#include "nn/modules.h"
#include "ops/linear/linear.h"
#include "ops/swiglu/swiglu.h"

#include <cmath>

namespace kiln {

namespace {

class SwigluMlp final : public Mlp {
 public:
  SwigluMlp(BuildContext& ctx, const LayerSpec& layer) : workspace_(ctx.workspace) {
    const ModelConfig& m = *layer.model;
    const int64_t t = ctx.max_tokens, f = m.ffn_hidden;
    const std::string p = layer.prefix + ".mlp.";
    ctx.fused_parameter(gate_up_w_, gate_up_g_, {{p + "gate_proj.weight", f}, {p + "up_proj.weight", f}}, m.hidden,
                        true, Init::normal(m.init_std));
    ctx.parameter(down_w_, down_g_, p + "down_proj.weight", Shape{m.hidden, f}, true,
                  Init::normal(m.init_std / std::sqrt(2.0 * static_cast<double>(m.layers))));
    ctx.saved(gate_up_, Shape{t, 2 * f});
    ctx.saved(act_, Shape{t, f});
    // Backward scratch: d(act) [t, f] and d(gate_up) [t, 2f].
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.dtype, Shape{t, f}) +
                               Workspace::footprint(ctx.dtype, Shape{t, 2 * f}));
  }

  void forward(const Tensor& x, const Tensor& out) override {
    const int64_t t = x.size(0);
    saved_x_ = x;
    Tensor gate_up = gate_up_.rows(0, t), act = act_.rows(0, t);
    ops::linear_forward(x, gate_up_w_, Tensor(), gate_up);
    ops::swiglu_forward(gate_up, act);
    ops::linear_forward(act, down_w_, Tensor(), out);
  }

  void backward(const Tensor& dout, const Tensor& dx) override {
    const int64_t t = dout.size(0);
    Workspace::Scope scope(workspace_);
    Tensor dact = scope.take(dout.dtype(), act_.rows(0, t).shape());
    Tensor dgate_up = scope.take(dout.dtype(), gate_up_.rows(0, t).shape());
    ops::linear_backward(act_.rows(0, t), down_w_, dout, dact, down_g_, Tensor());
    ops::swiglu_backward(gate_up_.rows(0, t), dact, dgate_up);
    ops::linear_backward(saved_x_, gate_up_w_, dgate_up, dx, gate_up_g_, Tensor());
  }

 private:
  Workspace& workspace_;
  Tensor gate_up_w_, gate_up_g_, down_w_, down_g_;
  Tensor gate_up_, act_;  // saved: [t, 2F] pre-activation, [t, F] activation
  Tensor saved_x_;
};

}  // namespace

void register_swiglu_mlp(MlpRegistry& registry) {
  registry.add("swiglu", "down(silu(gate(x)) * up(x)) (Qwen3/Llama MLP)",
               [](BuildContext& ctx, const LayerSpec& layer) { return std::make_unique<SwigluMlp>(ctx, layer); });
}

}  // namespace kiln
