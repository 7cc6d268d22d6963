// `kiln plot` (src/plot/): tick marks and their labels, the series read from metrics files
// (resumes, skips, tokens), the figure's panels, PNG and SVG images opened again and looked
// at, one-line errors, and the plot.png a training run leaves in its out_dir.
#include "fault_test_util.h"

#include "plot/plot.h"
#include "plot/ticks.h"

#include <cairo.h>
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <regex>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using namespace plot;

// ---- synthetic metrics files ----

// A train record as train/metrics.h writes it (the log window's tokens and seconds).
std::string train_record(int64_t step, std::string loss, double lr, std::string grad_norm, int64_t tokens,
                         double seconds, int64_t document_tokens = -1) {
  std::string line = fmt::format(
      R"({{"kind":"train","step":{},"loss":{},"lr":{},"grad_norm":{},"tokens":{},"target_tokens":{},)"
      R"("step_seconds":{},"elapsed_seconds":{}}})",
      step, loss, lr, grad_norm, tokens, tokens / 2, seconds, seconds * static_cast<double>(step));
  if (document_tokens >= 0) line.insert(line.size() - 1, fmt::format(R"(,"document_tokens":{})", document_tokens));
  return line + "\n";
}

std::string validation_record(int64_t step, double loss) {
  return fmt::format(R"({{"kind":"validation","step":{},"loss":{},"elapsed_seconds":1.0}})", step, loss) + "\n";
}

// A run of `steps` steps logged every 10, 1000 tokens a step, its loss falling from 5 with
// `rate`, validated every 50 steps.
std::string falling_run(int64_t steps, double rate) {
  std::string text;
  for (int64_t s = 10; s <= steps; s += 10) {
    const double loss = 1.5 + 3.5 * std::exp(-rate * static_cast<double>(s));
    text += train_record(s, fmt::format("{}", loss), 1e-3 * std::min(1.0, static_cast<double>(s) / 50), "0.8",
                         10000, 2.0, 9000);
    if (s % 50 == 0) text += validation_record(s, loss + 0.1);
  }
  return text;
}

class Plot : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir("kiln-plot"); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  // A run directory `name` holding `metrics` as metrics.jsonl.
  std::string run_dir(const std::string& name, const std::string& metrics) {
    const std::string dir = dir_ + "/" + name;
    test::write_file(dir + "/metrics.jsonl", metrics);
    return dir;
  }
  std::string dir_;
};

// ---- ticks ----

TEST(PlotTicks, StepsAreOneTwoOrFiveTimesAPowerOfTen) {
  EXPECT_DOUBLE_EQ(nice_step(10, 5), 2);
  EXPECT_DOUBLE_EQ(nice_step(600, 5), 100);
  EXPECT_DOUBLE_EQ(nice_step(1.23e6, 5), 2e5);
  EXPECT_DOUBLE_EQ(nice_step(3e-3, 5), 5e-4);
  EXPECT_DOUBLE_EQ(nice_step(0.9, 5), 0.2);
}

TEST(PlotTicks, AYAxisWidensToWholeTicksAnXAxisEndsAtTheData) {
  const Axis loss = linear_axis(1.38, 5.6, 5);
  EXPECT_DOUBLE_EQ(loss.lo, 1);
  EXPECT_DOUBLE_EQ(loss.hi, 6);
  EXPECT_EQ(loss.ticks, (std::vector<double>{1, 2, 3, 4, 5, 6}));
  const Axis tokens = linear_axis(0, 1.229e6, 6, false);
  EXPECT_DOUBLE_EQ(tokens.lo, 0);
  EXPECT_DOUBLE_EQ(tokens.hi, 1.229e6);
  EXPECT_EQ(tokens.ticks, (std::vector<double>{0, 2e5, 4e5, 6e5, 8e5, 1e6, 1.2e6}));
  // One value: a range around it, with ticks.
  const Axis flat = linear_axis(3e-4, 3e-4, 5);
  EXPECT_LT(flat.lo, 3e-4);
  EXPECT_GT(flat.hi, 3e-4);
  EXPECT_GE(flat.ticks.size(), 2u);
}

