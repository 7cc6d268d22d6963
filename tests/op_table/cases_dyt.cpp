// dyt (ops/dyt/dyt.h): y = tanh(alpha x) w + b, and its backward with alpha's, w's and b's
// gradients summed over every row (the column sums of the CUDA kernel's block partials, and
// one scalar over all elements for alpha).
//
// Shapes: one row, odd counts, columns below a warp, head-sized rows (the q/k norm, bf16 x on
// the mixed path), rows wider than a block of threads, and more rows than the backward has
// blocks (each block then walks several).
#include "op_table/op_table.h"
#include "ops/dyt/dyt.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

// dx cancels nothing, but alpha's, w's and b's gradients are sums over rows (and columns)
// whose rounding scales with the sum of their terms' sizes.
void dyt_magnitudes(const Tensors& t, DType, Magnitudes& m) {
  const Tensor& x = t["x"];
  const int64_t rows = x.size(0), cols = x.size(1);
  const double *xv = t.f64("x"), *dy = t.f64("dy"), *w = t.f64("w"), a = t.f64("alpha")[0];
  std::vector<double> dw_terms(static_cast<size_t>(cols), 0.0), db_terms(static_cast<size_t>(cols), 0.0);
  double alpha_terms = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const double th = std::tanh(a * xv[i]);
      dw_terms[static_cast<size_t>(c)] += std::fabs(dy[i] * th);
      db_terms[static_cast<size_t>(c)] += std::fabs(dy[i]);
      alpha_terms += std::fabs(dy[i] * w[c] * xv[i] * (1 - th * th));
    }
  for (int64_t c = 0; c < cols; ++c) {
    m["dw"].values.push_back(dw_terms[static_cast<size_t>(c)] + std::fabs(t.f64("dw")[c]));
    m["db"].values.push_back(db_terms[static_cast<size_t>(c)] + std::fabs(t.f64("db")[c]));
  }
  m["dalpha"].values.push_back(alpha_terms + std::fabs(t.f64("dalpha")[0]));
}

struct DytFlags {
  bool accumulate = false;
  bool x_narrow = false;  // x (and dx) bf16 on the mixed path: the per-head q/k norm
};

OpCase dyt_case(int64_t rows, int64_t cols, DytFlags f, std::vector<DType> cuda) {
  const Width xw = f.x_narrow ? Width::narrow : Width::wide;
  const Shape xs{rows, cols};
  OpCase c;
  c.op = "dyt";
  c.name = fmt::format("r{}_c{}_{}{}", rows, cols, f.accumulate ? "acc" : "set", f.x_narrow ? "_xbf16" : "");
  c.tensors = {in("x", xs, xw).scaled(2.0),
               in("alpha", {1}, Width::wide).scaled(0.1, 0.6),
               in("w", {cols}, Width::wide).scaled(0.3, 1.0),
               in("b", {cols}, Width::wide).scaled(0.2),
               out("y", xs),
               grad_out("dy", "y", xs),
               grad_in("dx", "x", xs, xw),
               grad_in("dalpha", "alpha", {1}, Width::wide).accumulating(),
               grad_in("dw", "w", {cols}, Width::wide).accumulating(),
               grad_in("db", "b", {cols}, Width::wide).accumulating(),
               // The residual gradient's bf16 copy that the mixed path writes in the same pass.
               out("dx_copy", xs).by_backward().unchecked()};
  if (f.accumulate) c.tensors[6].accumulating();
  c.same_bits = {{"dx_copy", "dx"}};
  const bool accumulate = f.accumulate;
  c.forward = [](const Tensors& t) { ops::dyt_forward(process_exec(), t["x"], t["alpha"], t["w"], t["b"], t["y"]); };
  c.backward = [accumulate](const Tensors& t) {
    ops::dyt_backward(process_exec(), t["x"], t["alpha"], t["w"], t["dy"], t["dx"], t["dalpha"], t["dw"], t["db"], accumulate,
                      t["dx_copy"]);
  };
  c.reference = [](const Tensors& t) {
    const Tensor& x = t["x"];
    const int64_t n = x.size(0), d = x.size(1);
    const double *xv = t.f64("x"), *w = t.f64("w"), *b = t.f64("b"), a = t.f64("alpha")[0];
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < d; ++j) t.f64("y")[r * d + j] = std::tanh(a * xv[r * d + j]) * w[j] + b[j];
  };
  c.magnitudes = dyt_magnitudes;
  c.cuda = std::move(cuda);
  c.cpu = rows * cols <= kCpuMaxElements;
  c.finite_differences = rows * cols <= 64;
  c.fd = fd_options(1e-6, 1e-5);
  return c;
}

}  // namespace

std::vector<OpCase> dyt_cases() {
  const std::vector<DType> both = {DType::f32, DType::bf16};
  std::vector<OpCase> cases;
  cases.push_back(dyt_case(3, 5, {}, both));  // finite differences
  cases.push_back(dyt_case(4, 7, {.accumulate = true}, both));
  cases.push_back(dyt_case(1, 1, {}, both));
  for (auto [r, c] : {std::pair<int64_t, int64_t>{37, 13}, {64, 128}, {5, 1001}, {1500, 64}, {2, 3000}})
    cases.push_back(dyt_case(r, c, {}, both));
  cases.push_back(dyt_case(96, 16, {.x_narrow = true}, both));  // heads of 16
  cases.push_back(dyt_case(33, 64, {.accumulate = true, .x_narrow = true}, both));
  return cases;
}

}  // namespace kiln::op_test
