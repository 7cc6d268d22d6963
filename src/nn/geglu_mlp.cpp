// GeGLU MLP (registry name "geglu"): down(gelu_tanh(gate(x)) * up(x)), as transformers'
// GemmaMLP with hidden_act "gelu_pytorch_tanh". The same plan as the SwiGLU MLP
// (nn/swiglu_mlp.cpp), only the activation differs: gate and up share one fused
// [2F, hidden] weight (one GEMM) while keeping their own names, and only gate|up is saved;
// backward rebuilds the activation (for the down projection's weight gradient) in the same
// pass that differentiates it.
#include "nn/modules.h"
#include "ops/geglu/geglu.h"
#include "ops/linear/linear.h"

#include <cmath>

namespace kiln {

namespace {

class GegluMlp final : public Mlp {
 public:
  GegluMlp(BuildContext& ctx, const LayerSpec& layer) : workspace_(ctx.workspace) {
    const ModelConfig& m = *layer.model;
    const int64_t t = ctx.max_tokens, f = m.ffn_hidden;
    const std::string p = layer.prefix + ".mlp.";
    ctx.fused_parameter(gate_up_w_, gate_up_g_, {{p + "gate_proj.weight", f}, {p + "up_proj.weight", f}}, m.hidden,
                        true, Init::normal(m.init_std));
    ctx.parameter(down_w_, down_g_, p + "down_proj.weight", Shape{m.hidden, f}, true,
                  Init::normal(m.init_std / std::sqrt(2.0 * static_cast<double>(m.layers))));
    ctx.saved(gate_up_, Shape{t, 2 * f});
    // Forward scratch: the activation [t, f]. Backward: d(act) [t, f] (then the activation
    // again, in place) and d(gate_up) [t, 2f].
    ctx.workspace.reserve_peak(Workspace::footprint(ctx.dtype, Shape{t, f}) +
                               Workspace::footprint(ctx.dtype, Shape{t, 2 * f}));
  }

  void forward(const Tensor& x, const Tensor& out) override {
    const int64_t t = x.size(0);
    Workspace::Scope scope(workspace_);
    Tensor gate_up = gate_up_.rows(0, t), act = scope.take(gate_up.dtype(), Shape{t, gate_up.size(1) / 2});
    ops::linear_forward(x, gate_up_w_, Tensor(), gate_up);
    ops::geglu_forward(gate_up, act);
    ops::linear_forward(act, down_w_, Tensor(), out);
  }

  void backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    const int64_t t = dout.size(0);
    Workspace::Scope scope(workspace_);
    const Tensor gate_up = gate_up_.rows(0, t);
    Tensor dact = scope.take(dout.dtype(), Shape{t, gate_up.size(1) / 2});
    Tensor dgate_up = scope.take(dout.dtype(), gate_up.shape());
    // d(act) = dout Wdown (x is only read for a weight gradient: none is asked here); then
    // dact is overwritten by the activation itself, which the weight gradient reads.
    ops::linear_backward(dact, down_w_, dout, dact, Tensor(), Tensor());
    ops::geglu_backward(gate_up, dact, dgate_up, dact);
    ops::linear_backward(dact, down_w_, dout, Tensor(), down_g_, Tensor());
    ops::linear_backward(x, gate_up_w_, dgate_up, dx, gate_up_g_, Tensor());
  }

 private:
  Workspace& workspace_;
  Tensor gate_up_w_, gate_up_g_;  // [2F, hidden]: gate rows, then up rows
  Tensor down_w_, down_g_;        // [hidden, F]
  Tensor gate_up_;                // saved: [t, 2F] pre-activation
};

}  // namespace

void register_geglu_mlp(MlpRegistry& registry) {
  registry.add("geglu", "down(gelu_tanh(gate(x)) * up(x)) (Gemma MLP, gelu_pytorch_tanh)",
               [](BuildContext& ctx, const LayerSpec& layer) { return std::make_unique<GegluMlp>(ctx, layer); });
}

}  // namespace kiln
