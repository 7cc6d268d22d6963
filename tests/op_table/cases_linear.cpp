// linear (ops/linear/linear.h): y = x w^T (+ b); dx (= or +=), dw and db (+=). On the
// mixed path x, w, y, dy and dx are bf16, the bias and the parameter gradients fp32.
#include "op_table/op_table.h"
#include "ops/linear/linear.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

OpCase linear_case(int64_t n, int64_t in_f, int64_t out_f, bool bias, bool accumulate_dx, std::vector<DType> cuda) {
  OpCase c;
  c.op = "linear";
  c.name = fmt::format("n{}_in{}_out{}_{}_{}", n, in_f, out_f, bias ? "bias" : "nobias", accumulate_dx ? "acc" : "set");
  c.tensors = {in("x", {n, in_f}), in("w", {out_f, in_f}), out("y", {n, out_f}), grad_out("dy", "y", {n, out_f}),
               grad_in("dx", "x", {n, in_f}), grad_in("dw", "w", {out_f, in_f}, Width::wide).accumulating()};
  if (accumulate_dx) c.tensors[4].accumulating();
  if (bias) {
    // The mixed path adds the bias through a bf16 operand (F.linear under autocast rounds it
    // to bf16 too): biases exact in bf16 (multiples of 1/32 in [-2, 2]) keep that input
    // rounding out of the comparison, which then measures the product and the output's
    // one rounding.
    c.tensors.push_back(in("b", {out_f}, Width::wide).filled([](double* v, int64_t n) {
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>((i * 37) % 129 - 64) / 32.0;
    }));
    c.tensors.push_back(grad_in("db", "b", {out_f}, Width::wide).accumulating());
  }
  c.forward = [](const Tensors& t) { ops::linear_forward(process_exec(), t["x"], t["w"], t.get("b"), t["y"]); };
  c.backward = [accumulate_dx](const Tensors& t) {
    ops::linear_backward(process_exec(), t["x"], t["w"], t["dy"], t["dx"], t["dw"], t.get("db"), accumulate_dx);
  };
  c.reference = [](const Tensors& t) {
    const int64_t rows = t["x"].size(0), k = t["x"].size(1), cols = t["w"].size(0);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        double s = t.has("b") ? t.f64("b")[j] : 0.0;
        for (int64_t e = 0; e < k; ++e) s += t.f64("x")[i * k + e] * t.f64("w")[j * k + e];
        t.f64("y")[i * cols + j] = s;
      }
  };
  // A dot product's rounding scales with the sum of its terms' sizes, not with the result.
  // And where the product is added onto a bf16 value (y onto the broadcast bias, dx onto its
  // earlier value), cuBLASLt rounds the product to bf16 before the addition (measured on an
  // H200: an ulp of the larger term where the two cancel), so each such element may be off
  // by half an ulp of |product| + |earlier value|: its own floor, at half that sum (the bf16
  // tolerance of 1e-2 then allows 5e-3 of it, more than 2^-8 = 3.9e-3).
  c.magnitudes = [bias, accumulate_dx](const Tensors& t, DType precision, Magnitudes& m) {
    const int64_t rows = t["x"].size(0), k = t["x"].size(1), cols = t["w"].size(0);
    const bool onto_bf16 = precision == DType::bf16;
    Magnitude& my = m["y"];
    my.per_element = onto_bf16 && bias;
    if (my.per_element) my.floor_fraction = 0.5;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        double terms = 0, product = 0;
        for (int64_t e = 0; e < k; ++e) {
          const double p = t.f64("x")[i * k + e] * t.f64("w")[j * k + e];
          terms += std::fabs(p), product += p;
        }
        const double b = t.has("b") ? std::fabs(t.f64("b")[j]) : 0.0;
        my.values.push_back(my.per_element ? std::fabs(product) + b : terms + b);
      }
    if (!(onto_bf16 && accumulate_dx)) return;
    Magnitude& mdx = m["dx"];
    mdx.per_element = true;
    mdx.floor_fraction = 0.5;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t e = 0; e < k; ++e) {
        double product = 0;
        for (int64_t j = 0; j < cols; ++j) product += t.f64("dy")[i * cols + j] * t.f64("w")[j * k + e];
        // The earlier value: the f64 result less the product (the reference adds the two).
        mdx.values.push_back(std::fabs(product) + std::fabs(t.f64("dx")[i * k + e] - product));
      }
  };
  c.cuda = std::move(cuda);
  c.finite_differences = c.cuda.empty();
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

}  // namespace

std::vector<OpCase> linear_cases() {
  std::vector<OpCase> cases;
  for (bool bias : {false, true})
    for (bool accumulate : {false, true}) cases.push_back(linear_case(7, 5, 3, bias, accumulate, {}));
  // GPU: a single row, sizes off every tile, the mixed path too.
  for (auto [n, in_f, out_f] : {std::tuple<int64_t, int64_t, int64_t>{1, 7, 5}, {37, 64, 96}, {300, 129, 33}})
    for (bool accumulate : {false, true})
      cases.push_back(linear_case(n, in_f, out_f, true, accumulate, {DType::f32, DType::bf16}));
  return cases;
}

}  // namespace kiln::op_test
