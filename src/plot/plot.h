// `kiln plot` end to end: runs' metrics files in, one PNG or SVG out (plot/run_metrics.h
// reads, plot/figure.h decides what to draw, plot/render.h draws). The trainer calls
// write_run_plot at the end of a run.
#pragma once

#include "plot/figure.h"
#include "plot/render.h"

#include <string>
#include <vector>

namespace kiln::plot {

struct PlotOptions {
  FigureOptions figure;
  Size size;
};

// Reads each RUN (a run directory or a metrics file), draws them overlaid and writes the
// image to `output` atomically, its format by its extension. Runs whose names (their
// directories') coincide are labelled by their paths as given instead.
void plot_runs(const std::vector<std::string>& runs, const std::string& output, const PlotOptions& options);

// The figure of one run's metrics file, labelled `label`, as a PNG at `output`.
void write_run_plot(const std::string& metrics_file, const std::string& label, const std::string& output);

}  // namespace kiln::plot