TEST(PlotTicks, LabelsAreShortSiDecimalOrExponent) {
  const auto labels = [](double lo, double hi, int target, bool whole = true) {
    return tick_labels(linear_axis(lo, hi, target, whole));
  };
  EXPECT_EQ(labels(0, 1500, 3), (std::vector<std::string>{"0", "500", "1k", "1.5k"}));
  EXPECT_EQ(labels(0, 4e6, 2), (std::vector<std::string>{"0", "2M", "4M"}));
  EXPECT_EQ(labels(0, 7.3e3, 8), (std::vector<std::string>{"0", "1k", "2k", "3k", "4k", "5k", "6k", "7k", "8k"}));
  EXPECT_EQ(labels(1, 2, 2), (std::vector<std::string>{"1", "1.5", "2"}));
  EXPECT_EQ(labels(0, 0.3, 3), (std::vector<std::string>{"0", "0.1", "0.2", "0.3"}));  // 3 x 0.1 is not 0.3
  EXPECT_EQ(labels(0, 1e-3, 5), (std::vector<std::string>{"0", "2e-4", "4e-4", "6e-4", "8e-4", "1e-3"}));
  EXPECT_EQ(labels(0, 3e-3, 6), (std::vector<std::string>{"0", "5e-4", "1e-3", "1.5e-3", "2e-3", "2.5e-3", "3e-3"}));
  EXPECT_EQ(format_tick(2.5e9, 5e8), "2.5G");
  EXPECT_EQ(format_tick(-1500, 500), "-1.5k");
  EXPECT_EQ(format_tick(9.996e-4, 1e-5), "1e-3");  // the mantissa rounds up to 10
}

TEST(PlotTicks, LogAxesTickPowersOrTheirMultiples) {
  const Axis wide = log_axis(2e-5, 0.3);  // four decades: the powers
  EXPECT_EQ(tick_labels(wide), (std::vector<std::string>{"1e-4", "1e-3", "0.01", "0.1"}));
  EXPECT_TRUE(wide.log);
  EXPECT_LT(wide.lo, 2e-5);
  EXPECT_GT(wide.hi, 0.3);
  const Axis decade = log_axis(0.35, 2.3);  // 1, 2, 5 x 10^k
  EXPECT_EQ(tick_labels(decade), (std::vector<std::string>{"0.5", "1", "2"}));
  const Axis loss = log_axis(1.4, 5.6);  // 1..9 x 10^k
  EXPECT_EQ(tick_labels(loss), (std::vector<std::string>{"2", "3", "4", "5"}));
  const Axis narrow = log_axis(1.40, 1.45);  // too short for a log scale's ticks: linear ones
  ASSERT_GE(narrow.ticks.size(), 2u);
  EXPECT_GT(narrow.tick_step, 0);
  for (const double t : narrow.ticks) EXPECT_TRUE(t >= narrow.lo && t <= narrow.hi) << t;
}

// A constant 5e-324 (the smallest double) made a tick step of 0 and ticks without end
// (bad_alloc at 4.4 GB); 1e17 to 1e17 + 16 a step the tick count could not advance past;
// 1e300 a 289-digit label (issue 38). Each axis now has a few finite, distinct ticks inside
// it, with short labels.
TEST(PlotTicks, DegenerateAndHugeRangesHaveAFewShortTicks) {
  const auto check = [](const Axis& axis, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_TRUE(std::isfinite(axis.lo) && std::isfinite(axis.hi) && axis.lo < axis.hi) << axis.lo << " " << axis.hi;
    EXPECT_GE(axis.ticks.size(), 2u);
    EXPECT_LE(axis.ticks.size(), 20u);
    for (size_t i = 0; i < axis.ticks.size(); ++i) {
      // A tick within a millionth of the span of an end is on it (linear_axis).
      const double slack = (axis.hi - axis.lo) * 1e-6;
      EXPECT_TRUE(std::isfinite(axis.ticks[i]) && axis.ticks[i] >= axis.lo - slack && axis.ticks[i] <= axis.hi + slack)
          << axis.ticks[i];
      if (i > 0) EXPECT_LT(axis.ticks[i - 1], axis.ticks[i]);
    }
    for (const std::string& label : tick_labels(axis)) EXPECT_LE(label.size(), 10u) << label;
  };
  const std::pair<double, double> ranges[] = {{5e-324, 5e-324}, {0, 5e-324},      {1e17, 1e17 + 16},
                                              {1e300, 1e300},   {0, 1e300},       {-1e308, 1e308},
                                              {1.7e308, 1.79e308}, {-1.79e308, 1.79e308}, {3, 3 + 1e-12}};
  for (const auto& [lo, hi] : ranges)
    for (const bool whole : {true, false}) check(linear_axis(lo, hi, 5, whole), fmt::format("{} {} {}", lo, hi, whole));
  const std::pair<double, double> positive[] = {{5e-324, 5e-324}, {5e-324, 1}, {1e-300, 1e300}, {1e300, 1.7e308}};
  for (const auto& [lo, hi] : positive) check(log_axis(lo, hi), fmt::format("log {} {}", lo, hi));
  EXPECT_EQ(tick_labels(linear_axis(0, 1e300, 5)), (std::vector<std::string>{"0", "2e299", "4e299", "6e299", "8e299", "1e300"}));
}

