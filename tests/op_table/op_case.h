// The op test table: each op declares its cases as data (shapes x dtypes x flags), one
// runner checks them all (ops/op_checks.h), in the manner of ggml's test-backend-ops.
//
// A case names its tensors (inputs, outputs, output gradients, input gradients) with
// shapes and how their dtype follows the precision of a run, and gives three functions:
// `forward` and `backward` call the op's front end on the tensors of one run (any device,
// any precision), and `reference` computes the forward outputs naively in fp64 on the
// host. From that the runner derives every check:
//   (a) the CPU f64 forward against `reference`, and the CPU f32 run against the f64 one;
//   (b) the f64 backward against central finite differences of L = sum(out * dout) over
//       the outputs that have a gradient spec;
//   (c) on a GPU, the CUDA run (f32, and bf16 mixed precision where the case lists it)
//       against the CPU f64 run on identical input values, twice for the bits.
// Outputs are poisoned (NaN bytes) before every run, device tensors sit between poisoned
// guard elements, and NaN/Inf never pass. Tolerances come from one table by dtype
// (op_compare.h). Adding an op = a function returning its cases (a few rows) plus its
// naive reference, and one row in op_table.cpp.
#pragma once

#include "core/tensor.h"
#include "grad_check.h"
#include "op_table/op_compare.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace kiln::op_test {

// How a tensor's dtype follows the precision of a run (f64 on the CPU reference run,
// f32, or bf16 on the GPU's mixed path).
enum class Width {
  narrow,  // the run's precision: f64, f32 or bf16 (activations on the mixed path)
  wide,    // f64 on the reference run, else f32 (gains, statistics, the fp32 residual)
  f64,     // always f64 (loss row statistics and sums); compared at f32 tolerance off the reference
  i32,     // integers, the same values in every run
};

enum class Role {
  input,        // read by forward and backward (random N(offset, scale), `fill`, or `ints`)
  output,       // written by forward (= unless `init`), compared
  grad_output,  // read by backward: the gradient of forward output `of` (random, or `fill`)
  grad_input,   // written by backward: the gradient of input `of` (=, or += onto `init`)
  scratch,      // workspace an op needs (poisoned, never compared)
};

// What an output holds before the op runs.
enum class Init {
  poison,  // NaN bytes: an element the op leaves unwritten fails
  random,  // random values: the op accumulates (+=); gradients are judged net of them
  copy,    // the values of tensor `from` as it is then (an op that works in place on an
           // input's copy; specs reset in their order, so an earlier output's reset state too)
};

enum class Check {
  close,  // relative error within the tolerance of the output's dtype (op_compare.h)
  exact,  // the same values (copies, gathers, conversions)
  none,   // not compared (written for another check, e.g. same_bits)
};

// Which column of the tolerance table judges an output: by default forward outputs the
// forward one, input gradients the backward one (row dots that cancel, long column sums).
enum class Error { by_role, forward, backward };

struct TensorSpec {
  std::string name;
  Role role = Role::input;
  Shape shape;
  Width width = Width::narrow;
  std::string of;                 // grad_output / grad_input: the tensor it is the gradient of
  Init init = Init::poison;       // outputs and input gradients
  std::string from;               // Init::copy: the input copied in before each run
  double scale = 1.0, offset = 0.0;  // random values: N(offset, scale^2)
  std::vector<int32_t> ints;      // Width::i32 values
  std::function<void(double* values, int64_t n)> fill;  // fixed values instead of random
  Check check = Check::close;
  Error error = Error::by_role;
  double tolerance = -1;          // > 0: overrides the table for this output
  bool host = false;              // lives on the CPU in every run (scalars an op returns)
  bool in_backward = false;       // Role::output written by backward (reset before it runs)

  // Modifiers for the table rows: in("x", {3, 4}).scaled(2.0).
  TensorSpec& scaled(double s, double o = 0.0) {
    scale = s;
    offset = o;
    return *this;
  }
  TensorSpec& filled(std::function<void(double*, int64_t)> f) {
    fill = std::move(f);
    return *this;
  }
  TensorSpec& accumulating() {
    init = Init::random;
    return *this;
  }
  TensorSpec& copied_from(std::string input) {
    init = Init::copy;
    from = std::move(input);
    return *this;
  }
  TensorSpec& exact() {
    check = Check::exact;
    return *this;
  }
  TensorSpec& unchecked() {
    check = Check::none;
    return *this;
  }
  TensorSpec& judged(Error e) {
    error = e;
    return *this;
  }
  TensorSpec& within(double t) {
    tolerance = t;
    return *this;
  }
  TensorSpec& on_host() {
    host = true;
    return *this;
  }
  TensorSpec& by_backward() {
    in_backward = true;
    return *this;
  }
};

