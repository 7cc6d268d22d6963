// Axis ranges and their tick marks for `kiln plot`: ticks at "nice" numbers (1, 2 or 5
// times a power of ten) so a reader can interpolate between gridlines, and labels short
// enough for a small panel: SI prefixes for large values (1.5k, 3M), plain decimals in
// between (0.25, 3.5), exponents for small ones (learning rates: 3e-4).
#pragma once

#include <string>
#include <vector>

namespace kiln::plot {

struct Axis {
  double lo = 0, hi = 1;      // the range drawn (hi > lo; for a log axis both > 0)
  std::vector<double> ticks;  // inside [lo, hi], ascending
  bool log = false;
  // The ticks are multiples of this; 0 on a log axis whose ticks are 1..9 times a power
  // of ten, each labelled with the precision of its own power.
  double tick_step = 0;
};

// The step between ticks, 1, 2 or 5 x 10^k, giving about `target` intervals over `span`
// (> 0).
double nice_step(double span, int target);

// A linear axis over the data's [lo, hi] (lo <= hi) with ticks every nice_step(hi - lo,
// target); `to_whole_ticks` widens it outwards to the ticks around the data (a y axis),
// else it ends at the data (an x axis: the runs reach the right edge). An empty span (one
// value) is widened around it.
Axis linear_axis(double lo, double hi, int target = 5, bool to_whole_ticks = true);

// A log axis over [lo, hi] (0 < lo <= hi), a little wider than the data; ticks at the
// powers of ten inside it, else at 1, 2 and 5 times them, else at 1..9 times them
// (whichever first gives three), else linear ones (a span too short for a log scale).
Axis log_axis(double lo, double hi);

// One label per tick of `axis`, in one style for the whole axis (what its largest tick
// and its tick step call for), trailing zeros dropped: "0", "500", "1k", "1.5k", "2M";
// "1", "1.5", "2"; "0", "2e-4", "4e-4". Ticks at 1..9 x 10^k (tick_step 0) are each
// labelled on their own: "200", "500", "1k".
std::vector<std::string> tick_labels(const Axis& axis);

// `value` in the style its magnitude and the precision `step` call for (the labels above).
std::string format_tick(double value, double step);

}  // namespace kiln::plot
