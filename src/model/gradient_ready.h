// When backward has finished each parameter's gradient, so that data parallelism can
// reduce a gradient while backward still runs (train/gradient_buckets.h). Backward tells
// its progress as numbered events: 0 once the heads and the final norm are done (the LM
// head, multi-token prediction and the final norm: they run before the blocks), L - l
// once block l is (l = L-1 first, so events 1 .. L), and L + 1 once the embedding is (the
// end: a tied head's table gets its last gradient there).
#pragma once

#include <cstdint>
#include <functional>

namespace kiln {

// Called by backward after each event (see above).
using BackwardProgress = std::function<void(int event)>;

// Elements [begin, end) of the flat gradient (Model::all_gradients) that are final after
// backward's event `ready_after`.
struct GradientRange {
  int64_t begin = 0, end = 0;
  int ready_after = 0;
};

}  // namespace kiln
