// swiglu (ops/swiglu/swiglu.h): gate_up [n, 2f] -> silu(gate) * up, and the backward,
// also in the form that rebuilds the output over its own input gradient (the MLP's
// recompute), which must give the same gradient and the forward's output to the bit.
#include "op_table/op_table.h"
#include "ops/swiglu/swiglu.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

OpCase swiglu_case(int64_t n, int64_t f, std::vector<DType> cuda) {
  const Shape gs{n, 2 * f}, os{n, f};
  OpCase c;
  c.op = "swiglu";
  c.name = fmt::format("n{}_f{}", n, f);
  c.tensors = {in("gate_up", gs).scaled(2.0), out("out", os), grad_out("dout", "out", os),
               grad_in("dgate_up", "gate_up", gs).judged(Error::forward),
               // The recompute form: dout's copy is overwritten by the output.
               out("dout_then_out", os).by_backward().unchecked().copied_from("dout"),
               out("dgate_up_again", gs).by_backward().unchecked()};
  c.same_bits = {{"dout_then_out", "out"}, {"dgate_up_again", "dgate_up"}};
  c.forward = [](const Tensors& t) { ops::swiglu_forward(process_exec(), t["gate_up"], t["out"]); };
  c.backward = [](const Tensors& t) {
    ops::swiglu_backward(process_exec(), t["gate_up"], t["dout"], t["dgate_up"]);
    ops::swiglu_backward(process_exec(), t["gate_up"], t["dout_then_out"], t["dgate_up_again"], t["dout_then_out"]);
  };
  c.reference = [](const Tensors& t) {
    const int64_t rows = t["out"].size(0), cols = t["out"].size(1);
    const double* gu = t.f64("gate_up");
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const double g = gu[i * 2 * cols + j], u = gu[i * 2 * cols + cols + j];
        t.f64("out")[i * cols + j] = g / (1 + std::exp(-g)) * u;
      }
  };
  c.cuda = std::move(cuda);
  c.cpu = gs.numel() <= kCpuMaxElements;
  c.finite_differences = gs.numel() <= 100;
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

}  // namespace

std::vector<OpCase> swiglu_cases() {
  std::vector<OpCase> cases;
  cases.push_back(swiglu_case(5, 7, {}));  // finite differences
  // Vector path (f a multiple of 8) and scalar path (13, 77, 1001).
  for (auto [n, f] : {std::pair<int64_t, int64_t>{1, 64}, {37, 768}, {1000, 1000}, {3, 2048}, {37, 13}, {5, 1001},
                      {45, 77}})
    cases.push_back(swiglu_case(n, f, {DType::f32, DType::bf16}));
  return cases;
}

}  // namespace kiln::op_test
