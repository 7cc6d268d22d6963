#include "nn/loss_terms.h"

#include "core/error.h"

namespace kiln {

int LossTerms::reserve(const std::vector<LossTerm>& terms) {
  const int first = static_cast<int>(slots_.size());
  KILN_CHECK(first + static_cast<int>(terms.size()) <= kMaxLossSlots, "model",
             "the objectives need {} loss slots, at most {} exist (LossTerms::kMaxLossSlots)", first + terms.size(),
             kMaxLossSlots);
  for (const LossTerm& t : terms) {
    KILN_CHECK(find(t.name) < 0, "model", "loss term '{}' reserved twice", t.name);
    slots_.push_back(t);
  }
  return first;
}

double LossTerms::value(int slot, const LossSlotSums& sums, int64_t targets, int64_t micro_batches) const {
  const LossTerm& term = slots_[static_cast<size_t>(slot)];
  const double sum = sums[static_cast<size_t>(slot)];
  if (term.count_slot >= 0) return sum / sums[static_cast<size_t>(term.count_slot)];
  if (term.per == LossTerm::Per::step) return sum;  // the micro-batches' shares of the step's value
  return sum / static_cast<double>(term.per == LossTerm::Per::target ? targets : micro_batches);
}

int LossTerms::find(std::string_view name) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace kiln