inline TensorSpec in(std::string name, Shape shape, Width w = Width::narrow) {
  TensorSpec s;
  s.name = std::move(name), s.role = Role::input, s.shape = shape, s.width = w;
  return s;
}
inline TensorSpec out(std::string name, Shape shape, Width w = Width::narrow) {
  TensorSpec s = in(std::move(name), shape, w);
  s.role = Role::output;
  return s;
}
// The gradient of forward output `of` that backward reads.
inline TensorSpec grad_out(std::string name, std::string of, Shape shape, Width w = Width::narrow) {
  TensorSpec s = in(std::move(name), shape, w);
  s.role = Role::grad_output, s.of = std::move(of);
  return s;
}
// The gradient of input `of` that backward writes.
inline TensorSpec grad_in(std::string name, std::string of, Shape shape, Width w = Width::narrow) {
  TensorSpec s = in(std::move(name), shape, w);
  s.role = Role::grad_input, s.of = std::move(of);
  return s;
}
inline TensorSpec ints(std::string name, std::vector<int32_t> values) {
  TensorSpec s = in(std::move(name), Shape{static_cast<int64_t>(values.size())}, Width::i32);
  s.ints = std::move(values);
  return s;
}
inline TensorSpec scratch(std::string name, Shape shape, Width w = Width::narrow) {
  TensorSpec s = in(std::move(name), shape, w);
  s.role = Role::scratch, s.check = Check::none;
  return s;
}

// The tensors of one run, by name.
class Tensors {
 public:
  const Tensor& operator[](const std::string& name) const;
  // The tensor, or an undefined one when the case has none of that name.
  Tensor get(const std::string& name) const;
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Host f64 data (the reference run).
  double* f64(const std::string& name) const { return (*this)[name].data<double>(); }
  const int32_t* i32(const std::string& name) const { return (*this)[name].data<int32_t>(); }
  // The integer values of an i32 tensor as the case declared them (on any device).
  const std::vector<int32_t>& ints(const std::string& name) const;

  DType precision = DType::f64;  // f64, f32 or bf16
  Device device = Device::cpu;

  void bind(const std::string& name, const Tensor& t, const std::vector<int32_t>* ints = nullptr);

 private:
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, const std::vector<int32_t>*> ints_;
};

// A per-element scale for the error floor of one output: the size of the terms that make
// each element (a sum's sum of |terms|, a rotation's pair norm), when it exceeds the value.
struct Magnitude {
  std::vector<double> values;
  bool per_element = false;  // false: the largest value sets one floor for the output
  double floor_fraction = kFloorFraction;  // the floor is this fraction of the magnitude
};
using Magnitudes = std::map<std::string, Magnitude>;

using RunFn = std::function<void(const Tensors&)>;

struct OpCase {
  std::string op;    // the table row, e.g. "rms_norm"
  std::string name;  // the case within it, e.g. "r37_c7_gain" (letters, digits, _)
  std::vector<TensorSpec> tensors;
  RunFn forward;
  RunFn backward;   // null: the op has no backward
  RunFn reference;  // naive fp64 forward on host tensors: reads inputs, writes outputs
  // Optional: floors for outputs whose terms exceed their values, from the f64 run of a
  // comparison with a run of `precision`.
  std::function<void(const Tensors& f64_run, DType precision, Magnitudes&)> magnitudes;
  // Optional: the op's own properties, checked on every run's results (host f64 copies;
  // i32 tensors stay i32; "<name>.start" holds what an accumulating tensor started from;
  // `precision` and `device` say which run).
  std::function<void(const Tensors& run)> invariants;
  // Pairs (a, b): a must hold b's values rounded to a's dtype, bit for bit, in every run.
  std::vector<std::pair<std::string, std::string>> same_bits;

  std::vector<DType> cuda = {DType::f32};  // GPU precisions: f32 and/or bf16; empty: none
  bool cpu = true;           // the CPU checks (a) and (b); false for GPU-only launch shapes
  bool finite_differences = true;
  test::GradCheckOptions fd;  // step and tolerance of (b)
  bool deterministic = true;  // two GPU runs give the same bits
  bool unaligned = false;     // tensors start one element past a 16-byte boundary

  std::string id() const { return op + "_" + name; }
  const TensorSpec* find(const std::string& name) const;
};

// The options of (b) for most ops: the five-point stencil (see grad_check.h), relative
// error floor 1e-4.
test::GradCheckOptions fd_options(double tolerance, double step);

}  // namespace kiln::op_test
