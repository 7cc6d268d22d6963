// The ungated MLPs' activations (ops/activation/activation.h): gelu_tanh and relu2, forward
// and backward, also in the form that rebuilds the output over dout (the MLP's recompute),
// which must give the same gradient and the forward's output to the bit.
#include "op_table/op_table.h"
#include "ops/activation/activation.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

using activation::Kind;

// The naive formulas in fp64, independent of activation_math.h.
double reference_value(Kind kind, double x) {
  if (kind == Kind::relu2) return x > 0 ? x * x : 0.0;
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

OpCase activation_case(Kind kind, int64_t n, int64_t f, std::vector<DType> cuda) {
  const Shape s{n, f};
  OpCase c;
  c.op = activation::name(kind);
  c.name = fmt::format("n{}_f{}", n, f);
  c.tensors = {in("x", s).scaled(2.0), out("out", s), grad_out("dout", "out", s),
               grad_in("dx", "x", s).judged(Error::forward),
               out("dout_then_out", s).by_backward().unchecked().copied_from("dout"),
               out("dx_again", s).by_backward().unchecked()};
  c.same_bits = {{"dout_then_out", "out"}, {"dx_again", "dx"}};
  c.forward = [kind](const Tensors& t) { ops::activation_forward(process_exec(), kind, t["x"], t["out"]); };
  c.backward = [kind](const Tensors& t) {
    ops::activation_backward(process_exec(), kind, t["x"], t["dout"], t["dx"]);
    ops::activation_backward(process_exec(), kind, t["x"], t["dout_then_out"], t["dx_again"], t["dout_then_out"]);
  };
  c.reference = [kind](const Tensors& t) {
    const int64_t count = t["x"].numel();
    for (int64_t i = 0; i < count; ++i) t.f64("out")[i] = reference_value(kind, t.f64("x")[i]);
  };
  c.cuda = std::move(cuda);
  c.cpu = s.numel() <= kCpuMaxElements;
  // relu2's second derivative jumps at 0: a random x within the step of it is improbable.
  c.finite_differences = s.numel() <= 100;
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

}  // namespace

std::vector<OpCase> activation_cases() {
  std::vector<OpCase> cases;
  for (Kind kind : {Kind::gelu_tanh, Kind::relu2}) {
    cases.push_back(activation_case(kind, 5, 7, {}));  // finite differences
    // Vector path (count a multiple of 8) and scalar path.
    for (auto [n, f] : {std::pair<int64_t, int64_t>{1, 64}, {37, 768}, {1000, 1000}, {37, 13}, {5, 1001}})
      cases.push_back(activation_case(kind, n, f, {DType::f32, DType::bf16}));
  }
  return cases;
}

}  // namespace kiln::op_test
