// `kiln plot RUN... -o FILE.png|.svg`: the loss (train and validation), learning rate,
// gradient norm and throughput of one or more runs against steps or tokens, overlaid in
// one figure (src/plot/).
#include "cli/commands.h"
#include "core/error.h"
#include "core/printable.h"
#include "plot/plot.h"

#include <fmt/format.h>

#include <charconv>

namespace kiln::cli {

namespace {

// "1200x800" in pixels; each side within what a figure of four panels needs and a
// cairo image allows.
plot::Size parse_size(const std::string& text) {
  constexpr int kMin = 240, kMax = 8000;  // 8000 x 8000 is 256 MB of pixels
  const auto whole_number = [](std::string_view digits, int& out) {
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
    return error == std::errc() && end == digits.data() + digits.size();
  };
  plot::Size size;
  const size_t cross = text.find_first_of("xX");
  if (cross == std::string::npos || !whole_number(std::string_view(text).substr(0, cross), size.width) ||
      !whole_number(std::string_view(text).substr(cross + 1), size.height))
    fail("plot", "--size {}: expected WIDTHxHEIGHT in pixels, such as 1200x800", printable(text));
  if (size.width < kMin || size.height < kMin || size.width > kMax || size.height > kMax)
    fail("plot", "--size {}: each side must be {} to {} pixels", printable(text), kMin, kMax);
  return size;
}

}  // namespace

void add_plot_command(CLI::App& app) {
  struct Options {
    std::vector<std::string> runs;
    std::string output;
    std::string x = "steps";
    int smooth = 0;
    std::vector<std::string> log_y;
    std::vector<std::string> labels;
    std::string size = "1200x800";
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("plot", "loss, learning rate, gradient norm and throughput of runs, as PNG or SVG");
  cmd->add_option("runs", o->runs, "run directories (train.out_dir) or metrics .jsonl files, overlaid")->required();
  cmd->add_option("-o,--output", o->output, "the image: FILE.png or FILE.svg")->required();
  cmd->add_option("--x", o->x, "the x axis: steps, or tokens trained")
      ->capture_default_str()
      ->check(CLI::IsMember({"steps", "tokens"}));
  cmd->add_option("--smooth", o->smooth, "also draw the train loss as a moving average over N log records")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--log-y", o->log_y, "a logarithmic y axis for this panel (repeatable)")
      ->check(CLI::IsMember(std::vector<std::string>(std::begin(plot::kPanelNames), std::end(plot::kPanelNames))));
  cmd->add_option("--label", o->labels, "a run's name in the legend, one per run in order (default: its directory)");
  cmd->add_option("--size", o->size, "WIDTHxHEIGHT in pixels (an SVG's too)")->capture_default_str();
  cmd->callback([o] {
    plot::PlotOptions options;
    options.size = parse_size(o->size);
    options.figure.x = o->x == "tokens" ? plot::XAxis::tokens : plot::XAxis::steps;
    options.figure.smooth = o->smooth;
    options.figure.log_y = o->log_y;
    options.figure.labels = o->labels;
    plot::plot_runs(o->runs, o->output, options);
    fmt::print("plot: {} run{} drawn into {} ({}x{})\n", o->runs.size(), o->runs.size() == 1 ? "" : "s", o->output,
               options.size.width, options.size.height);
  });
}

}  // namespace kiln::cli
