// rms_norm (ops/rms_norm/rms_norm.h) and the fused add + rms_norm of the pre-norm block.
//
// Shapes cover every launch shape of the kernels: one row, odd counts, row counts that
// are not a multiple of a block's rows; columns below a warp, odd (scalar path),
// multiples of 4 and 8 (vector paths), head-sized rows (8 or 16 threads per row on the
// mixed path), a warp per row, a block per row, and blocks that loop over many rows and
// need the shared-memory opt-in (16384 fp32 sums).
#include "op_table/op_table.h"
#include "core/rng.h"
#include "ops/elementwise/elementwise.h"
#include "ops/rms_norm/rms_norm.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

constexpr double kEps = 1e-6;

struct Shape2 {
  int64_t rows, cols;
};

// y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), in fp64.
void reference_rms_norm(const double* x, const double* w, double eps, int64_t rows, int64_t cols, double* y,
                        double* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += x[r * cols + c] * x[r * cols + c];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(cols) + eps);
    rstd[r] = inv;
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] * inv * (w ? w[c] : 1.0);
  }
}

// dx = r (g - x r^2 mean(g x)) with g = dy w cancels (fully for one column), so its terms'
// size is |r g| (+ what it accumulates onto); dw is a column sum, whose rounding scales
// with the sum of |dy x r| over rows (+ its start).
void rms_norm_magnitudes(const Tensors& t, DType, Magnitudes& m) {
  const Tensor& x = t["x"];
  const int64_t rows = x.size(0), cols = x.size(1);
  const double *xv = t.f64("x"), *dy = t.f64("dy"), *rstd = t.f64("rstd"), *dx = t.f64("dx");
  const double* w = t.has("w") ? t.f64("w") : nullptr;
  Magnitude& mdx = m["dx"];
  mdx.values.resize(static_cast<size_t>(rows * cols));
  std::vector<double> column(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      mdx.values[static_cast<size_t>(i)] = std::fabs(rstd[r] * dy[i] * (w ? w[c] : 1.0)) + std::fabs(dx[i]);
      column[static_cast<size_t>(c)] += std::fabs(dy[i] * xv[i] * rstd[r]);
    }
  if (!w) return;
  Magnitude& mdw = m["dw"];
  const double* dw = t.f64("dw");
  for (int64_t c = 0; c < cols; ++c) mdw.values.push_back(std::fabs(dw[c]) + column[static_cast<size_t>(c)]);
}

struct RmsFlags {
  bool gain = true, accumulate = false;
  bool x_narrow = false;  // x (and dx) bf16 on the mixed path: the per-head q/k norm
};

OpCase rms_norm_case(Shape2 s, RmsFlags f, std::vector<DType> cuda) {
  const Width xw = f.x_narrow ? Width::narrow : Width::wide;
  const Shape xs{s.rows, s.cols};
  OpCase c;
  c.op = "rms_norm";
  c.name = fmt::format("r{}_c{}_{}_{}{}", s.rows, s.cols, f.gain ? "gain" : "nogain", f.accumulate ? "acc" : "set",
                       f.x_narrow ? "_xbf16" : "");
  c.tensors = {in("x", xs, xw).scaled(2.0), out("y", xs), out("rstd", {s.rows}, Width::wide),
               grad_out("dy", "y", xs), grad_in("dx", "x", xs, xw),
               // The residual gradient's bf16 copy that the mixed path writes in the same pass.
               out("dx_copy", xs).by_backward().unchecked()};
  if (f.accumulate) c.tensors[4].accumulating();
  if (f.gain) {
    c.tensors.push_back(in("w", {s.cols}, Width::wide).scaled(0.3, 1.0));
    c.tensors.push_back(grad_in("dw", "w", {s.cols}, Width::wide).accumulating());
  }
  // The same backward without the copy first, from the same starting values (copied from
  // dx and dw as they are reset): writing the copy changes neither.
  c.tensors.push_back(out("dx_alone", xs, xw).by_backward().unchecked().copied_from("dx"));
  c.same_bits = {{"dx_copy", "dx"}, {"dx_alone", "dx"}};
  if (f.gain) {
    c.tensors.push_back(out("dw_alone", {s.cols}, Width::wide).by_backward().unchecked().copied_from("dw"));
    c.same_bits.emplace_back("dw_alone", "dw");
  }
  const bool accumulate = f.accumulate;
  c.forward = [](const Tensors& t) { ops::rms_norm_forward(process_exec(), t["x"], t.get("w"), kEps, t["y"], t["rstd"]); };
  c.backward = [accumulate](const Tensors& t) {
    ops::rms_norm_backward(process_exec(), t["x"], t.get("w"), t["rstd"], t["dy"], t["dx_alone"], t.get("dw_alone"), accumulate);
    ops::rms_norm_backward(process_exec(), t["x"], t.get("w"), t["rstd"], t["dy"], t["dx"], t.get("dw"), accumulate, t["dx_copy"]);
  };
  c.reference = [](const Tensors& t) {
    const Tensor& x = t["x"];
    reference_rms_norm(t.f64("x"), t.has("w") ? t.f64("w") : nullptr, kEps, x.size(0), x.size(1), t.f64("y"),
                       t.f64("rstd"));
  };
  c.magnitudes = rms_norm_magnitudes;
  c.cuda = std::move(cuda);
  c.cpu = s.rows * s.cols <= kCpuMaxElements;
  c.finite_differences = false;
  c.fd = fd_options(1e-6, 1e-5);  // one row has mean(x^2) ~ eps: the step must be small
  return c;
}

