#include "train/stage_gradients.h"

#include "core/error.h"
#include "core/phase_scope.h"
#include "ops/elementwise/elementwise.h"

#include <vector>

namespace kiln {

namespace {

// The tag of the table's gradient between the first and the last stage: beyond every
// pipeline transfer's (train/pipeline_engine.h: micro-batch x stages x 2), which are all
// consumed before the step's gradients are reduced.
constexpr int kTableTag = 1 << 29;

}  // namespace

StageGradients::StageGradients(Model& model, dist::Communicator& pipeline, int first, int last,
                               dist::Communicator* replicas, bool counted)
    : model_(model), pipeline_(pipeline), replicas_(replicas), counted_(counted) {
  const int me = pipeline.rank();
  if (!model.config().tie_embeddings || first == last || (me != first && me != last)) return;
  KILN_CHECK(model.backbone().has_embedding(), "pipeline",
             "pipeline rank {} holds the {} stage of a tied head but no embedding table", me,
             me == first ? "first" : "last");
  table_ = &model.backbone().embedding();
  peer_ = me == first ? last : first;
  counts_table_ = me == first;
}

void StageGradients::reduce_over_replicas() {
  if (!replicas_) return;
  KILN_PHASE("stage gradients over replicas");
  const Tensor grads = model_.all_gradients();
  replicas_->all_reduce(grads.raw(), grads.numel(), grads.dtype(), dist::ReduceOp::sum, "gradients");
  reduce_statistics();
}

void StageGradients::reduce_statistics() {
  if (!replicas_) return;
  for (const StepStatistic& s : model_.step_statistics())
    replicas_->all_reduce(s.tensor->raw(), s.tensor->numel(), s.tensor->dtype(),
                          s.reduction == StepReduction::sum ? dist::ReduceOp::sum : dist::ReduceOp::max_unsigned,
                          "step statistics");
}

void StageGradients::exchange_table() {
  if (table_ == nullptr) return;
  KILN_PHASE("tied table gradient");
  const Tensor grad = table_->grad();
  KILN_CHECK(grad.device() == Device::cpu, "pipeline", "the tied table's gradient exchange runs on host memory");
  std::vector<unsigned char> theirs(grad.nbytes());
  // Sends are posted (an isend: dist/communicator.h), so both ranks send first.
  pipeline_.send(grad.raw(), static_cast<int64_t>(grad.nbytes()), peer_, kTableTag, "tied table gradient");
  pipeline_.recv(theirs.data(), static_cast<int64_t>(theirs.size()), peer_, kTableTag, "tied table gradient");
  ops::add_inplace(model_.exec(), grad, Tensor(theirs.data(), grad.dtype(), Device::cpu, grad.shape()));
}

double StageGradients::sum_of_squares() const {
  if (!counted_) return 0;
  const Tensor all = model_.all_gradients();
  if (counts_table_) return ops::sum_squares(model_.exec(), all);
  // The arena but the table's range.
  const Tensor grad = table_->grad();
  const auto begin = static_cast<int64_t>((static_cast<const unsigned char*>(grad.raw()) -
                                           static_cast<const unsigned char*>(all.raw())) /
                                          dtype_size(all.dtype()));
  const int64_t end = begin + grad.numel();
  double squares = 0;
  if (begin > 0) squares += ops::sum_squares(model_.exec(), all.rows(0, begin));
  if (end < all.numel()) squares += ops::sum_squares(model_.exec(), all.rows(end, all.numel()));
  return squares;
}

}  // namespace kiln
