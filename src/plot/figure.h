// What `kiln plot` draws, before any drawing: four panels (loss, learning rate, gradient
// norm, throughput) against steps or tokens, one colour per run, built from the runs'
// metrics (plot/run_metrics.h). plot/render.h turns a Figure into pixels.
#pragma once

#include "plot/run_metrics.h"

#include <string>
#include <utility>
#include <vector>

namespace kiln::plot {

struct Colour {
  double r = 0, g = 0, b = 0;  // each in [0, 1]
  bool operator==(const Colour&) const = default;
};

// The colour of the `index`-th run: Tableau 10, a qualitative palette whose colours stay
// apart for most colour-blind readers; an eleventh run takes the first colour again.
Colour run_colour(size_t index);

enum class XAxis { steps, tokens };

// The panels, by the names --log-y takes.
inline constexpr const char* kPanelNames[] = {"loss", "lr", "grad-norm", "throughput"};

struct FigureOptions {
  XAxis x = XAxis::steps;
  int smooth = 0;                     // > 1: the train loss also as a moving average over this many records
  std::vector<std::string> log_y;     // panels (kPanelNames) with a logarithmic y axis
  std::vector<std::string> labels;    // the runs' legend names, in order (empty: their own)
};

// A polyline; a NaN y breaks it (a gap: a record without that value).
struct Line {
  std::vector<std::pair<double, double>> points;  // (x, y), x ascending
  Colour colour;
  enum class Style { train, train_raw, validation } style = Style::train;
};

// A vertical tick at x on the panel's bottom edge (a skipped update).
struct Mark {
  double x = 0;
  Colour colour;
};

struct Panel {
  std::string name;   // kPanelNames
  std::string title;  // with the unit: "loss (nats per token)"
  std::vector<Line> lines;
  std::vector<Mark> marks;
  bool log_y = false;
  bool y_from_zero = false;  // the y axis starts at 0 (a rate, a norm): proportions read true
};

struct LegendEntry {
  std::string label;
  Colour colour;
};

struct Figure {
  std::string x_label;  // "step" or "tokens"
  std::vector<Panel> panels;
  std::vector<LegendEntry> runs;
  bool has_validation = false, has_smoothing = false, has_marks = false;  // which style keys the legend shows
};

// The figure of `runs` (at least one). Throws "[plot] --log-y: ..." for an unknown panel
// and "[plot] --label: ..." when labels are given for another number of runs.
Figure build_figure(const std::vector<RunMetrics>& runs, const FigureOptions& options);

// The trailing moving average over `window` finite values of `values` (NaN stays NaN and
// is left out of the averages after it).
std::vector<double> moving_average(const std::vector<double>& values, int window);

}  // namespace kiln::plot
