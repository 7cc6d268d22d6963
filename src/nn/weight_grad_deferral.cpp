#include "nn/weight_grad_deferral.h"

#include "core/error.h"

namespace kiln {

namespace {
std::unique_ptr<OwnedTensor> copy_of(const Tensor& t) {
  auto copy = std::make_unique<OwnedTensor>(t.dtype(), t.device(), t.shape());
  copy_tensor(t, copy->tensor);
  return copy;
}
}  // namespace

void WeightGradDeferral::begin() {
  KILN_CHECK(!recording_, "pipeline", "a deferred backward began inside another");
  recording_ = true;
  pending_.clear();
}

std::vector<WeightGradDeferral::Pending> WeightGradDeferral::take() {
  recording_ = false;
  return std::move(pending_);
}

void WeightGradDeferral::record(const LinearLayer& layer, const Tensor& x, const Tensor& dy) {
  Pending p{layer, nullptr, copy_of(dy), x};
  if (layer.weight_grad_reads_x(dy.size(0))) {
    p.x_copy = copy_of(x);
    p.x = p.x_copy->tensor;
  }
  pending_.push_back(std::move(p));
}

void WeightGradDeferral::run(const std::vector<Pending>& pending) {
  for (const Pending& p : pending) p.layer.weight_grad(p.x, p.dy->tensor);
}

}  // namespace kiln
