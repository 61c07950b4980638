#include "loom/cli/loss_plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace loom::cli {

namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

}  // namespace

std::string loss_curves_svg(const std::string& title, const std::vector<LossSeries>& series) {
  constexpr double W = 860, H = 480, left = 70, right = 190, top = 40, bottom = 50;
  static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"};
  size_t steps = 1;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& s : series) {
    steps = std::max(steps, s.loss.size());
    for (double v : s.loss)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
    for (const auto& [step, v] : s.val)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  if (hi - lo < 1e-9) lo -= 0.5, hi += 0.5;
  const double pad = 0.05 * (hi - lo);
  lo -= pad, hi += pad;
  const double pw = W - left - right, ph = H - top - bottom;
  auto x_of = [&](double step) { return left + (steps > 1 ? (step - 1) / static_cast<double>(steps - 1) : 0.5) * pw; };
  auto y_of = [&](double v) { return top + (hi - v) / (hi - lo) * ph; };

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" font-size=\"15\">{3}</text>\n",
      W, H, left, escape(title));
  // Axes, ticks and grid.
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>\n", left, top,
                     pw, ph);
  for (int k = 0; k <= 5; ++k) {
    const double v = lo + (hi - lo) * k / 5.0, y = y_of(v);
    svg += fmt::format(
        "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#ddd\"/>"
        "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:.3f}</text>\n",
        left, left + pw, y, left - 6, y + 4, v);
    const double step = 1 + (static_cast<double>(steps) - 1) * k / 5.0, x = x_of(step);
    svg +=
        fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.0f}</text>\n", x, top + ph + 18, step);
  }
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">step</text>\n", left + pw / 2, H - 10);
  svg += fmt::format(
      "<text x=\"16\" y=\"{:.1f}\" transform=\"rotate(-90 16 {:.1f})\" text-anchor=\"middle\">loss "
      "(training: lines; validation: dots)</text>\n",
      top + ph / 2, top + ph / 2);
  // One polyline per finite stretch of each series, then its validation dots and its legend entry.
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const char* color = colors[i % std::size(colors)];
    std::string points;
    auto flush = [&] {
      if (!points.empty())
        svg +=
            fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n", color, points);
      points.clear();
    };
    for (size_t k = 0; k < s.loss.size(); ++k) {
      if (!std::isfinite(s.loss[k])) {
        flush();
        continue;
      }
      points += fmt::format("{:.1f},{:.1f} ", x_of(static_cast<double>(k + 1)), y_of(s.loss[k]));
    }
    flush();
    for (const auto& [step, v] : s.val)
      if (std::isfinite(v))
        svg += fmt::format(
            "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"><title>{} val {:.4f} at step "
            "{}</title></circle>\n",
            x_of(static_cast<double>(step)), y_of(v), color, escape(s.name), v, step);
    const double ly = top + 16 + 20.0 * static_cast<double>(i);
    svg += fmt::format(
        "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"{3}\" stroke-width=\"3\"/>"
        "<text x=\"{4}\" y=\"{5:.1f}\">{6}</text>\n",
        left + pw + 14, left + pw + 40, ly, color, left + pw + 46, ly + 4, escape(s.name));
  }
  return svg + "</svg>\n";
}

}  // namespace loom::cli
