#include "plot/ticks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace kiln::plot {

namespace {

// The narrowest span a linear axis is drawn over: ticks closer than this would be near
// the denormal doubles (below 2.2e-308), which have too few digits to be told apart.
constexpr double kSmallestSpan = 1e-305;
// The smallest value a log axis shows (smaller ones are drawn at its bottom edge); its
// linear ticks, when it has too few decades for log ones, are then over kSmallestSpan.
constexpr double kSmallestLogValue = 1e-300;

// How an axis writes its numbers (tick_labels picks one for a whole linear axis).
enum class Style { si, fixed, exponent };

Style style_for(double magnitude) {
  if (magnitude >= 1e15) return Style::exponent;  // past T: 1e300 was a 289-digit label
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
  // A span that doubles cannot divide into distinct ticks is one value: a range around it.
  // That is a span below a billionth of the values (doubles hold about 16 digits; a step of
  // 4 at 2^54 did not advance the tick count, which then grew without end) or below
  // kSmallestSpan (a constant 5e-324, the smallest double, had a step of 0: bad_alloc).
  const double magnitude = std::max(std::fabs(lo), std::fabs(hi));
  if (!(hi - lo >= magnitude * 1e-9 && hi - lo >= kSmallestSpan)) {
    const double middle = lo / 2 + hi / 2;
    const double pad = middle == 0 ? 1 : std::max(std::fabs(middle) * 0.1, kSmallestSpan);
    lo = middle - pad, hi = middle + pad;
  }
  // A span past the largest double (-1e308 to 1e308) is stepped a tenth at a time.
  const double step = std::isfinite(hi - lo) ? nice_step(hi - lo, target) : 10 * nice_step(hi / 10 - lo / 10, target);
  // Tick i is i * step (no running sum: 0.1 + 0.1 + 0.1 is not 0.3); a tick within a
  // millionth of a step of an end counts as on it. Widened to whole ticks only where the
  // outer ticks are doubles (not past 1.8e308).
  const bool whole = to_whole_ticks && std::isfinite(std::floor(lo / step) * step) &&
                     std::isfinite(std::ceil(hi / step) * step);
  const double first = whole ? std::floor(lo / step + 1e-6) : std::ceil(lo / step - 1e-6);
  const double last = whole ? std::ceil(hi / step - 1e-6) : std::floor(hi / step + 1e-6);
  Axis axis;
  axis.lo = whole ? first * step : lo;
  axis.hi = whole ? last * step : hi;
  axis.tick_step = step;
  // |first| is below 10^10 here (the span is a billionth of the values at least), so
  // first + k counts exactly; the count is about `target`.
  const auto count = static_cast<int64_t>(last - first);
  for (int64_t k = 0; k <= count; ++k) {
    const double i = first + static_cast<double>(k);
    axis.ticks.push_back(std::fabs(i) < 0.5 ? 0.0 : i * step);
  }
  return axis;
}

Axis log_axis(double lo, double hi) {
  lo = std::max(lo, kSmallestLogValue), hi = std::max(hi, lo);
  // 3% of the span beyond the data on either side (a tenth of a decade for one value).
  const double log_lo = std::log10(lo), log_hi = std::log10(hi);
  const double pad = log_hi > log_lo ? (log_hi - log_lo) * 0.03 : 0.1;
  Axis axis;
  axis.log = true;
  // The margin stops at kSmallestLogValue and at the largest double (1e-300 to 1e300 reached 1e318).
  axis.lo = std::max(std::pow(10.0, log_lo - pad), kSmallestLogValue);
  axis.hi = std::min(std::pow(10.0, log_hi + pad), std::numeric_limits<double>::max());
  static const std::vector<std::vector<int>> kMantissas = {{1}, {1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}};
  // Every power of ten up to 8 decades; every second, third ... beyond (1e-300 to 1e300
  // had 601 ticks).
  const int lowest = static_cast<int>(std::floor(log_lo - pad)), highest = static_cast<int>(std::ceil(log_hi + pad));
  const int stride = std::max(1, (highest - lowest + 7) / 8);
  for (const std::vector<int>& mantissas : kMantissas) {
    axis.ticks.clear();
    for (int power = lowest; power <= highest; power += stride)
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