// ---- series ----

TEST_F(Plot, TrainRecordsSumTheirWindowsIntoTokensAndRates) {
  const std::string text = train_record(10, "5.0", 1e-4, "2.0", 10240, 2.0, 9000) +
                           validation_record(10, 4.9) + train_record(20, "4.0", 2e-4, "1.5", 10240, 4.0, 10000) +
                           validation_record(15, 4.5);
  const RunMetrics run = parse_metrics(text, "m.jsonl");
  ASSERT_EQ(run.train.size(), 2u);
  EXPECT_EQ(run.train[1].step, 20);
  EXPECT_DOUBLE_EQ(run.train[0].tokens, 10240);
  EXPECT_DOUBLE_EQ(run.train[1].tokens, 20480);
  EXPECT_DOUBLE_EQ(run.train[1].loss, 4.0);
  EXPECT_DOUBLE_EQ(run.train[1].lr, 2e-4);
  EXPECT_DOUBLE_EQ(run.train[1].grad_norm, 1.5);
  EXPECT_DOUBLE_EQ(run.train[0].tokens_per_second, 5120);
  EXPECT_DOUBLE_EQ(run.train[1].document_tokens_per_second, 2500);
  ASSERT_EQ(run.validation.size(), 2u);
  EXPECT_DOUBLE_EQ(run.validation[0].tokens, 10240);
  EXPECT_DOUBLE_EQ(run.validation[1].tokens, 15360);  // between the records, 1024 tokens a step
  EXPECT_DOUBLE_EQ(run.tokens_at(5), 5120);           // before the first: from step 0
  EXPECT_DOUBLE_EQ(run.tokens_at(30), 30720);         // after the last: at its rate
}

TEST_F(Plot, AResumeContinuesTheFileAndASkipIsAGap) {
  // Steps 10..30 logged, a checkpoint at 20, a resume from it whose records replace 30;
  // step 40's update was skipped (NaN loss and gradient: null) and is the whole window.
  const std::string text = train_record(10, "5.0", 1e-3, "1.0", 1000, 1.0) +
                           train_record(20, "4.0", 1e-3, "1.0", 1000, 1.0) +
                           R"({"kind":"checkpoint","step":20,"path":"c","seconds":0.1})" "\n" +
                           train_record(30, "3.9", 1e-3, "1.0", 1000, 1.0) + validation_record(30, 3.8) +
                           R"({"kind":"resume","step":20,"path":"c"})" "\n" +
                           train_record(30, "3.0", 1e-3, "1.0", 1000, 1.0) +
                           R"({"kind":"skip","step":40,"reason":"loss NaN","loss":null,"grad_norm":null})" "\n" +
                           train_record(40, "null", 1e-3, "null", 1000, 1.0) +
                           R"({"kind":"sample","step":40,"text":"the king"})" "\n" +
                           train_record(50, "2.0", 1e-3, "1.0", 1000, 1.0);
  const RunMetrics run = parse_metrics(text, "m.jsonl");
  ASSERT_EQ(run.train.size(), 5u);
  EXPECT_EQ(run.train[2].step, 30);
  EXPECT_DOUBLE_EQ(run.train[2].loss, 3.0);  // the resumed run's, not the crashed one's
  EXPECT_DOUBLE_EQ(run.train[4].tokens, 5000);
  EXPECT_TRUE(std::isnan(run.train[3].loss));
  EXPECT_TRUE(std::isnan(run.train[3].grad_norm));
  EXPECT_TRUE(run.validation.empty());  // the crashed run's validation went with it
  EXPECT_EQ(run.skipped_steps, (std::vector<int64_t>{40}));
  EXPECT_TRUE(std::isnan(run.train[0].document_tokens_per_second));  // an older file: no document_tokens

  FigureOptions options;
  options.x = XAxis::tokens;
  const Figure figure = build_figure({run}, options);
  EXPECT_EQ(figure.x_label, "tokens");
  EXPECT_EQ(figure.panels[3].title, "throughput (tokens/s, PAD included)");
  const Line& loss = figure.panels[0].lines[0];
  ASSERT_EQ(loss.points.size(), 5u);
  EXPECT_DOUBLE_EQ(loss.points[2].first, 3000);
  EXPECT_TRUE(std::isnan(loss.points[3].second));
  ASSERT_EQ(figure.panels[0].marks.size(), 1u);
  EXPECT_DOUBLE_EQ(figure.panels[0].marks[0].x, 4000);
  EXPECT_TRUE(figure.has_marks);
}

