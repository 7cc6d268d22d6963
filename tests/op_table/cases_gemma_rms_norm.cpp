// gemma_rms_norm (ops/gemma_rms_norm/gemma_rms_norm.h): y = x rstd (1 + w), w's gradient
// that of the gain 1 + w. The RMSNorm kernels behind it have their own row (rms_norm); these
// cases check the gain step and that w, not 1 + w, is what the gradient is taken against.
#include "op_table/op_table.h"
#include "ops/gemma_rms_norm/gemma_rms_norm.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

constexpr double kEps = 1e-6;

OpCase gemma_case(int64_t rows, int64_t cols, std::vector<DType> cuda) {
  const Shape xs{rows, cols};
  OpCase c;
  c.op = "gemma_rms_norm";
  c.name = fmt::format("r{}_c{}", rows, cols);
  c.tensors = {in("x", xs, Width::wide).scaled(2.0), in("w", {cols}, Width::wide).scaled(0.3),
               out("gain", {cols}, Width::wide), out("y", xs), out("rstd", {rows}, Width::wide),
               grad_out("dy", "y", xs), grad_in("dx", "x", xs, Width::wide),
               grad_in("dw", "w", {cols}, Width::wide).accumulating()};
  c.forward = [](const Tensors& t) {
    ops::gemma_rms_norm_forward(process_exec(), t["x"], t["w"], kEps, t["gain"], t["y"], t["rstd"]);
  };
  c.backward = [](const Tensors& t) {
    ops::gemma_rms_norm_backward(process_exec(), t["x"], t["gain"], t["rstd"], t["dy"], t["dx"], t["dw"]);
  };
  c.reference = [](const Tensors& t) {
    const double *x = t.f64("x"), *w = t.f64("w");
    for (int64_t j = 0; j < t["w"].numel(); ++j) t.f64("gain")[j] = 1.0 + w[j];
    const Tensor& xt = t["x"];
    const int64_t n = xt.size(0), d = xt.size(1);
    for (int64_t r = 0; r < n; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < d; ++j) sum += x[r * d + j] * x[r * d + j];
      const double inv = 1.0 / std::sqrt(sum / static_cast<double>(d) + kEps);
      t.f64("rstd")[r] = inv;
      for (int64_t j = 0; j < d; ++j) t.f64("y")[r * d + j] = x[r * d + j] * inv * (1.0 + w[j]);
    }
  };
  c.cuda = std::move(cuda);
  c.cpu = rows * cols <= kCpuMaxElements;
  c.finite_differences = rows * cols <= 64;
  c.fd = fd_options(1e-6, 1e-5);
  return c;
}

}  // namespace

std::vector<OpCase> gemma_rms_norm_cases() {
  // fp32 only on the GPU: the bf16 path is the rms_norm row's (with its magnitudes), and the
  // whole GPU model test runs this norm in bf16.
  return {gemma_case(3, 5, {DType::f32}), gemma_case(37, 64, {DType::f32}), gemma_case(8, 1000, {DType::f32})};
}

}  // namespace kiln::op_test
