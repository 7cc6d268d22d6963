#include "op_table/op_checks.h"

#include "core/dtype.h"
#include "op_table/op_compare.h"
#include "op_table/op_run.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kiln::op_test {

namespace {

std::string run_name(const Run& r) {
  return fmt::format("{} {}", device_name(r.device()), dtype_name(r.precision()));
}

bool compared(const TensorSpec& s) {
  return (s.role == Role::output || s.role == Role::grad_input) && s.check != Check::none;
}

bool forward_output(const TensorSpec& s) { return s.role == Role::output && !s.in_backward; }

// The values a run's gradient of `s` contributes: net of the prefill it accumulated onto.
std::vector<double> net_values(const Run& run, const TensorSpec& s, const Values& values) {
  std::vector<double> v = run.read(s.name);
  if (s.init == Init::random) {
    const std::vector<double>& prefill = values.at(s.name);
    for (size_t i = 0; i < v.size(); ++i) v[i] -= prefill[i];
  }
  return v;
}

// The dtype whose tolerance judges s in a run of `precision`: its storage dtype, except
// f64 storage of values computed in a narrower run (loss sums of an f32 kernel).
DType judged_dtype(const TensorSpec& s, DType precision) {
  const DType stored = dtype_in_run(s, precision);
  return stored == DType::f64 && precision != DType::f64 ? DType::f32 : stored;
}

double tolerance_for(const TensorSpec& s, DType judged) {
  if (s.tolerance > 0) return s.tolerance;
  const Tolerance t = tolerance_of(judged);
  const bool backward = s.error == Error::backward || (s.error == Error::by_role && s.role == Role::grad_input);
  return backward ? t.backward : t.forward;
}

// How small elements are judged (op_compare.h's floor).
enum class Floor {
  scale,  // kFloorFraction of the output's scale: the GPU's and the naive reference's rule
  rms,    // the output's root mean square when larger: the CPU's f32 run, judged as the CPU
          // suite always judged it (its f32 arithmetic, exp and BLAS sums, is coarser)
};

double rms_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Compares every checked tensor of `got` against `want` (the f64 run of the same values).
void compare_runs(const OpCase& c, const Run& got, const Run& want, bool forward_only, Floor floor = Floor::scale) {
  Magnitudes magnitudes;
  if (c.magnitudes) c.magnitudes(want.tensors(), got.precision(), magnitudes);
  for (const TensorSpec& s : c.tensors) {
    if (!compared(s) || (forward_only && !forward_output(s))) continue;
    const std::vector<double> a = got.read(s.name), b = want.read(s.name);
    const std::string what = fmt::format("{} {} vs {}: {}", c.id(), run_name(got), run_name(want), s.name);
    if (s.check == Check::exact) {
      const Comparison r = compare_exact(a, b);
      EXPECT_TRUE(r.within(0)) << what << " must be exact: " << r.str();
      continue;
    }
    const auto m = magnitudes.find(s.name);
    const bool per_element = m != magnitudes.end() && m->second.per_element;
    double scale = floor == Floor::rms ? rms_of(b) / kFloorFraction : 0;
    if (m != magnitudes.end() && !per_element)
      for (double v : m->second.values) scale = std::max(scale, v);
    const double tolerance = tolerance_for(s, judged_dtype(s, got.precision()));
    const double fraction = m != magnitudes.end() ? m->second.floor_fraction : kFloorFraction;
    const Comparison r = compare(a, b, scale, per_element ? m->second.values : std::vector<double>{}, fraction);
    EXPECT_TRUE(r.within(tolerance)) << what << ": " << r.str() << ", tolerance " << tolerance;
    ::testing::Test::RecordProperty(fmt::format("{}_{}_max_rel_err", s.name, dtype_name(got.precision())),
                                    fmt::format("{:.3e}", r.worst));
  }
}

// The checks on one run's own results: guards, same_bits pairs, the case's invariants.
void check_run(const OpCase& c, const Run& run) {
  for (const std::string& g : run.written_guards())
    ADD_FAILURE() << c.id() << " " << run_name(run) << ": wrote outside " << g;
  for (const auto& [a, b] : c.same_bits) {
    const DType dtype = dtype_in_run(*c.find(a), run.precision());
    std::vector<double> va = run.read(a), vb = run.read(b);
    // b's values as a's dtype holds them (rounded through f32 for bf16).
    for (double& v : vb)
      v = dtype == DType::bf16   ? bf16_to_float(float_to_bf16(static_cast<float>(v)))
          : dtype == DType::f32 ? static_cast<float>(v)
                                : v;
    const Comparison r = compare_exact(va, vb);
    EXPECT_TRUE(r.within(0)) << c.id() << " " << run_name(run) << ": " << a << " must hold the bits of " << b
                             << ": " << r.str();
  }
  if (c.invariants) {
    std::vector<OwnedTensor> keep;
    SCOPED_TRACE(fmt::format("{} {}: invariants", c.id(), run_name(run)));
    c.invariants(run.host_copies(keep));
  }
}

void run_both(Run& run, const OpCase& c) {
  run.forward();
  if (c.backward) run.backward();
}

}  // namespace

