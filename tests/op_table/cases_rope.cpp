// rope_apply (ops/rope/rope.h): x [n, heads, d] rotated in place by rotate_half with fp32
// tables; the backward is the inverse rotation of dy. Each case also rotates the output
// back ("back": apply then inverse gives x again, judged against each pair's norm).
// Partial rotary (model.rope.fraction): tables of a RoPE over the first `rotated` pairs,
// whose later columns hold cos 1 and sin 0; the reference passes those pairs through
// without reading the tables, so the op must leave them exactly as they were.
#include "core/rng.h"
#include "op_table/op_table.h"
#include "ops/rope/rope.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

struct RopeShape {
  int64_t tokens, heads, half, max_pos;
  double theta = 10000.0;
  int64_t rotated = 0;  // pairs rotated (partial rotary: fraction x 2 half / 2); 0 = all

  int64_t rotated_pairs() const { return rotated > 0 ? rotated : half; }
};

// The tables as the model fills them ([max_pos, half] of cos or sin).
std::function<void(double*, int64_t)> table(const RopeShape& s, bool sine) {
  return [s, sine](double* v, int64_t) {
    OwnedTensor cos(DType::f64, Device::cpu, Shape{s.max_pos, s.half}), sin(DType::f64, Device::cpu, Shape{s.max_pos, s.half});
    ops::rope_fill_tables(process_exec(), ops::rope_inverse_frequencies(s.theta, 2 * s.rotated_pairs()), *cos, *sin);
    const double* src = (sine ? sin : cos)->data<double>();
    std::copy(src, src + s.max_pos * s.half, v);
  };
}

// out[j] = x_j c - x_{j+h} s, out[j+h] = x_{j+h} c + x_j s, s negated for the inverse, for
// the first `rotated` pairs; the others copied.
void reference_rotation(const double* x, const int32_t* pos, const double* cos, const double* sin, int64_t n,
                        int64_t heads, int64_t half, int64_t rotated, bool inverse, double* out) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < half; ++j) {
        const int64_t a = (i * heads + h) * 2 * half + j, b = a + half, k = pos[i] * half + j;
        if (j >= rotated) {
          out[a] = x[a], out[b] = x[b];
          continue;
        }
        const double c = cos[k], s = (inverse ? -1.0 : 1.0) * sin[k];
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[b] * c + x[a] * s;
      }
}

// A rotation mixes each pair (x_j, x_{j+h}): on the bf16 path its rounding error is a
// fraction of the pair's norm, not of each element (the floor of every element).
std::vector<double> pair_norms(const double* x, int64_t rows, int64_t half) {
  std::vector<double> norms(static_cast<size_t>(rows * 2 * half));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < half; ++j) {
      const int64_t a = r * 2 * half + j, b = a + half;
      norms[static_cast<size_t>(a)] = norms[static_cast<size_t>(b)] = std::hypot(x[a], x[b]);
    }
  return norms;
}