TEST_F(Plot, BadMetricsAreOneLineErrorsNamingFileAndLine) {
  const std::string good = train_record(10, "5.0", 1e-3, "1.0", 1000, 1.0);
  EXPECT_EQ(test::error_of([&] { parse_metrics(good + "{\"kind\": \"tr\n" + good, "runs/a/metrics.jsonl"); }),
            "[plot] runs/a/metrics.jsonl:2: not a JSON object: {\"kind\": \"tr");
  EXPECT_EQ(test::error_of([&] { parse_metrics(good + "[1, 2]\n", "m.jsonl"); }), "[plot] m.jsonl:2: not a JSON object: [1, 2]");
  EXPECT_EQ(test::error_of([&] { parse_metrics(R"({"kind":"train","step":3})" "\n", "m.jsonl"); }),
            "[plot] m.jsonl:1: has no 'loss'");
  EXPECT_EQ(test::error_of([&] { parse_metrics(train_record(10, "\"low\"", 1e-3, "1", 1, 1), "m.jsonl"); }),
            "[plot] m.jsonl:1: loss must be a number, got string \"low\"");
  EXPECT_EQ(test::error_of([&] { parse_metrics(good + train_record(5, "4", 1e-3, "1", 1, 1), "m.jsonl"); }),
            "[plot] m.jsonl:2: step 5 follows step 10 with no resume record between: two runs' records in one file?");
  EXPECT_EQ(test::error_of([&] { parse_metrics("", "m.jsonl"); }), "[plot] m.jsonl: no train or validation records");
  EXPECT_EQ(test::error_of([&] { parse_metrics(R"({"kind":"resume","step":3,"path":"c"})" "\n", "m.jsonl"); }),
            "[plot] m.jsonl: no train or validation records");
  // A last line without its newline is a record being written (or torn): left out.
  EXPECT_EQ(parse_metrics(good + "{\"kind\": \"tr", "m.jsonl").train.size(), 1u);
}