void check_reference(const OpCase& c) {
  const Values values = make_values(c, DType::f32);
  Run ops(c, DType::f64, Device::cpu, values), naive(c, DType::f64, Device::cpu, values);
  run_both(ops, c);  // the backward too: same_bits pairs and invariants may read its results
  naive.reference();
  compare_runs(c, ops, naive, true);
  check_run(c, ops);
}

void check_f32_against_f64(const OpCase& c) {
  const Values values = make_values(c, DType::f32);
  Run f64(c, DType::f64, Device::cpu, values), f32(c, DType::f32, Device::cpu, values);
  run_both(f64, c);
  run_both(f32, c);
  compare_runs(c, f32, f64, false, Floor::rms);
  check_run(c, f32);
  if (c.backward) check_run(c, f64);
}

void check_gradients(const OpCase& c) {
  ASSERT_TRUE(c.backward) << c.id() << " has no backward";
  test::ScopedCpuThreads one_thread(1);  // thousands of tiny forwards
  const Values values = make_values(c, DType::f32);
  Run run(c, DType::f64, Device::cpu, values);
  run.forward();
  run.backward();
  // L = sum over the outputs with a gradient of out * dout.
  std::vector<double> weights;
  std::vector<const TensorSpec*> terms;
  for (const TensorSpec& s : c.tensors)
    if (s.role == Role::grad_output) {
      const TensorSpec* out = c.find(s.of);
      ASSERT_TRUE(out && forward_output(*out)) << c.id() << ": " << s.name << " is the gradient of no forward output";
      terms.push_back(out);
      const std::vector<double>& w = values.at(s.name);
      weights.insert(weights.end(), w.begin(), w.end());
    }
  ASSERT_FALSE(terms.empty()) << c.id() << ": no output has a gradient";
  const test::EvalFn eval = [&](std::vector<double>& out) {
    run.forward();
    out.clear();
    for (const TensorSpec* t : terms) {
      const std::vector<double> v = run.read(t->name);
      out.insert(out.end(), v.begin(), v.end());
    }
  };
  int checked = 0;
  for (const TensorSpec& s : c.tensors) {
    if (s.role != Role::grad_input || s.of.empty()) continue;
    const TensorSpec* x = c.find(s.of);
    ASSERT_TRUE(x && x->role == Role::input) << c.id() << ": " << s.name << " is the gradient of no input";
    const std::vector<double> analytic = net_values(run, s, values);
    const test::GradCheckReport r = test::check_gradient(run.tensors()[x->name], analytic, eval, weights, c.fd);
    EXPECT_TRUE(r.ok()) << c.id() << ": " << s.name << " against finite differences of " << x->name << ": " << r.str();
    ++checked;
  }
  EXPECT_GT(checked, 0) << c.id() << ": no input gradient to check";
}

void check_cuda(const OpCase& c, DType precision) { check_device(c, precision, Device::cuda); }

void check_device(const OpCase& c, DType precision, Device device) {
  const Values values = make_values(c, precision);
  Run ref(c, DType::f64, Device::cpu, values), gpu(c, precision, device, values);
  run_both(ref, c);
  run_both(gpu, c);
  compare_runs(c, gpu, ref, false);
  check_run(c, gpu);
  if (!c.deterministic) return;
  std::map<std::string, std::vector<unsigned char>> first;
  for (const TensorSpec& s : c.tensors)
    if (s.role == Role::output || s.role == Role::grad_input) first[s.name] = gpu.bytes(s.name);
  run_both(gpu, c);
  for (const auto& [name, bytes] : first)
    EXPECT_TRUE(gpu.bytes(name) == bytes) << c.id() << " " << run_name(gpu) << ": " << name
                                          << " differs between two identical runs";
}

}  // namespace kiln::op_test
