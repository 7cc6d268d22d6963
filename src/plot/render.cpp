#include "plot/render.h"

#include "core/error.h"
#include "plot/ticks.h"

#include <cairo-svg.h>
#include <cairo.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>

namespace kiln::plot {

namespace {

constexpr const char* kWhere = "plot";
constexpr const char* kFontFamily = "sans-serif";  // fontconfig's choice; cairo's own font without one
constexpr Colour kBackground{1, 1, 1};
constexpr Colour kInk{0.13, 0.13, 0.13};     // titles, run names
constexpr Colour kTickInk{0.33, 0.33, 0.33}; // tick labels, the legend's style keys
constexpr Colour kGrid{0.90, 0.90, 0.90};
constexpr Colour kFrame{0.65, 0.65, 0.65};
constexpr int kColumns = 2;

struct ContextDeleter {
  void operator()(cairo_t* cr) const { cairo_destroy(cr); }
};
struct SurfaceDeleter {
  void operator()(cairo_surface_t* surface) const { cairo_surface_destroy(surface); }
};
using Context = std::unique_ptr<cairo_t, ContextDeleter>;
using Surface = std::unique_ptr<cairo_surface_t, SurfaceDeleter>;

void check(cairo_status_t status, std::string_view what) {
  if (status != CAIRO_STATUS_SUCCESS) fail(kWhere, "{}: {}", what, cairo_status_to_string(status));
}

// Every length of the drawing is a multiple of one unit that grows with the image: 13 px
// in 1200 x 800.
double unit_of(Size size) {
  return std::clamp(std::min(size.width / 1200.0, size.height / 800.0) * 13.0, 7.0, 40.0);
}

void set_colour(cairo_t* cr, Colour c, double alpha = 1) { cairo_set_source_rgba(cr, c.r, c.g, c.b, alpha); }

void set_font(cairo_t* cr, double size, bool bold = false) {
  cairo_select_font_face(cr, kFontFamily, CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

double text_width(cairo_t* cr, const std::string& text) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, text.c_str(), &e);
  return e.x_advance;
}

// Half the height of a digit in the current font: a baseline this far below y centres
// a number on y.
double half_digit(cairo_t* cr) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, "0", &e);
  return -e.y_bearing / 2;
}

enum class Anchor { left, centre, right };

void show_text(cairo_t* cr, const std::string& text, double x, double baseline, Anchor anchor) {
  const double width = anchor == Anchor::left ? 0 : text_width(cr, text);
  cairo_move_to(cr, anchor == Anchor::left ? x : anchor == Anchor::centre ? x - width / 2 : x - width, baseline);
  cairo_show_text(cr, text.c_str());
}

