// adamw_update (ops/optim/adamw.h): one tensor's AdamW step in place (param, m, v). The
// reference is the textbook form: m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
// p = p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps).
#include "core/rng.h"
#include "op_table/op_table.h"
#include "ops/optim/adamw.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

OpCase adamw_case(int64_t n) {
  ops::AdamWStep s;
  s.lr = 1e-2;
  s.weight_decay = 0.1;
  s.bias_correction1 = 1 - std::pow(0.9, 3);
  s.bias_correction2 = 1 - std::pow(0.95, 3);
  OpCase c;
  c.op = "adamw";
  c.name = fmt::format("n{}", n);
  c.tensors = {in("p0", {n}), in("g", {n}), in("m0", {n}).scaled(0.1),
               // The second moment is never negative in training.
               in("v0", {n}).filled([n](double* v, int64_t) {
                 Rng rng(84);
                 for (int64_t i = 0; i < n; ++i) v[i] = std::fabs(0.1 * rng.normal());
               }),
               out("p", {n}).copied_from("p0"),
               // m and v are differences of nearly equal terms (b1 m and (1 - b1) g).
               out("m", {n}).copied_from("m0").judged(Error::backward),
               out("v", {n}).copied_from("v0").judged(Error::backward)};
  c.forward = [s](const Tensors& t) { ops::adamw_update(process_exec(), t["p"], t["g"], t["m"], t["v"], s); };
  c.reference = [s, n](const Tensors& t) {
    for (int64_t i = 0; i < n; ++i) {
      const double g = t.f64("g")[i];
      const double m = s.beta1 * t.f64("m0")[i] + (1 - s.beta1) * g;
      const double v = s.beta2 * t.f64("v0")[i] + (1 - s.beta2) * g * g;
      t.f64("m")[i] = m, t.f64("v")[i] = v;
      t.f64("p")[i] = t.f64("p0")[i] * (1 - s.lr * s.weight_decay) -
                      s.lr * (m / s.bias_correction1) / (std::sqrt(v / s.bias_correction2) + s.eps);
    }
  };
  c.finite_differences = false;
  return c;
}

}  // namespace

std::vector<OpCase> adamw_cases() { return {adamw_case(7), adamw_case(1000)}; }

}  // namespace kiln::op_test
