#include "nn/parameter.h"

namespace kiln {

ParamName NameScope::operator()(std::string_view kiln_leaf, std::string_view hf_leaf, std::string_view gguf_leaf,
                                GgufLayout layout) const {
  auto join = [](const std::string& prefix, std::string_view leaf) {
    return leaf.empty() ? std::string() : prefix + std::string(leaf);
  };
  return {kiln + std::string(kiln_leaf), join(hf, hf_leaf), join(gguf, gguf_leaf), layout};
}

NameScope NameScope::child(std::string_view kiln_part, std::string_view hf_part, std::string_view gguf_part) const {
  return {kiln + std::string(kiln_part), hf + std::string(hf_part), gguf + std::string(gguf_part)};
}

Shape Parameter::shape() const {
  const Shape& base = value_base_->shape();
  if (base.rank() == 1) return Shape{row_end_ - row_begin_};
  return Shape{row_end_ - row_begin_, base[1]};
}

std::string_view role_name(ParamRole role) {
  switch (role) {
    case ParamRole::embedding: return "embedding";
    case ParamRole::head: return "head";
    case ParamRole::matrix: return "matrix";
    case ParamRole::expert: return "expert";
    case ParamRole::router: return "router";
    case ParamRole::norm: return "norm";
    case ParamRole::bias: return "bias";
    case ParamRole::state: return "state";
  }
  return "?";
}

void BuildContext::parameter(Tensor& value, Tensor& grad, ParamName name, Shape shape, ParamRole role, Init init) {
  KILN_CHECK(shape.rank() == 1 || shape.rank() == 2, "model", "parameter {} must be 1-D or 2-D", name.kiln);
  const Tensor* master = weight(value, shape);
  if (training) grads.reserve(grad, master_dtype, shape);
  parameters.push_back(std::make_unique<Parameter>(std::move(name), master, &grad, 0, shape[0], role, init));
}

const Tensor* BuildContext::weight(Tensor& value, Shape shape) {
  if (!mixed() || shape.rank() != 2) {
    params.reserve(value, master_dtype, shape);
    return &value;
  }
  if (bf16_masters) {  // the compute copy is the master
    params.reserve(value, dtype, shape);
    return &value;
  }
  Tensor& master = compute_weights.masters.emplace_back();
  params.reserve(master, master_dtype, shape);
  compute_weights.arena.reserve(value, dtype, shape);
  compute_weights.pairs.emplace_back(&master, &value);
  return &master;
}

const Tensor& BuildContext::fused_parameter(Tensor& value, Tensor& grad,
                                   const std::vector<std::pair<ParamName, int64_t>>& parts, int64_t cols,
                                   ParamRole role, Init init) {
  int64_t rows = 0;
  for (const auto& part : parts) rows += part.second;
  const Shape shape = cols > 0 ? Shape{rows, cols} : Shape{rows};  // cols 0: fused 1-D biases
  const Tensor* master = weight(value, shape);
  if (training) grads.reserve(grad, master_dtype, shape);
  int64_t begin = 0;
  for (const auto& [name, count] : parts) {
    parameters.push_back(std::make_unique<Parameter>(name, master, &grad, begin, begin + count, role, init));
    begin += count;
  }
  return *master;
}

void BuildContext::state(Tensor& value, ParamName name, Shape shape, Init init) {
  params.reserve(value, master_dtype, shape);
  parameters.push_back(
      std::make_unique<Parameter>(std::move(name), &value, nullptr, 0, shape[0], ParamRole::state, init));
}

void BuildContext::saved(Tensor& t, Shape shape) { activations.reserve(t, dtype, shape); }

void BuildContext::saved_wide(Tensor& t, Shape shape) { activations.reserve(t, master_dtype, shape); }

void BuildContext::saved_buffer(Tensor& t, Shape shape, DType type) { activations.reserve(t, type, shape); }

void BuildContext::buffer(Tensor& t, Shape shape, DType type) {
  (buffers != nullptr ? *buffers : activations).reserve(t, type, shape);
}

void BuildContext::kept_view(Tensor& view) {
  if (kept_views != nullptr) kept_views->push_back(&view);
}

void BuildContext::step_buffer(Tensor& t, Shape shape, DType type) {
  (step_buffers != nullptr ? *step_buffers : activations).reserve(t, type, shape);
}

void BuildContext::step_statistic(Tensor& t, Shape shape, DType type, StepReduction reduction) {
  step_buffer(t, shape, type);
  if (step_statistics != nullptr) step_statistics->push_back({&t, reduction});
}

}  // namespace kiln