// The fused residual add: sum = a + b, y = rms_norm(sum). On the mixed path (fp32 a, bf16
// b) one kernel; its sum, y and rstd must be the bits of the two unfused kernels.
OpCase add_rms_norm_case(Shape2 s) {
  const Shape xs{s.rows, s.cols};
  OpCase c;
  c.op = "add_rms_norm";
  c.name = fmt::format("r{}_c{}", s.rows, s.cols);
  c.tensors = {in("a", xs, Width::wide).scaled(2.0), in("b", xs), in("w", {s.cols}, Width::wide),
               out("sum", xs, Width::wide), out("y", xs), out("rstd", {s.rows}, Width::wide),
               out("sum_unfused", xs, Width::wide).unchecked(), out("y_unfused", xs).unchecked(),
               out("rstd_unfused", {s.rows}, Width::wide).unchecked()};
  c.same_bits = {{"sum", "sum_unfused"}, {"y", "y_unfused"}, {"rstd", "rstd_unfused"}};
  c.forward = [](const Tensors& t) {
    ops::add_rms_norm_forward(process_exec(), t["a"], t["b"], t["w"], kEps, t["sum"], t["y"], t["rstd"]);
    ops::add(process_exec(), t["a"], t["b"], t["sum_unfused"]);
    ops::rms_norm_forward(process_exec(), t["sum_unfused"], t["w"], kEps, t["y_unfused"], t["rstd_unfused"]);
  };
  c.reference = [](const Tensors& t) {
    const int64_t n = t["a"].numel();
    double* sum = t.f64("sum");
    for (int64_t i = 0; i < n; ++i) sum[i] = t.f64("a")[i] + t.f64("b")[i];
    reference_rms_norm(sum, t.f64("w"), kEps, t["a"].size(0), t["a"].size(1), t.f64("y"), t.f64("rstd"));
  };
  c.cuda = {DType::f32, DType::bf16};
  c.cpu = s.rows * s.cols <= kCpuMaxElements;
  c.finite_differences = false;
  return c;
}

}  // namespace

std::vector<OpCase> rms_norm_cases() {
  std::vector<OpCase> cases;
  // Finite differences on small rows, one of them with mean(x^2) ~ eps (where eps matters
  // in the gradient).
  for (bool gain : {true, false})
    for (bool accumulate : {false, true}) {
      OpCase c = rms_norm_case({6, 7}, {gain, accumulate}, {});
      c.name = "fd_" + c.name;
      c.finite_differences = true;
      c.tensors[0].filled([](double* v, int64_t n) {
        Rng rng(30);
        for (int64_t i = 0; i < n; ++i) v[i] = 1.5 * rng.normal() * (i / 7 == 2 ? 2e-3 : 1.0);
      });
      cases.push_back(std::move(c));
    }
  const int64_t rows[] = {1, 3, 37, 1000};
  const int64_t cols[] = {1, 7, 13, 64, 100, 128, 768, 1000, 1001, 1536, 2048, 4099};
  for (int64_t r : rows)
    for (int64_t col : cols)
      for (bool gain : {true, false})
        for (bool accumulate : {false, true}) {
          cases.push_back(rms_norm_case({r, col}, {gain, accumulate}, {DType::f32, DType::bf16}));
          // bf16 x only changes the mixed path (the per-head q/k norm, which has a gain).
          if (gain) {
            OpCase c = rms_norm_case({r, col}, {gain, accumulate, true}, {DType::bf16});
            c.cpu = false;
            cases.push_back(std::move(c));
          }
        }
  // Many rows per block (each block's groups loop over its rows before the dw partials),
  // block counts capped by the dw scratch, and a row long enough to need the shared-memory
  // opt-in: GPU launch shapes only.
  struct Many {
    Shape2 shape;
    RmsFlags flags;
  };
  for (const Many& m : {Many{{5000, 2048}, {true, true}}, Many{{70001, 64}, {true, false, true}},
                        Many{{20000, 768}, {true, true}}, Many{{3000, 4096}, {true, true}},
                        Many{{3, 16384}, {true, true}}, Many{{2100, 13}, {true, true, true}}}) {
    OpCase c = rms_norm_case(m.shape, m.flags, m.flags.x_narrow ? std::vector<DType>{DType::bf16}
                                                               : std::vector<DType>{DType::f32, DType::bf16});
    c.cpu = false;
    cases.push_back(std::move(c));
  }
  // Offset views (no 16-byte alignment): the scalar paths, with guards on both sides.
  for (bool x_narrow : {false, true}) {
    OpCase c = rms_norm_case({5, 64}, {true, true, x_narrow}, {DType::bf16});
    c.name += "_unaligned";
    c.unaligned = true;
    c.cpu = false;
    cases.push_back(std::move(c));
  }
  OpCase f32_unaligned = rms_norm_case({5, 64}, {true, false}, {DType::f32});
  f32_unaligned.name += "_unaligned";
  f32_unaligned.unaligned = true;
  f32_unaligned.cpu = false;
  cases.push_back(std::move(f32_unaligned));
  return cases;
}

std::vector<OpCase> add_rms_norm_cases() {
  std::vector<OpCase> cases;
  for (Shape2 s : {Shape2{37, 768}, {300, 1024}, {5, 1001}, {1, 64}, {6, 7}}) cases.push_back(add_rms_norm_case(s));
  return cases;
}

}  // namespace kiln::op_test
