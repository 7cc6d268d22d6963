// The named scalars a step's objectives add to: the LM head's cross-entropy, logsumexp^2
// and target count today; router losses and multi-token prediction depths next. Each
// objective reserves its slots when it is built; the trainer, the fault guard, the log
// line and metrics.jsonl read them by name through this table, not by position.
//
// A slot holds a sum over a step's target tokens, added micro-batch by micro-batch in
// order: on the host (the op-by-op step) or in device memory (train/device_step.h keeps
// kMaxLossSlots doubles per micro-batch and per step). A reported term's value is its sum
// divided by the step's target tokens. Slot 0 is always the main loss: the value logged
// as "loss", checked by the fault guard, and the one validation reports.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

inline constexpr int kMaxLossSlots = 8;
using LossSlotSums = std::array<double, kMaxLossSlots>;

// The slot sums of one micro-batch (or step), with the LM head's named: it reserves the
// first three slots (the main loss, logsumexp^2, the target count).
struct LossSums {
  LossSlotSums slot{};
  double loss = 0;     // slot 0: the main loss (sum of cross-entropy, nats)
  double z = 0;        // sum of logsumexp^2
  int64_t count = 0;   // tokens with a target
};

struct LossTerm {
  std::string name;       // its key in the log line and metrics.jsonl ("loss", "z", ...)
  bool reported = true;   // false: bookkeeping (the target count), not a value to show
};

class LossTerms {
 public:
  // Reserves consecutive slots, one per term; returns the first. Throws past kMaxLossSlots
  // or on a name taken twice.
  int reserve(const std::vector<LossTerm>& terms);
  const std::vector<LossTerm>& slots() const { return slots_; }
  int find(std::string_view name) const;  // -1 when no such term

 private:
  std::vector<LossTerm> slots_;
};

}  // namespace kiln