TEST_F(Plot, ARunIsItsDirectoryOrItsMetricsFile) {
  const std::string a = run_dir("lr-3e-3", falling_run(100, 0.02));
  EXPECT_EQ(metrics_file_of(a), a + "/metrics.jsonl");
  EXPECT_EQ(metrics_file_of(a + "/metrics.jsonl"), a + "/metrics.jsonl");
  EXPECT_EQ(run_label(a), "lr-3e-3");
  EXPECT_EQ(run_label(a + "/"), "lr-3e-3");
  EXPECT_EQ(run_label(a + "/metrics.jsonl"), "lr-3e-3");
  test::write_file(dir_ + "/sweep-7.jsonl", falling_run(50, 0.02));
  EXPECT_EQ(run_label(dir_ + "/sweep-7.jsonl"), "sweep-7");
  // The run's config.toml names its metrics file (log.metrics_file).
  const std::string b = dir_ + "/b";
  test::write_file(b + "/config.toml", "[train]\nsteps = 10\n\n[log]\nevery = 10\nmetrics_file = \"log.jsonl\"\n");
  test::write_file(b + "/log.jsonl", falling_run(50, 0.02));
  EXPECT_EQ(metrics_file_of(b), b + "/log.jsonl");
  EXPECT_EQ(read_run_metrics(b).train.size(), 5u);

  EXPECT_EQ(test::error_of([&] { metrics_file_of(dir_ + "/nothing"); }),
            fmt::format("[plot] {}/nothing: no such run directory or metrics file", dir_));
  // A metrics file linked to a device would be read without end (a test's /dev/full).
  fs::create_directories(dir_ + "/device");
  fs::create_symlink("/dev/zero", dir_ + "/device/metrics.jsonl");
  EXPECT_EQ(test::error_of([&] { read_run_metrics(dir_ + "/device"); }),
            fmt::format("[plot] {}/device/metrics.jsonl: not a regular file", dir_));
  fs::create_directories(dir_ + "/empty");
  EXPECT_EQ(test::error_of([&] { metrics_file_of(dir_ + "/empty"); }),
            fmt::format("[plot] {0}/empty: no metrics file ({0}/empty/metrics.jsonl not found): is it a run's "
                        "train.out_dir?",
                        dir_));
}

// ---- the figure ----

TEST_F(Plot, TheFigureHasFourPanelsOneColourPerRun) {
  const RunMetrics a = parse_metrics(falling_run(100, 0.05), "a.jsonl"), b = parse_metrics(falling_run(60, 0.02), "b");
  FigureOptions options;
  options.smooth = 3;
  options.log_y = {"loss"};
  options.labels = {"fast", "slow"};
  const Figure figure = build_figure({a, b}, options);
  ASSERT_EQ(figure.panels.size(), 4u);
  EXPECT_EQ(figure.panels[0].name, "loss");
  EXPECT_TRUE(figure.panels[0].log_y);
  EXPECT_FALSE(figure.panels[1].log_y);
  EXPECT_TRUE(figure.panels[1].y_from_zero);
  EXPECT_EQ(figure.panels[3].title, "throughput (document tokens/s)");
  EXPECT_EQ(figure.x_label, "step");
  ASSERT_EQ(figure.runs.size(), 2u);
  EXPECT_EQ(figure.runs[1].label, "slow");
  EXPECT_EQ(figure.runs[0].colour, run_colour(0));
  EXPECT_FALSE(run_colour(0) == run_colour(1));
  // Per run: the raw train loss, its moving average, the validation.
  ASSERT_EQ(figure.panels[0].lines.size(), 6u);
  EXPECT_EQ(figure.panels[0].lines[0].style, Line::Style::train_raw);
  EXPECT_EQ(figure.panels[0].lines[1].style, Line::Style::train);
  EXPECT_EQ(figure.panels[0].lines[2].style, Line::Style::validation);
  EXPECT_EQ(figure.panels[0].lines[3].colour, run_colour(1));
  EXPECT_TRUE(figure.has_smoothing && figure.has_validation && !figure.has_marks);
  EXPECT_DOUBLE_EQ(figure.panels[3].lines[1].points[0].second, 4500);  // 9000 documents' tokens in 2 s

  options.log_y = {"gradnorm"};
  EXPECT_EQ(test::error_of([&] { build_figure({a}, options); }),
            "[plot] --log-y: unknown panel 'gradnorm' (loss, lr, grad-norm or throughput)");
  options.log_y = {};
  EXPECT_EQ(test::error_of([&] { build_figure({a}, options); }), "[plot] --label: 2 labels for 1 runs (one each, in order)");
}

TEST(PlotFigure, TheMovingAverageTrailsAndSkipsGaps) {
  const double nan = std::nan("");
  const std::vector<double> average = moving_average({1, 3, nan, 5, 7}, 2);
  ASSERT_EQ(average.size(), 5u);
  EXPECT_DOUBLE_EQ(average[0], 1);
  EXPECT_DOUBLE_EQ(average[1], 2);
  EXPECT_TRUE(std::isnan(average[2]));
  EXPECT_DOUBLE_EQ(average[3], 4);  // 3 and 5: the gap is left out
  EXPECT_DOUBLE_EQ(average[4], 6);
}