OpCase rope_case(const RopeShape& s, std::vector<DType> cuda) {
  const Shape xs{s.tokens, s.heads, 2 * s.half}, ts{s.max_pos, s.half};
  std::vector<int32_t> pos(static_cast<size_t>(s.tokens));
  Rng rng(static_cast<uint64_t>(s.tokens * 131 + s.heads * 7 + s.half));
  for (int32_t& p : pos) p = static_cast<int32_t>(rng.below(static_cast<uint64_t>(s.max_pos)));
  OpCase c;
  c.op = "rope";
  c.name = fmt::format("t{}_h{}_d{}_p{}{}{}", s.tokens, s.heads, 2 * s.half, s.max_pos,
                       s.theta == 10000.0 ? "" : fmt::format("_theta{}", s.theta),
                       s.rotated > 0 ? fmt::format("_rot{}", 2 * s.rotated) : "");
  c.tensors = {in("x", xs),
               ints("positions", pos),
               in("cos", ts, Width::wide).filled(table(s, false)),
               in("sin", ts, Width::wide).filled(table(s, true)),
               out("y", xs).copied_from("x"),
               out("back", xs),
               grad_out("dy", "y", xs),
               grad_in("dx", "x", xs).copied_from("dy").judged(Error::forward)};  // a rotation, like y
  c.forward = [](const Tensors& t) {
    ops::rope_apply(process_exec(), t["y"], t["positions"], t["cos"], t["sin"], false);
    copy_tensor(t["y"], t["back"]);
    ops::rope_apply(process_exec(), t["back"], t["positions"], t["cos"], t["sin"], true);
  };
  c.backward = [](const Tensors& t) { ops::rope_apply(process_exec(), t["dx"], t["positions"], t["cos"], t["sin"], true); };
  c.reference = [rotated = s.rotated_pairs()](const Tensors& t) {
    const Tensor& x = t["x"];
    const int64_t n = x.size(0), heads = x.size(1), half = x.size(2) / 2;
    reference_rotation(t.f64("x"), t.i32("positions"), t.f64("cos"), t.f64("sin"), n, heads, half, rotated, false,
                       t.f64("y"));
    // The inverse of the rotation: x again, up to the tables' rounding to fp32 (their
    // cos^2 + sin^2 is 1 within 2^-23; tests/test_ops_properties.cpp checks the identity on
    // f64 tables).
    reference_rotation(t.f64("y"), t.i32("positions"), t.f64("cos"), t.f64("sin"), n, heads, half, rotated, true,
                       t.f64("back"));
  };
  c.magnitudes = [](const Tensors& t, DType precision, Magnitudes& m) {
    const Tensor& x = t["x"];
    const int64_t rows = x.size(0) * x.size(1), half = x.size(2) / 2;
    // Two rotations, each rounded: judged against the pair's norm itself (bf16: two
    // roundings carried through a rotation, <= 2 * 2^-8 = 7.8e-3 of the norm).
    m["back"] = {pair_norms(t.f64("x"), rows, half), true, 1.0};
    if (precision != DType::bf16) return;
    m["y"] = {pair_norms(t.f64("x"), rows, half), true};
    m["dx"] = {pair_norms(t.f64("dy"), rows, half), true};
  };
  c.cuda = std::move(cuda);
  c.cpu = xs.numel() <= kCpuMaxElements;
  c.finite_differences = false;
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

}  // namespace

std::vector<OpCase> rope_cases() {
  std::vector<OpCase> cases;
  // Finite differences: head dims 8 and 6, the usual theta and a small one (large angles).
  for (int64_t half : {4, 3})
    for (double theta : {10000.0, 7.0}) {
      OpCase c = rope_case({11, 3, half, 16, theta}, {});
      c.finite_differences = true;
      cases.push_back(std::move(c));
    }
  // Partial rotary: 4 of 8 dims and 2 of 6 (the passed pairs' gradient is dy itself).
  for (auto [half, rotated] : {std::pair<int64_t, int64_t>{4, 2}, {3, 1}}) {
    OpCase c = rope_case({11, 3, half, 16, 7.0, rotated}, {});
    c.finite_differences = true;
    cases.push_back(std::move(c));
  }
  // GPU: vector path (half a multiple of 8) and scalar path (half 4, 5, 8 of fp32).
  for (const RopeShape& s : {RopeShape{1, 1, 32, 4096}, {37, 3, 64, 4096}, {1000, 4, 64, 4096}, {300, 2, 32, 4096},
                             {37, 3, 4, 4096}, {13, 5, 5, 4096}, {70, 3, 8, 64}})
    cases.push_back(rope_case(s, {DType::f32, DType::bf16}));
  // GPU, partial rotary: a quarter of a 128-dim head (vector path), 2 of 10 (scalar).
  for (const RopeShape& s : {RopeShape{37, 3, 64, 4096, 10000.0, 16}, {13, 5, 5, 4096, 10000.0, 1}})
    cases.push_back(rope_case(s, {DType::f32, DType::bf16}));
  return cases;
}

}  // namespace kiln::op_test
