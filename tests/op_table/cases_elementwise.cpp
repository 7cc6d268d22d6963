// The residual stream's elementwise ops (ops/elementwise/elementwise.h): add (on the
// mixed path fp32 + bf16 -> fp32, also in place), add_inplace, scale_inplace, and the
// deterministic sum of squares of the gradient norm. One fp32 rounding of exactly known
// inputs: judged at 1e-6.
#include "op_table/op_table.h"
#include "ops/elementwise/elementwise.h"

#include <fmt/format.h>

namespace kiln::op_test {

namespace {

constexpr double kOneRounding = 1e-6;

OpCase add_case(int64_t n, bool in_place, bool unaligned, std::vector<DType> cuda) {
  OpCase c;
  c.op = "add";
  c.name = fmt::format("n{}{}{}", n, in_place ? "_inplace" : "", unaligned ? "_unaligned" : "");
  c.tensors = {in("a", {n}, Width::wide).scaled(3.0), in("b", {n})};
  if (in_place) {
    c.tensors.push_back(out("out", {n}, Width::wide).copied_from("a").within(kOneRounding));
    c.forward = [](const Tensors& t) { ops::add(process_exec(), t["out"], t["b"], t["out"]); };
  } else {
    c.tensors.push_back(out("out", {n}, Width::wide).within(kOneRounding));
    c.forward = [](const Tensors& t) { ops::add(process_exec(), t["a"], t["b"], t["out"]); };
  }
  c.reference = [n](const Tensors& t) {
    for (int64_t i = 0; i < n; ++i) t.f64("out")[i] = t.f64("a")[i] + t.f64("b")[i];
  };
  c.cuda = std::move(cuda);
  c.unaligned = unaligned;
  c.cpu = !unaligned && n <= kCpuMaxElements;
  c.finite_differences = false;
  return c;
}

}  // namespace

std::vector<OpCase> elementwise_cases() {
  std::vector<OpCase> cases;
  for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{1000}, int64_t{4099}, int64_t{100003}, (int64_t{1} << 20) + 5})
    for (bool in_place : {false, true})
      for (bool unaligned : {false, true}) cases.push_back(add_case(n, in_place, unaligned, {DType::f32, DType::bf16}));

  for (int64_t n : {int64_t{7}, int64_t{100003}}) {
    // In fp32, and in bf16 (a branch added onto another, as the shared expert's output onto
    // the routed experts'): one rounding of the sum of the (rounded) inputs, 2^-9 of it.
    for (const DType dtype : {DType::f32, DType::bf16}) {
      OpCase acc;
      acc.op = "add_inplace";
      acc.name = fmt::format("n{}{}", n, dtype == DType::bf16 ? "_mixed" : "");
      const double one_rounding = dtype == DType::bf16 ? 1.0 / 256 : kOneRounding;
      acc.tensors = {in("dst0", {n}), in("src", {n}), out("dst", {n}).copied_from("dst0").within(one_rounding)};
      acc.forward = [](const Tensors& t) { ops::add_inplace(process_exec(), t["dst"], t["src"]); };
      acc.reference = [n](const Tensors& t) {
        for (int64_t i = 0; i < n; ++i) t.f64("dst")[i] = t.f64("dst0")[i] + t.f64("src")[i];
      };
      acc.finite_differences = false;
      acc.cpu = dtype == DType::f32 && n <= kCpuMaxElements;
      acc.cuda = {dtype};
      cases.push_back(acc);
    }

    OpCase scale;
    scale.op = "scale_inplace";
    scale.name = fmt::format("n{}", n);
    scale.tensors = {in("x0", {n}), out("x", {n}).copied_from("x0").within(kOneRounding)};
    scale.forward = [](const Tensors& t) { ops::scale_inplace(process_exec(), t["x"], 0.37); };
    scale.reference = [n](const Tensors& t) {
      for (int64_t i = 0; i < n; ++i) t.f64("x")[i] = t.f64("x0")[i] * 0.37;
    };
    scale.finite_differences = false;
    scale.cpu = n <= kCpuMaxElements;
    cases.push_back(scale);

    // Accumulated in double from fp32 values: 1e-9 of the sum on the GPU, and the same
    // bits run to run (a fixed partition and order).
    OpCase sum;
    sum.op = "sum_squares";
    sum.name = fmt::format("n{}", n);
    sum.tensors = {in("x", {n}), out("sum", {1}, Width::f64).on_host().within(1e-9)};
    sum.forward = [](const Tensors& t) { t.f64("sum")[0] = ops::sum_squares(process_exec(), t["x"]); };
    sum.reference = [n](const Tensors& t) {
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += t.f64("x")[i] * t.f64("x")[i];
      t.f64("sum")[0] = s;
    };
    sum.finite_differences = false;
    sum.cpu = n <= kCpuMaxElements;
    cases.push_back(sum);
  }
  return cases;
}

}  // namespace kiln::op_test