// ---- images ----

struct Image {
  int width = 0, height = 0;
  std::vector<uint32_t> pixels;  // 0x00RRGGBB, row by row
  uint32_t at(int x, int y) const { return pixels[static_cast<size_t>(y) * width + x] & 0xffffff; }
};

// The PNG at `path` through cairo's own reader.
Image open_png(const std::string& path) {
  cairo_surface_t* surface = cairo_image_surface_create_from_png(path.c_str());
  Image image;
  if (cairo_surface_status(surface) == CAIRO_STATUS_SUCCESS) {
    cairo_surface_flush(surface);
    image.width = cairo_image_surface_get_width(surface);
    image.height = cairo_image_surface_get_height(surface);
    const int stride = cairo_image_surface_get_stride(surface);
    const unsigned char* data = cairo_image_surface_get_data(surface);
    for (int y = 0; y < image.height; ++y)
      for (int x = 0; x < image.width; ++x)
        image.pixels.push_back(*reinterpret_cast<const uint32_t*>(data + static_cast<size_t>(y) * stride + 4 * x));
  }
  cairo_surface_destroy(surface);
  return image;
}

uint32_t rgb_of(Colour c) {
  const auto byte = [](double v) { return static_cast<uint32_t>(std::lround(v * 255)); };
  return byte(c.r) << 16 | byte(c.g) << 8 | byte(c.b);
}

bool near(uint32_t a, uint32_t b, int tolerance = 6) {
  for (int shift : {0, 8, 16})
    if (std::abs(static_cast<int>((a >> shift) & 0xff) - static_cast<int>((b >> shift) & 0xff)) > tolerance) return false;
  return true;
}

// Pixels of colour `c` inside `area`.
int64_t count_colour(const Image& image, const Rect& area, uint32_t c) {
  int64_t n = 0;
  for (int y = static_cast<int>(area.y); y < static_cast<int>(area.y + area.height); ++y)
    for (int x = static_cast<int>(area.x); x < static_cast<int>(area.x + area.width); ++x) n += near(image.at(x, y), c);
  return n;
}

TEST_F(Plot, APngOfTwoRunsShowsBothInTheLossPanel) {
  const std::string a = run_dir("fast", falling_run(300, 0.03)), b = run_dir("slow", falling_run(200, 0.01));
  PlotOptions options;
  options.size = {900, 600};
  const std::string two = dir_ + "/two.png", one = dir_ + "/one.png";
  plot_runs({a, b}, two, options);
  plot_runs({a}, one, options);

  const Image image = open_png(two);
  ASSERT_EQ(image.width, 900);
  ASSERT_EQ(image.height, 600);
  int64_t white = 0;
  for (const uint32_t p : image.pixels) white += (p & 0xffffff) == 0xffffff;
  EXPECT_GT(white, static_cast<int64_t>(image.pixels.size()) * 6 / 10) << "the background is not dominant";

  // The layout the drawing used, for the loss panel's axes.
  const Figure figure = build_figure({read_run_metrics(a), read_run_metrics(b)}, options.figure);
  const std::vector<Rect> areas = plot_areas(figure, options.size);
  ASSERT_EQ(areas.size(), 4u);
  const Rect& loss = areas[0];
  EXPECT_GT(loss.width, 300);
  EXPECT_GT(loss.height, 150);
  EXPECT_LT(loss.x + loss.width, 450);  // the left column
  EXPECT_LT(loss.y + loss.height, 300);  // the top row
  for (size_t run = 0; run < 2; ++run)
    EXPECT_GT(count_colour(image, loss, rgb_of(run_colour(run))), 100) << "run " << run << "'s colour is missing";
  // Nowhere in the loss panel is a third run's colour.
  EXPECT_EQ(count_colour(image, loss, rgb_of(run_colour(2))), 0);

  const Image single = open_png(one);
  ASSERT_EQ(single.pixels.size(), image.pixels.size());
  EXPECT_EQ(count_colour(single, loss, rgb_of(run_colour(1))), 0);
  int64_t differ = 0;
  for (size_t i = 0; i < image.pixels.size(); ++i) differ += !near(image.pixels[i], single.pixels[i], 0);
  EXPECT_GT(differ, 2000);
}

