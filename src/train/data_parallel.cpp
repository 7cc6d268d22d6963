#include "train/data_parallel.h"

#include <algorithm>
#include <cmath>

namespace kiln {

DataParallel::~DataParallel() { model_.set_backward_progress({}); }

void DataParallel::before_backward(bool last_micro_batch) {
  if (!bucketed() || !last_micro_batch) {
    model_.set_backward_progress({});
    return;
  }
  if (!buckets_) {  // the arena exists only once the model is allocated
    const Tensor grads = model_.all_gradients();
    const auto elements = static_cast<int64_t>(std::llround(bucket_mb_ * 1024 * 1024)) /
                          static_cast<int64_t>(dtype_size(grads.dtype()));
    buckets_ = std::make_unique<BucketedGradientReduction>(
        group_.device(), grads,
        plan_gradient_buckets(model_.gradient_ranges(), grads.numel(), std::max<int64_t>(1, elements)));
  }
  buckets_->start();
  reducing_ = true;
  BucketedGradientReduction* reduction = buckets_.get();
  model_.set_backward_progress([reduction](int event) { reduction->ready(event); });
}

std::vector<GradientBucket> DataParallel::buckets() const {
  return buckets_ ? buckets_->buckets() : std::vector<GradientBucket>{};
}

void DataParallel::sum_counts(int64_t* counts, int count) {
  group_.host().all_reduce(counts, count, DType::i64, dist::ReduceOp::sum, "step token counts");
}

int DataParallel::agree_on_stop(int local_signal) {
  int32_t signal = local_signal;
  group_.host().all_reduce(&signal, 1, DType::i32, dist::ReduceOp::max, "stop signals");
  return signal;
}

void DataParallel::reduce_gradients() {
  dist::Communicator& comm = group_.device();
  if (reducing_) {
    reducing_ = false;
    model_.set_backward_progress({});
    buckets_->finish();
  } else {
    const Tensor grads = model_.all_gradients();
    comm.all_reduce(grads.raw(), grads.numel(), grads.dtype(), dist::ReduceOp::sum, "gradients");
  }
  for (const StepStatistic& s : model_.step_statistics())
    comm.all_reduce(s.tensor->raw(), s.tensor->numel(), s.tensor->dtype(),
                    s.reduction == StepReduction::sum ? dist::ReduceOp::sum : dist::ReduceOp::max, "step statistics");
}

void DataParallel::sum(double* values, int64_t count, Device where) {
  dist::Communicator& comm = where == Device::cpu ? group_.host() : group_.device();
  comm.all_reduce(values, count, DType::f64, dist::ReduceOp::sum, "loss sums");
}

}  // namespace kiln