// Lowest and highest finite values seen (on a log axis, positive ones only).
struct Extent {
  double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
  bool positive_only = false;
  void add(double v) {
    if (!std::isfinite(v) || (positive_only && v <= 0)) return;
    lo = std::min(lo, v), hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

// The x axis every panel shares, from 0 to the furthest point of any run.
Axis x_axis_of(const Figure& figure, int target) {
  Extent x;
  x.add(0);
  for (const Panel& panel : figure.panels)
    for (const Line& line : panel.lines)
      for (const auto& [px, py] : line.points) x.add(px);
  return linear_axis(x.lo, x.hi, target, false);
}

Axis y_axis_of(const Panel& panel, int target) {
  Extent y;
  y.positive_only = panel.log_y;
  for (const Line& line : panel.lines)
    for (const auto& [px, py] : line.points) y.add(py);
  if (y.empty()) return linear_axis(0, 1, target);  // drawn empty, "no data"
  if (panel.log_y) return log_axis(y.lo, y.hi);
  return linear_axis(panel.y_from_zero ? std::min(y.lo, 0.0) : y.lo, y.hi, target);
}

// Where `value` lies along `axis`, 0 at lo and 1 at hi.
double fraction(const Axis& axis, double value) {
  if (axis.log) return (std::log10(value) - std::log10(axis.lo)) / (std::log10(axis.hi) - std::log10(axis.lo));
  return (value - axis.lo) / (axis.hi - axis.lo);
}

// One entry of the legend: a run (its colour and name), or a key to a line style.
struct LegendItem {
  enum class Kind { run, train, train_raw, validation, mark } kind;
  std::string label;
  Colour colour;
  double x = 0, baseline = 0;
};

struct PanelLayout {
  Rect area;  // the axes
  Axis y;
  std::vector<std::string> y_labels;
  double title_baseline = 0;
  double title_room = 0;  // from the title's start to the cell's right edge
  bool bottom_row = false;
};

struct Layout {
  double unit = 13;
  std::vector<LegendItem> legend;
  Axis x;
  std::vector<std::string> x_labels;
  std::vector<PanelLayout> panels;
};

double legend_font(double unit) { return unit * 1.0; }
double tick_font(double unit) { return unit * 0.9; }
double title_font(double unit) { return unit * 1.05; }
double swatch_length(double unit) { return unit * 2.0; }

std::vector<LegendItem> legend_items(const Figure& figure) {
  std::vector<LegendItem> items;
  for (const LegendEntry& run : figure.runs) items.push_back({LegendItem::Kind::run, run.label, run.colour});
  using Kind = LegendItem::Kind;
  if (figure.has_smoothing) {
    items.push_back({Kind::train, "train (moving average)", kTickInk});
    items.push_back({Kind::train_raw, "train", kTickInk});
  } else {
    items.push_back({Kind::train, "train", kTickInk});
  }
  if (figure.has_validation) items.push_back({Kind::validation, "validation", kTickInk});
  if (figure.has_marks) items.push_back({Kind::mark, "skipped update", kTickInk});
  return items;
}

// The legend's items placed in rows across the top, wrapping at the right margin; the
// runs first, then (after a wider gap) the style keys. Returns the legend's height.
double place_legend(cairo_t* cr, std::vector<LegendItem>& items, double unit, Size size) {
  set_font(cr, legend_font(unit));
  const double margin = unit * 1.2, row = unit * 1.9, gap = unit * 1.6;
  double x = margin, baseline = margin + unit;
  for (size_t i = 0; i < items.size(); ++i) {
    LegendItem& item = items[i];
    const double width = swatch_length(unit) + unit * 0.5 + text_width(cr, item.label);
    if (i > 0) {
      const bool first_key = item.kind != LegendItem::Kind::run && items[i - 1].kind == LegendItem::Kind::run;
      x += first_key ? gap * 2 : gap;
      if (x + width > size.width - margin) x = margin, baseline += row;
    }
    item.x = x, item.baseline = baseline;
    x += width;
  }
  return baseline - margin + unit * 0.9;
}

Layout lay_out(cairo_t* cr, const Figure& figure, Size size) {
  Layout layout;
  const double unit = layout.unit = unit_of(size);
  const double margin = unit * 1.2;
  layout.legend = legend_items(figure);
  const double top = margin + place_legend(cr, layout.legend, unit, size) + unit * 0.8;
  const int rows = static_cast<int>((figure.panels.size() + kColumns - 1) / kColumns);
  const double column_gap = unit * 2.5, row_gap = unit * 1.2;
  const double cell_width = (size.width - 2 * margin - (kColumns - 1) * column_gap) / kColumns;
  const double cell_height = (size.height - top - margin - (rows - 1) * row_gap) / rows;

  layout.x = x_axis_of(figure, std::max(2, static_cast<int>(cell_width / (unit * 9))));
  layout.x_labels = tick_labels(layout.x);
  set_font(cr, tick_font(unit));
  double widest_x_label = 0;
  for (const std::string& label : layout.x_labels) widest_x_label = std::max(widest_x_label, text_width(cr, label));

  for (size_t i = 0; i < figure.panels.size(); ++i) {
    const int column = static_cast<int>(i) % kColumns, row = static_cast<int>(i) / kColumns;
    const Rect cell{margin + column * (cell_width + column_gap), top + row * (cell_height + row_gap), cell_width,
                    cell_height};
    PanelLayout p;
    p.bottom_row = row == rows - 1;
    p.title_baseline = cell.y + title_font(unit);
    const double area_top = p.title_baseline + unit * 0.7;
    const double area_bottom = cell.y + cell.height - unit * (p.bottom_row ? 3.0 : 1.7);
    p.y = y_axis_of(figure.panels[i], std::max(2, static_cast<int>((area_bottom - area_top) / (unit * 3.5))));
    p.y_labels = tick_labels(p.y);
    set_font(cr, tick_font(unit));
    double widest_y_label = 0;
    for (const std::string& label : p.y_labels) widest_y_label = std::max(widest_y_label, text_width(cr, label));
    const double area_left = cell.x + widest_y_label + unit * 0.6;
    const double area_right = cell.x + cell.width - widest_x_label / 2;
    p.area = {area_left, area_top, area_right - area_left, area_bottom - area_top};
    p.title_room = cell.x + cell.width - area_left;
    if (p.area.width < unit * 4 || p.area.height < unit * 3)
      fail(kWhere, "--size {}x{}: too small for the figure's panels", size.width, size.height);
    layout.panels.push_back(std::move(p));
  }
  return layout;
}

// Validation lines are dashed (and carry markers): told apart from the train line of the
// same run's colour.
void set_validation_dash(cairo_t* cr, double unit, bool on) {
  const double dash[] = {unit * 0.5, unit * 0.4};
  cairo_set_dash(cr, dash, on ? 2 : 0, 0);
}

// A 1-px line on whole pixels (centred on a pixel, so it stays sharp).
double crisp(double v) { return std::floor(v) + 0.5; }

void draw_polyline(cairo_t* cr, const Line& line, const Axis& x, const Axis& y, const Rect& area, double dot) {
  auto px = [&](double v) { return area.x + fraction(x, v) * area.width; };
  auto py = [&](double v) { return area.y + area.height - fraction(y, v) * area.height; };
  size_t run_length = 0;  // points in the current unbroken stretch
  double last_x = 0, last_y = 0;
  auto end_stretch = [&] {
    if (run_length == 1) {  // a lone point between gaps: a dot, or it would not show
      cairo_new_sub_path(cr);
      cairo_arc(cr, last_x, last_y, dot, 0, 2 * M_PI);
    }
    run_length = 0;
  };
  for (const auto& [vx, vy] : line.points) {
    if (!std::isfinite(vx) || !std::isfinite(vy) || (y.log && vy <= 0)) {
      end_stretch();
      continue;
    }
    last_x = px(vx), last_y = py(vy);
    if (run_length++ == 0) cairo_move_to(cr, last_x, last_y);
    else cairo_line_to(cr, last_x, last_y);
  }
  end_stretch();
}

void draw_markers(cairo_t* cr, const Line& line, const Axis& x, const Axis& y, const Rect& area, double radius) {
  for (const auto& [vx, vy] : line.points) {
    if (!std::isfinite(vx) || !std::isfinite(vy) || (y.log && vy <= 0)) continue;
    cairo_new_sub_path(cr);
    cairo_arc(cr, area.x + fraction(x, vx) * area.width, area.y + area.height - fraction(y, vy) * area.height, radius,
              0, 2 * M_PI);
  }
}

void draw_lines(cairo_t* cr, const Panel& panel, const Layout& layout, const PanelLayout& p) {
  const double unit = layout.unit, width = unit * 0.16, radius = unit * 0.3;
  // The axes hold every point; the clip is only against stray ink. It leaves room for a
  // marker on the edge (the last validation ends the x axis).
  cairo_save(cr);
  cairo_rectangle(cr, p.area.x - radius - 1, p.area.y - radius - 1, p.area.width + 2 * radius + 2,
                  p.area.height + 2 * radius + 2);
  cairo_clip(cr);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  // Raw lines under the averaged ones, validation on top.
  for (const Line::Style style : {Line::Style::train_raw, Line::Style::train, Line::Style::validation}) {
    for (const Line& line : panel.lines) {
      if (line.style != style) continue;
      const bool raw = style == Line::Style::train_raw, validation = style == Line::Style::validation;
      set_colour(cr, line.colour, raw ? 0.3 : 1);
      cairo_set_line_width(cr, validation ? width * 0.8 : width);
      set_validation_dash(cr, unit, validation);
      draw_polyline(cr, line, layout.x, p.y, p.area, width);
      cairo_stroke(cr);
      if (validation) {
        set_validation_dash(cr, unit, false);
        draw_markers(cr, line, layout.x, p.y, p.area, radius);
        cairo_fill_preserve(cr);
        set_colour(cr, kBackground);
        cairo_set_line_width(cr, unit * 0.08);
        cairo_stroke(cr);
      }
    }
  }
  for (const Mark& mark : panel.marks) {
    const double mx = p.area.x + fraction(layout.x, mark.x) * p.area.width;
    set_colour(cr, mark.colour);
    cairo_set_line_width(cr, width);
    cairo_move_to(cr, mx, p.area.y + p.area.height);
    cairo_line_to(cr, mx, p.area.y + p.area.height - unit * 0.8);
    cairo_stroke(cr);
  }
  cairo_restore(cr);
}

void draw_panel(cairo_t* cr, const Figure& figure, const Panel& panel, const Layout& layout, const PanelLayout& p) {
  const double unit = layout.unit;
  const Rect& a = p.area;
  const double right = a.x + a.width, bottom = a.y + a.height;
  cairo_set_line_width(cr, 1);
  set_colour(cr, kGrid);
  for (const double t : layout.x.ticks) {
    const double x = crisp(a.x + fraction(layout.x, t) * a.width);
    cairo_move_to(cr, x, a.y), cairo_line_to(cr, x, bottom);
  }
  for (const double t : p.y.ticks) {
    const double y = crisp(bottom - fraction(p.y, t) * a.height);
    cairo_move_to(cr, a.x, y), cairo_line_to(cr, right, y);
  }
  cairo_stroke(cr);
  set_colour(cr, kFrame);
  cairo_rectangle(cr, crisp(a.x), crisp(a.y), std::round(a.width), std::round(a.height));
  cairo_stroke(cr);

  set_font(cr, tick_font(unit));
  set_colour(cr, kTickInk);
  const double centre = half_digit(cr);
  for (size_t k = 0; k < p.y.ticks.size(); ++k)
    show_text(cr, p.y_labels[k], a.x - unit * 0.5, bottom - fraction(p.y, p.y.ticks[k]) * a.height + centre,
              Anchor::right);
  for (size_t k = 0; k < layout.x.ticks.size(); ++k)
    show_text(cr, layout.x_labels[k], a.x + fraction(layout.x, layout.x.ticks[k]) * a.width, bottom + unit * 1.3,
              Anchor::centre);
  if (p.bottom_row) {
    set_colour(cr, kInk);
    show_text(cr, figure.x_label, a.x + a.width / 2, bottom + unit * 2.7, Anchor::centre);
  }
  // A title wider than its panel (a small image) is set smaller rather than run into the next.
  set_font(cr, title_font(unit), true);
  const double title_width = text_width(cr, panel.title);
  if (title_width > p.title_room) set_font(cr, title_font(unit) * p.title_room / title_width, true);
  set_colour(cr, kInk);
  show_text(cr, panel.title, a.x, p.title_baseline, Anchor::left);

  const bool empty = std::all_of(panel.lines.begin(), panel.lines.end(), [&](const Line& line) {
    return std::none_of(line.points.begin(), line.points.end(),
                        [&](const auto& point) { return std::isfinite(point.second) && (!p.y.log || point.second > 0); });
  });
  if (empty) {
    set_font(cr, tick_font(unit));
    set_colour(cr, kTickInk);
    show_text(cr, "no data", a.x + a.width / 2, a.y + a.height / 2, Anchor::centre);
    return;
  }
  draw_lines(cr, panel, layout, p);
}

void draw_legend(cairo_t* cr, const std::vector<LegendItem>& items, double unit) {
  const double width = unit * 0.16, length = swatch_length(unit);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  for (const LegendItem& item : items) {
    const double y = item.baseline - unit * 0.35, x0 = item.x + unit * 0.15, x1 = item.x + length - unit * 0.15;
    using Kind = LegendItem::Kind;
    set_colour(cr, item.colour, item.kind == Kind::train_raw ? 0.35 : 1);
    if (item.kind == Kind::mark) {
      cairo_set_line_width(cr, width);
      cairo_move_to(cr, item.x + length / 2, y + unit * 0.45), cairo_line_to(cr, item.x + length / 2, y - unit * 0.35);
      cairo_stroke(cr);
    } else {
      cairo_set_line_width(cr, item.kind == Kind::run ? width * 1.8 : item.kind == Kind::validation ? width * 0.8 : width);
      set_validation_dash(cr, unit, item.kind == Kind::validation);
      cairo_move_to(cr, x0, y), cairo_line_to(cr, x1, y);
      cairo_stroke(cr);
      set_validation_dash(cr, unit, false);
    }
    if (item.kind == Kind::validation) {
      cairo_arc(cr, item.x + length / 2, y, unit * 0.3, 0, 2 * M_PI);
      cairo_fill_preserve(cr);
      set_colour(cr, kBackground);
      cairo_set_line_width(cr, unit * 0.08);
      cairo_stroke(cr);
    }
    set_font(cr, legend_font(unit));
    set_colour(cr, item.kind == Kind::run ? kInk : kTickInk);
    show_text(cr, item.label, item.x + length + unit * 0.5, item.baseline, Anchor::left);
  }
}

void draw(cairo_t* cr, const Figure& figure, Size size) {
  const Layout layout = lay_out(cr, figure, size);
  set_colour(cr, kBackground);
  cairo_paint(cr);
  draw_legend(cr, layout.legend, layout.unit);
  for (size_t i = 0; i < figure.panels.size(); ++i) draw_panel(cr, figure, figure.panels[i], layout, layout.panels[i]);
  check(cairo_status(cr), "drawing the figure");
}

cairo_status_t append_bytes(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

}  // namespace

ImageFormat image_format_of(const std::string& path) {
  std::string extension = std::filesystem::path(path).extension().string();
  std::transform(extension.begin(), extension.end(), extension.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (extension == ".png") return ImageFormat::png;
  if (extension == ".svg") return ImageFormat::svg;
  fail(kWhere, "-o {}: the name must end in .png or .svg (the image's format)", path);
}

std::vector<Rect> plot_areas(const Figure& figure, Size size) {
  const Surface surface(cairo_image_surface_create(CAIRO_FORMAT_RGB24, 1, 1));  // for measuring text
  const Context cr(cairo_create(surface.get()));
  std::vector<Rect> areas;
  for (const PanelLayout& p : lay_out(cr.get(), figure, size).panels) areas.push_back(p.area);
  return areas;
}

std::string render_figure(const Figure& figure, Size size, ImageFormat format) {
  std::string bytes;
  if (format == ImageFormat::png) {
    const Surface surface(cairo_image_surface_create(CAIRO_FORMAT_RGB24, size.width, size.height));
    check(cairo_surface_status(surface.get()), fmt::format("a {}x{} image", size.width, size.height));
    const Context cr(cairo_create(surface.get()));
    draw(cr.get(), figure, size);
    check(cairo_surface_write_to_png_stream(surface.get(), append_bytes, &bytes), "encoding the PNG");
  } else {
    const Surface surface(cairo_svg_surface_create_for_stream(append_bytes, &bytes, size.width, size.height));
    check(cairo_surface_status(surface.get()), "creating the SVG");
    cairo_svg_surface_set_document_unit(surface.get(), CAIRO_SVG_UNIT_PX);
    {
      const Context cr(cairo_create(surface.get()));
      draw(cr.get(), figure, size);
    }
    cairo_surface_finish(surface.get());  // writes the document
    check(cairo_surface_status(surface.get()), "writing the SVG");
  }
  return bytes;
}

}  // namespace kiln::plot