// cairo writes text into an SVG as glyph outlines (<symbol>s placed by <use>): the runs'
// names show as glyph placements, one per character drawn.
int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST_F(Plot, AnSvgHasItsSizeTheRunsColoursAndTheirNamesAsGlyphs) {
  const std::string a = run_dir("a", falling_run(100, 0.03));
  PlotOptions options;
  options.size = {800, 500};
  plot_runs({a}, dir_ + "/short.svg", options);
  options.figure.labels = {"a much longer name for the run"};
  plot_runs({a}, dir_ + "/long.svg", options);

  const std::string svg = test::read_file(dir_ + "/short.svg"), longer = test::read_file(dir_ + "/long.svg");
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_CONTAINS(svg, R"(width="800px" height="500px" viewBox="0 0 800 500")");
  EXPECT_NE(svg.find("</svg>", svg.size() - 10), std::string::npos);
  EXPECT_GT(count_of(svg, "<path"), 20);
  // "a much longer name for the run" has 29 more characters than "a", 23 of them not
  // spaces (cairo 1.16 places a glyph for a space too; another version may not).
  const int more_glyphs = count_of(longer, "<use") - count_of(svg, "<use");
  EXPECT_GE(more_glyphs, 23);
  EXPECT_LE(more_glyphs, 29);
  // The run's colour as cairo writes it: rgb(R%,G%,B%), rounded by cairo 1.16.
  const Colour c = run_colour(0);
  const std::regex colour(R"(stroke:\s*rgb\(([0-9.]+)%,\s*([0-9.]+)%,\s*([0-9.]+)%\))");
  bool found = false;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), colour); it != std::sregex_iterator(); ++it)
    found |= std::fabs(std::stod((*it)[1]) - c.r * 100) < 1 && std::fabs(std::stod((*it)[2]) - c.g * 100) < 1 &&
             std::fabs(std::stod((*it)[3]) - c.b * 100) < 1;
  EXPECT_TRUE(found) << "no stroke in the run's colour";
}

TEST_F(Plot, TheOutputNameChoosesTheFormat) {
  EXPECT_EQ(image_format_of("a/b.png"), ImageFormat::png);
  EXPECT_EQ(image_format_of("B.SVG"), ImageFormat::svg);
  EXPECT_EQ(test::error_of([] { image_format_of("plot.jpg"); }),
            "[plot] -o plot.jpg: the name must end in .png or .svg (the image's format)");
  EXPECT_EQ(test::error_of([] { image_format_of("plot"); }),
            "[plot] -o plot: the name must end in .png or .svg (the image's format)");
}

// ---- through the binary ----

// Runs `command`, expecting it to fail with one line "kiln: error: ..."; returns the line.
std::string one_line_error(const std::string& command) {
  std::string output;
  EXPECT_NE(test::run_command(command, &output), 0) << output;
  EXPECT_EQ(output.rfind("kiln: error: ", 0), 0u) << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << "not one line:\n" << output;
  return output;
}

