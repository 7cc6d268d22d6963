#include "train/data_parallel.h"

namespace kiln {

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
  const Tensor grads = model_.all_gradients();
  comm.all_reduce(grads.raw(), grads.numel(), grads.dtype(), dist::ReduceOp::sum, "gradients");
  for (const StepStatistic& s : model_.step_statistics())
    comm.all_reduce(s.tensor->raw(), s.tensor->numel(), s.tensor->dtype(),
                    s.reduction == StepReduction::sum ? dist::ReduceOp::sum : dist::ReduceOp::max, "step statistics");
}

void DataParallel::sum(double* values, int64_t count, Device where) {
  dist::Communicator& comm = where == Device::cpu ? group_.host() : group_.device();
  comm.all_reduce(values, count, DType::f64, dist::ReduceOp::sum, "loss sums");
}

}  // namespace kiln
