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

double LossTerms::value(int slot, double sum, int64_t targets, int64_t micro_batches) const {
  const bool per_target = slots_[static_cast<size_t>(slot)].per == LossTerm::Per::target;
  return sum / static_cast<double>(per_target ? targets : micro_batches);
}

int LossTerms::find(std::string_view name) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace kiln
