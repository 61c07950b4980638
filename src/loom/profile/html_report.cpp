#include "loom/profile/html_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace loom::profile {

namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// One color per class, shared by the timeline, the bars and the legend.
const char* color_of(Category c, const std::string& name) {
  if (c == Category::Gemm) return "#2f6fd0";
  if (c == Category::Kernel) return "#7fb3f0";
  if (c == Category::InFlight) return "#f3c26b";
  if (c == Category::Communication) return is_pipeline_wait(name) ? "#b07cd8" : "#e0663f";
  if (c == Category::Host) return "#8a8a8a";
  return "#cccccc";
}

std::string legend() {
  const std::pair<const char*, const char*> items[] = {{"#2f6fd0", "GEMM"},
                                                       {"#7fb3f0", "other kernels"},
                                                       {"#e0663f", "communication waited for"},
                                                       {"#f3c26b", "collective in flight"},
                                                       {"#b07cd8", "pipeline waits"},
                                                       {"#8a8a8a", "host spans / host"}};
  std::string out = "<p class=legend>";
  for (const auto& [c, n] : items) out += fmt::format("<span><i style=\"background:{}\"></i>{}</span>", c, n);
  return out + "</p>";
}

// Rank 0's last analysed step, and every rank's spans in that window (the merged trace's clocks are
// aligned), a compute and a communication lane each.
std::string timeline(const StepReport& r, const std::vector<TraceSpan>& spans) {
  double t0 = 0, t1 = 0;
  const int first_rank = r.analysis.ranks.empty() ? 0 : r.analysis.ranks.front().rank;
  for (const auto& s : spans)
    if (s.rank == first_rank && s.category == Category::Step && s.name == "step" && s.start_s >= t0)
      t0 = s.start_s, t1 = s.end_s();
  if (t1 <= t0) return "<p>(no step to draw)</p>";
  const int W = 1100, lane = 16, label = 70;
  const int ranks = static_cast<int>(r.analysis.ranks.size());
  const int H = ranks * (2 * lane + 10) + 30;
  std::string out = fmt::format("<svg width=\"{}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">", W + label, H);
  std::map<int, int> row;
  for (int i = 0; i < ranks; ++i) row[r.analysis.ranks[static_cast<size_t>(i)].rank] = i;
  for (const auto& [rank, i] : row) {
    const int y = i * (2 * lane + 10);
    out += fmt::format("<text x=\"0\" y=\"{}\" font-size=\"12\">rank {}</text>", y + lane + 4, rank);
    out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#f4f4f4\"/>", label, y, W, 2 * lane);
  }
  for (const auto& s : spans) {
    if (s.category == Category::Step || !row.count(s.rank)) continue;
    const double a = std::max(s.start_s, t0), b = std::min(s.end_s(), t1);
    if (b <= a) continue;
    const bool comm = s.category == Category::Communication || s.category == Category::InFlight;
    const int y = row[s.rank] * (2 * lane + 10) + (comm ? lane : 0);
    const double x = label + (a - t0) / (t1 - t0) * W, w = std::max(0.5, (b - a) / (t1 - t0) * W);
    out += fmt::format("<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\"><title>{} {:.3f} ms</title></rect>",
                       x, y + 1, w, lane - 2, color_of(s.category, s.name), escape(s.name), 1e3 * s.duration_s);
  }
  out += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\">0</text><text x=\"{}\" y=\"{}\" font-size=\"12\" "
                     "text-anchor=\"end\">{:.1f} ms</text></svg>",
                     label, H - 6, label + W, H - 6, 1e3 * (t1 - t0));
  return out;
}

// Per rank and for the job: the step split into the report's classes, as stacked bars.
std::string breakdown_bars(const StepReport& r) {
  auto rows = r.analysis.ranks;
  rows.push_back(r.analysis.mean());
  double longest = 0;
  for (const auto& x : rows) longest = std::max(longest, x.step);
  if (longest <= 0) return "";
  const int W = 900, bar = 18, label = 70;
  std::string out = fmt::format("<svg width=\"{}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">", W + label + 120,
                                static_cast<int>(rows.size()) * (bar + 6) + 6);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& x = rows[i];
    const int y = static_cast<int>(i) * (bar + 6) + 3;
    out += fmt::format("<text x=\"0\" y=\"{}\" font-size=\"12\">{}</text>", y + 13,
                       x.rank < 0 ? std::string("job") : fmt::format("rank {}", x.rank));
    const double other = std::max(0.0, x.compute - x.gemm);
    const std::pair<double, const char*> parts[] = {{x.gemm, "#2f6fd0"},        {other, "#7fb3f0"},
                                                    {x.comm_exposed, "#e0663f"}, {x.pipeline_wait, "#b07cd8"},
                                                    {x.host, "#8a8a8a"}};
    double at = label;
    for (const auto& [sec, c] : parts) {
      const double w = sec / longest * W;
      if (w <= 0) continue;
      out += fmt::format("<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\"/>", at, y, w, bar, c);
      at += w;
    }
    out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"12\">{:.2f} ms</text>", at + 6, y + 13, 1e3 * x.step);
  }
  return out + "</svg>";
}

