#include "nn/parameter.h"

namespace kiln {

Shape Parameter::shape() const {
  const Shape& base = value_base_->shape();
  if (base.rank() == 1) return Shape{row_end_ - row_begin_};
  return Shape{row_end_ - row_begin_, base[1]};
}

void BuildContext::parameter(Tensor& value, Tensor& grad, const std::string& name, Shape shape, bool decay,
                             Init init) {
  KILN_CHECK(shape.rank() == 1 || shape.rank() == 2, "model", "parameter {} must be 1-D or 2-D", name);
  params.reserve(value, dtype, shape);
  if (training) grads.reserve(grad, dtype, shape);
  parameters.push_back(std::make_unique<Parameter>(name, &value, &grad, 0, shape[0], decay, init));
}

void BuildContext::fused_parameter(Tensor& value, Tensor& grad,
                                   const std::vector<std::pair<std::string, int64_t>>& parts, int64_t cols,
                                   bool decay, Init init) {
  int64_t rows = 0;
  for (const auto& part : parts) rows += part.second;
  const Shape shape = cols > 0 ? Shape{rows, cols} : Shape{rows};  // cols 0: fused 1-D biases
  params.reserve(value, dtype, shape);
  if (training) grads.reserve(grad, dtype, shape);
  int64_t begin = 0;
  for (const auto& [name, count] : parts) {
    parameters.push_back(std::make_unique<Parameter>(name, &value, &grad, begin, begin + count, decay, init));
    begin += count;
  }
}

void BuildContext::saved(Tensor& t, Shape shape) { activations.reserve(t, dtype, shape); }

void BuildContext::buffer(Tensor& t, Shape shape, DType type) { activations.reserve(t, type, shape); }

}  // namespace kiln
