#include "op_table/op_case.h"

#include "core/error.h"

namespace kiln::op_test {

const Tensor& Tensors::operator[](const std::string& name) const {
  const auto it = tensors_.find(name);
  KILN_CHECK(it != tensors_.end(), "op_test", "the case has no tensor '{}'", name);
  return it->second;
}

Tensor Tensors::get(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? Tensor() : it->second;
}

const std::vector<int32_t>& Tensors::ints(const std::string& name) const {
  const auto it = ints_.find(name);
  KILN_CHECK(it != ints_.end() && it->second != nullptr, "op_test", "'{}' is not an i32 tensor of the case", name);
  return *it->second;
}

void Tensors::bind(const std::string& name, const Tensor& t, const std::vector<int32_t>* ints) {
  tensors_[name] = t;
  if (ints) ints_[name] = ints;
}

const TensorSpec* OpCase::find(const std::string& name) const {
  for (const TensorSpec& s : tensors)
    if (s.name == name) return &s;
  return nullptr;
}

test::GradCheckOptions fd_options(double tolerance, double step) {
  test::GradCheckOptions o;
  o.order = 4;
  o.tol = tolerance;
  o.floor = 1e-4;
  o.eps = step;
  return o;
}

}  // namespace kiln::op_test