// The roofline (log-log): min(peak, intensity x bandwidth), each kernel class at its intensity and
// achieved FLOP/s.
std::string roofline(const StepReport& r) {
  if (r.roof.peak_flops <= 0) return "<p>(no peak: no roofline)</p>";
  const int W = 700, H = 380, L = 60, B = 40;
  const double x_lo = 1e-2, x_hi = 1e4;
  const double y_hi = r.roof.peak_flops * 2, y_lo = r.roof.peak_flops * 1e-4;
  auto X = [&](double v) { return L + (std::log10(std::clamp(v, x_lo, x_hi)) - std::log10(x_lo)) / 6.0 * W; };
  auto Y = [&](double v) {
    return H - B - (std::log10(std::clamp(v, y_lo, y_hi)) - std::log10(y_lo)) / (std::log10(y_hi) - std::log10(y_lo)) * (H - B - 10);
  };
  std::string out = fmt::format("<svg width=\"{}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">", L + W + 160, H);
  out += fmt::format("<rect x=\"{}\" y=\"10\" width=\"{}\" height=\"{}\" fill=\"#fafafa\" stroke=\"#ccc\"/>", L, W, H - B - 10);
  // The roof, sampled along the intensity axis.
  std::string path;
  for (int i = 0; i <= 120; ++i) {
    const double ai = std::pow(10.0, std::log10(x_lo) + 6.0 * i / 120.0);
    const double roof = r.roof.bandwidth > 0 ? std::min(r.roof.peak_flops, ai * r.roof.bandwidth) : r.roof.peak_flops;
    path += fmt::format("{}{:.1f},{:.1f} ", i ? "L" : "M", X(ai), Y(roof));
  }
  out += fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"#222\" stroke-width=\"2\"/>", path);
  for (int e = -2; e <= 4; ++e)
    out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">1e{}</text>", X(std::pow(10.0, e)),
                       H - B + 14, e);
  out += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\">FLOP per byte</text>", L + W / 2 - 40, H - 6);
  out += fmt::format("<text x=\"4\" y=\"{:.1f}\" font-size=\"11\">{:.0f} GFLOP/s</text>", Y(r.roof.peak_flops) + 4,
                     r.roof.peak_flops * 1e-9);
  for (const auto& k : r.kernels) {
    if (k.k.seconds <= 0 || k.k.flops <= 0 || k.k.bytes <= 0) continue;
    const double x = X(k.intensity), y = Y(k.k.flops / k.k.seconds);
    out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"5\" fill=\"{}\"><title>{}: {:.1f} GFLOP/s</title></circle>"
                       "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\">{}</text>",
                       x, y, color_of(k.k.category, k.k.name), escape(k.k.name), k.k.flops / k.k.seconds * 1e-9, x + 7,
                       y + 3, escape(k.k.name));
  }
  return out + "</svg>";
}

}  // namespace

std::string html_report(const StepReport& r, const std::vector<TraceSpan>& spans, const std::string& title,
                        const std::vector<std::pair<std::string, std::string>>& sections) {
  std::string out = fmt::format(
      "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>loom profile: {0}</title><style>"
      "body{{font-family:sans-serif;margin:24px;background:#fff;color:#111}} h1{{font-size:20px}} "
      "h2{{font-size:16px;margin-top:28px}} .verdict{{font-size:22px;font-weight:bold;padding:12px;"
      "background:#fff3e0;border-left:6px solid #e0663f}} .legend span{{margin-right:16px;font-size:12px}} "
      ".legend i{{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}} "
      "pre{{font-size:11px;background:#f6f6f6;padding:8px;overflow-x:auto}}</style></head><body>"
      "<h1>loom profile report: {0}</h1>",
      escape(title));
  out += fmt::format("<p class=verdict>verdict: bound by {}: {:.0f}% of the step</p><ol>", escape(r.bound_by),
                     100 * r.bound_share);
  for (const auto& o : r.opportunities)
    out += fmt::format("<li><b>[{}]</b> up to {:.1f} ms per step: {}</li>", escape(o.where), 1e3 * o.seconds, escape(o.what));
  out += "</ol>" + legend();
  out += "<h2>One step across ranks (compute above, communication below)</h2>" + timeline(r, spans);
  out += "<h2>Where each rank's step went</h2>" + breakdown_bars(r);
  out += "<h2>Kernels against the roofline</h2>" + roofline(r);
  out += "<h2>The report</h2><pre>" + escape(format_report(r)) + "</pre>";
  for (const auto& [heading, text] : sections) out += "<h2>" + escape(heading) + "</h2><pre>" + escape(text) + "</pre>";
  out += "</body></html>\n";
  return out;
}

}  // namespace loom::profile
