#include "train/action_schedule.h"

#include "core/phase_scope.h"

namespace kiln {

bool Cadence::crossed(const StepSpan& span) const {
  return (steps > 0 && span.step % steps == 0) ||
         (tokens > 0 && span.tokens_after / tokens != span.tokens_before / tokens);
}

bool Cadence::due(const StepSpan& span) const { return span.last() ? at_last_step : crossed(span); }

void ActionSchedule::add(const char* name, Cadence cadence, Action action) {
  if (cadence.steps <= 0 && cadence.tokens <= 0 && !cadence.at_last_step) return;
  entries_.push_back({name, cadence, std::move(action)});
}

void ActionSchedule::run_due(const StepSpan& span) const {
  for (const Entry& e : entries_)
    if (e.cadence.due(span)) {
      PhaseScope phase(e.name);
      e.action(span);
    }
}

}  // namespace kiln
