// Drawing a Figure (plot/figure.h) with cairo: a legend across the top (the runs' colours
// and names, then what each line style means), under it the four panels in two rows, each
// with its title, gridlines at the ticks of plot/ticks.h, and its lines clipped to the
// axes. The same drawing goes to a PNG (an image surface) or an SVG (an SVG surface: text
// as glyph outlines, so it looks the same without the font).
#pragma once

#include "plot/figure.h"

#include <string>
#include <vector>

namespace kiln::plot {

struct Size {
  int width = 1200, height = 800;  // pixels
};

enum class ImageFormat { png, svg };

// The format that `path` names by its extension (.png or .svg, any case). Throws
// "[plot] -o PATH: ..." otherwise.
ImageFormat image_format_of(const std::string& path);

struct Rect {
  double x = 0, y = 0, width = 0, height = 0;  // pixels from the top left
};

// Where each panel's axes (the area its lines are drawn in) lie in an image of `size`, in
// the order of figure.panels. Throws "[plot] --size: ..." when `size` leaves them no room.
std::vector<Rect> plot_areas(const Figure& figure, Size size);

// The image file's bytes.
std::string render_figure(const Figure& figure, Size size, ImageFormat format);

}  // namespace kiln::plot
