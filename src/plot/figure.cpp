#include "plot/figure.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <deque>

namespace kiln::plot {

namespace {

constexpr const char* kWhere = "plot";

// Tableau 10 (Tableau's 2016 default), in its order.
constexpr Colour kPalette[] = {
    {0x4e / 255.0, 0x79 / 255.0, 0xa7 / 255.0}, {0xf2 / 255.0, 0x8e / 255.0, 0x2b / 255.0},
    {0xe1 / 255.0, 0x57 / 255.0, 0x59 / 255.0}, {0x76 / 255.0, 0xb7 / 255.0, 0xb2 / 255.0},
    {0x59 / 255.0, 0xa1 / 255.0, 0x4f / 255.0}, {0xed / 255.0, 0xc9 / 255.0, 0x48 / 255.0},
    {0xb0 / 255.0, 0x7a / 255.0, 0xa1 / 255.0}, {0xff / 255.0, 0x9d / 255.0, 0xa7 / 255.0},
    {0x9c / 255.0, 0x75 / 255.0, 0x5f / 255.0}, {0xba / 255.0, 0xb0 / 255.0, 0xac / 255.0}};

bool is_panel(const std::string& name) {
  return std::find(std::begin(kPanelNames), std::end(kPanelNames), name) != std::end(kPanelNames);
}

Panel panel(const std::string& name, std::string title, const FigureOptions& options, bool from_zero) {
  Panel p;
  p.name = name;
  p.title = std::move(title);
  p.log_y = std::find(options.log_y.begin(), options.log_y.end(), name) != options.log_y.end();
  p.y_from_zero = from_zero && !p.log_y;
  return p;
}

// One line of a train record's value against the figure's x.
template <typename Value>
Line train_line(const RunMetrics& run, XAxis x, Colour colour, Value&& value) {
  Line line;
  line.colour = colour;
  for (const TrainPoint& p : run.train)
    line.points.emplace_back(x == XAxis::steps ? static_cast<double>(p.step) : p.tokens, value(p));
  return line;
}

}  // namespace

Colour run_colour(size_t index) { return kPalette[index % std::size(kPalette)]; }

std::vector<double> moving_average(const std::vector<double>& values, int window) {
  std::vector<double> out;
  out.reserve(values.size());
  std::deque<double> recent;
  double sum = 0;
  for (const double v : values) {
    if (!std::isfinite(v)) {
      out.push_back(std::nan(""));
      continue;
    }
    recent.push_back(v);
    sum += v;
    if (static_cast<int>(recent.size()) > window) sum -= recent.front(), recent.pop_front();
    out.push_back(sum / static_cast<double>(recent.size()));
  }
  return out;
}

Figure build_figure(const std::vector<RunMetrics>& runs, const FigureOptions& options) {
  KILN_CHECK(!runs.empty(), kWhere, "no runs to plot");
  for (const std::string& name : options.log_y)
    KILN_CHECK(is_panel(name), kWhere, "--log-y: unknown panel '{}' (loss, lr, grad-norm or throughput)", name);
  KILN_CHECK(options.labels.empty() || options.labels.size() == runs.size(), kWhere,
             "--label: {} labels for {} runs (one each, in order)", options.labels.size(), runs.size());
  // Document tokens per second where every run has them (the real throughput), else
  // positions for all: two runs in one panel are measured alike.
  const bool documents = std::all_of(runs.begin(), runs.end(), [](const RunMetrics& r) {
    return std::all_of(r.train.begin(), r.train.end(),
                       [](const TrainPoint& p) { return !std::isnan(p.document_tokens_per_second); });
  });

  Figure figure;
  figure.x_label = options.x == XAxis::steps ? "step" : "tokens";
  Panel loss = panel("loss", "loss (nats per token)", options, false);
  Panel lr = panel("lr", "learning rate", options, true);
  Panel grad = panel("grad-norm", "gradient norm (before clipping)", options, true);
  Panel throughput = panel("throughput", documents ? "throughput (document tokens/s)" : "throughput (tokens/s, PAD included)",
                           options, true);
  const auto x_of = [&](const RunMetrics& run, int64_t step) {
    return options.x == XAxis::steps ? static_cast<double>(step) : run.tokens_at(step);
  };
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunMetrics& run = runs[i];
    const Colour colour = run_colour(i);
    figure.runs.push_back({options.labels.empty() ? run.label : options.labels[i], colour});

    Line train = train_line(run, options.x, colour, [](const TrainPoint& p) { return p.loss; });
    if (options.smooth > 1 && !train.points.empty()) {
      std::vector<double> values;
      for (const auto& point : train.points) values.push_back(point.second);
      const std::vector<double> smoothed = moving_average(values, options.smooth);
      Line raw = train;
      raw.style = Line::Style::train_raw;
      loss.lines.push_back(std::move(raw));
      for (size_t k = 0; k < smoothed.size(); ++k) train.points[k].second = smoothed[k];
      figure.has_smoothing = true;
    }
    loss.lines.push_back(std::move(train));
    if (!run.validation.empty()) {
      Line validation;
      validation.colour = colour;
      validation.style = Line::Style::validation;
      for (const ValidationPoint& v : run.validation) validation.points.emplace_back(x_of(run, v.step), v.loss);
      loss.lines.push_back(std::move(validation));
      figure.has_validation = true;
    }
    for (const int64_t step : run.skipped_steps) loss.marks.push_back({x_of(run, step), colour});

    lr.lines.push_back(train_line(run, options.x, colour, [](const TrainPoint& p) { return p.lr; }));
    grad.lines.push_back(train_line(run, options.x, colour, [](const TrainPoint& p) { return p.grad_norm; }));
    throughput.lines.push_back(train_line(run, options.x, colour, [&](const TrainPoint& p) {
      return documents ? p.document_tokens_per_second : p.tokens_per_second;
    }));
  }
  figure.has_marks = !loss.marks.empty();
  figure.panels = {std::move(loss), std::move(lr), std::move(grad), std::move(throughput)};
  return figure;
}

}  // namespace kiln::plot
