#include "plot/ticks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace kiln::plot {

namespace {

// How an axis writes its numbers (tick_labels picks one for a whole linear axis).
enum class Style { si, fixed, exponent };

Style style_for(double magnitude) {
  if (magnitude >= 1000) return Style::si;
  if (magnitude >= 0.01 || magnitude == 0) return Style::fixed;
  return Style::exponent;
}

// Enough decimals to tell apart two values `step` apart: 0.25 needs 2, 5 needs 0.
int decimals_for(double step) { return std::max(0, static_cast<int>(std::ceil(-std::log10(step) - 1e-9))); }

std::string without_trailing_zeros(std::string text) {
  if (text.find('.') == std::string::npos) return text;
  while (text.back() == '0') text.pop_back();
  if (text.back() == '.') text.pop_back();
  return text;
}

std::string fixed(double value, int decimals) {
  std::string text = without_trailing_zeros(fmt::format("{:.{}f}", value, decimals));
  return text == "-0" ? "0" : text;
}

std::string si(double value, double step) {
  static constexpr struct {
    double scale;
    const char* prefix;
  } kPrefixes[] = {{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}};
  for (const auto& [scale, prefix] : kPrefixes)
    if (std::fabs(value) >= scale) return fixed(value / scale, decimals_for(step / scale)) + prefix;
  return fixed(value, decimals_for(step));
}

std::string exponent(double value, double step) {
  if (value == 0) return "0";
  int power = static_cast<int>(std::floor(std::log10(std::fabs(value))));
  const int decimals = std::max(0, static_cast<int>(std::ceil(power - std::log10(step) - 1e-9)));
  double mantissa = value / std::pow(10.0, power);
  if (std::fabs(std::stod(fmt::format("{:.{}f}", mantissa, decimals))) >= 10) mantissa /= 10, ++power;  // 9.99e-4 -> 1e-3
  return fmt::format("{}e{}", fixed(mantissa, decimals), power);
}

std::string label(double value, double step, Style style) {
  switch (style) {
    case Style::si: return si(value, step);
    case Style::fixed: return fixed(value, decimals_for(step));
    case Style::exponent: return exponent(value, step);
  }
  return "";
}

}  // namespace

double nice_step(double span, int target) {
  const double raw = span / std::max(target, 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double fraction = raw / magnitude;  // in [1, 10)
  const double nice = fraction < 1.5 ? 1 : fraction < 3 ? 2 : fraction < 7 ? 5 : 10;
  return nice * magnitude;
}

Axis linear_axis(double lo, double hi, int target, bool to_whole_ticks) {
  if (!(hi > lo)) {  // one value (or none): a range around it
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad, hi += pad;
  }
  const double step = nice_step(hi - lo, target);
  // Tick i is i * step (no running sum: 0.1 + 0.1 + 0.1 is not 0.3); a tick within a
  // millionth of a step of an end counts as on it.
  const double first = to_whole_ticks ? std::floor(lo / step + 1e-6) : std::ceil(lo / step - 1e-6);
  const double last = to_whole_ticks ? std::ceil(hi / step - 1e-6) : std::floor(hi / step + 1e-6);
  Axis axis;
  axis.lo = to_whole_ticks ? first * step : lo;
  axis.hi = to_whole_ticks ? last * step : hi;
  axis.tick_step = step;
  for (double i = first; i <= last + 0.5; ++i) axis.ticks.push_back(std::fabs(i) < 0.5 ? 0.0 : i * step);
  return axis;
}

Axis log_axis(double lo, double hi) {
  // 3% of the span beyond the data on either side (a tenth of a decade for one value).
  const double log_lo = std::log10(lo), log_hi = std::log10(hi);
  const double pad = log_hi > log_lo ? (log_hi - log_lo) * 0.03 : 0.1;
  Axis axis;
  axis.log = true;
  axis.lo = std::pow(10.0, log_lo - pad);
  axis.hi = std::pow(10.0, log_hi + pad);
  static const std::vector<std::vector<int>> kMantissas = {{1}, {1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}};
  for (const std::vector<int>& mantissas : kMantissas) {
    axis.ticks.clear();
    for (int power = static_cast<int>(std::floor(log_lo - pad)); power <= static_cast<int>(std::ceil(log_hi + pad));
         ++power)
      for (const int m : mantissas) {
        const double tick = m * std::pow(10.0, power);
        if (tick >= axis.lo && tick <= axis.hi) axis.ticks.push_back(tick);
      }
    if (axis.ticks.size() >= 3) return axis;
  }
  const Axis linear = linear_axis(axis.lo, axis.hi, 4, false);
  axis.ticks = linear.ticks;
  axis.tick_step = linear.tick_step;
  return axis;
}

std::vector<std::string> tick_labels(const Axis& axis) {
  std::vector<std::string> labels;
  if (axis.tick_step == 0) {  // 1..9 x 10^k: each at its own precision
    for (const double t : axis.ticks) labels.push_back(format_tick(t, std::pow(10.0, std::floor(std::log10(t) + 1e-9))));
    return labels;
  }
  double largest = 0;
  for (const double t : axis.ticks) largest = std::max(largest, std::fabs(t));
  const Style style = style_for(largest);
  for (const double t : axis.ticks) labels.push_back(label(t, axis.tick_step, style));
  return labels;
}

std::string format_tick(double value, double step) { return label(value, step, style_for(std::fabs(value))); }

}  // namespace kiln::plot