TEST_F(Plot, TheCommandDrawsRunsAndRefusesBadInputInOneLine) {
  const std::string a = run_dir("a", falling_run(100, 0.03)), b = run_dir("b", falling_run(50, 0.01));
  const std::string kiln = test::kiln_binary() + " plot ";
  std::string output;
  ASSERT_EQ(test::run_command(kiln + a + " " + b + " -o " + dir_ + "/ab.svg --x tokens --smooth 3 --log-y loss "
                                  "--log-y grad-norm --label one --label two --size 640x480",
                              &output),
            0)
      << output;
  EXPECT_CONTAINS(output, fmt::format("plot: 2 runs drawn into {}/ab.svg (640x480)", dir_));
  EXPECT_CONTAINS(test::read_file(dir_ + "/ab.svg"), R"(width="640px" height="480px")");

  EXPECT_CONTAINS(one_line_error(kiln + a + " -o " + dir_ + "/x.jpg"), "[plot] -o " + dir_ + "/x.jpg: the name must");
  EXPECT_CONTAINS(one_line_error(kiln + dir_ + "/none -o " + dir_ + "/x.png"),
                  "[plot] " + dir_ + "/none: no such run directory or metrics file");
  EXPECT_CONTAINS(one_line_error(kiln + a + " -o x.png --size 100"),
                  "[plot] --size 100: expected WIDTHxHEIGHT in pixels, such as 1200x800");
  EXPECT_CONTAINS(one_line_error(kiln + a + " -o x.png --size 100x50"), "[plot] --size 100x50: each side must be");
  EXPECT_CONTAINS(one_line_error(kiln + a + " " + b + " -o x.png --label one"), "[plot] --label: 1 labels for 2 runs");
  test::write_file(dir_ + "/bad/metrics.jsonl", falling_run(20, 0.1) + "not json\n" + falling_run(20, 0.1));
  EXPECT_CONTAINS(one_line_error(kiln + dir_ + "/bad -o x.png"),
                  "[plot] " + dir_ + "/bad/metrics.jsonl:3: not a JSON object: not json");
  test::write_file(dir_ + "/empty/metrics.jsonl", "");
  EXPECT_CONTAINS(one_line_error(kiln + dir_ + "/empty -o x.png"), "metrics.jsonl: no train or validation records");
  EXPECT_FALSE(fs::exists("x.png"));
}

// `kiln plot` of a constant loss of 5e-324 ended in bad_alloc, and of a loss reaching 1e300
// blamed --size for labels too wide to fit (issue 38). Both draw.
TEST_F(Plot, TheCommandDrawsDegenerateAndHugeLosses) {
  for (const char* loss : {"5e-324", "1e300"}) {
    std::string metrics;
    for (int64_t s = 10; s <= 30; s += 10)
      metrics += train_record(s, s == 10 && std::string(loss) == "1e300" ? "0" : loss, 1e-3, "0.8", 1000, 1.0);
    const std::string run = run_dir(std::string("run-") + loss, metrics);
    for (const char* log : {"", " --log-y loss"}) {
      std::string output;
      EXPECT_EQ(test::run_command(test::kiln_binary() + " plot " + run + " -o " + run + "/plot.png" + log, &output), 0)
          << loss << log << ": " << output;
      EXPECT_CONTAINS(output, "plot: 1 run drawn into");
    }
  }
}

TEST_F(Plot, ATrainingRunLeavesItsPlotInItsOutDir) {
  const std::string corpus = test::write_tiny_corpus(dir_, 60);
  std::string output;
  const std::string out = dir_ + "/run";
  ASSERT_EQ(test::run_with_fault(test::tiny_train(corpus, out, "--set log.every=2"), "", &output), 0) << output;
  const Image image = open_png(out + "/plot.png");
  EXPECT_EQ(image.width, 1200);
  EXPECT_EQ(image.height, 800);
  EXPECT_FALSE(fs::exists(out + "/plot.png.tmp"));
  EXPECT_CONTAINS(test::read_file(out + "/config.toml"), "plot = true");

  // log.plot = false draws none; a plot that cannot be written is a warning, the run stands.
  const std::string off = dir_ + "/off";
  ASSERT_EQ(test::run_with_fault(test::tiny_train(corpus, off, "--set log.plot=false"), "", &output), 0) << output;
  EXPECT_TRUE(fs::exists(off + "/summary.json"));
  EXPECT_FALSE(fs::exists(off + "/plot.png"));
  const std::string blocked = dir_ + "/blocked";
  fs::create_directories(blocked + "/plot.png");  // a directory where the image would go
  ASSERT_EQ(test::run_with_fault(test::tiny_train(corpus, blocked), "", &output), 0) << output;
  EXPECT_CONTAINS(output, "kiln: warning: [plot] " + blocked + "/plot.png: not drawn: ");
  EXPECT_TRUE(fs::exists(blocked + "/model/model.safetensors"));
  EXPECT_TRUE(fs::exists(blocked + "/summary.json"));

  // `kiln plot` reads the run directory the trainer left.
  ASSERT_EQ(test::run_command(test::kiln_binary() + " plot " + out + " " + off + " -o " + dir_ + "/both.png", &output), 0)
      << output;
  EXPECT_EQ(open_png(dir_ + "/both.png").width, 1200);
}

}  // namespace
}  // namespace kiln
