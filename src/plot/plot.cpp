#include "plot/plot.h"

#include "io/durable_io.h"

#include <algorithm>

namespace kiln::plot {

void plot_runs(const std::vector<std::string>& runs, const std::string& output, const PlotOptions& options) {
  const ImageFormat format = image_format_of(output);  // before reading: a wrong name fails at once
  std::vector<RunMetrics> metrics;
  for (const std::string& run : runs) metrics.push_back(read_run_metrics(run));
  std::vector<std::string> labels;
  for (const RunMetrics& m : metrics) labels.push_back(m.label);
  for (size_t i = 0; i < metrics.size(); ++i)
    if (std::count(labels.begin(), labels.end(), labels[i]) > 1) metrics[i].label = runs[i];
  const Figure figure = build_figure(metrics, options.figure);
  io::replace_file_atomically(output, render_figure(figure, options.size, format), "plot");
}

void write_run_plot(const std::string& metrics_file, const std::string& label, const std::string& output) {
  RunMetrics metrics = read_metrics_file(metrics_file);
  metrics.label = label;
  const Figure figure = build_figure({metrics}, FigureOptions{});
  io::replace_file_atomically(output, render_figure(figure, Size{}, image_format_of(output)), "plot");
}

}  // namespace kiln::plot
