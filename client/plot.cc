// PlotSvg (declared in load_stats.h): latency percentiles against throughput as SVG.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/load_stats.h"

namespace epserve::client {
namespace {

// One line of the chart: a latency percentile, its field of LatencySummary and its colour.
struct Series {
  const char* name;
  int64_t LatencySummary::*field;
  const char* color;
};
constexpr Series kSeries[] = {{"p50", &LatencySummary::p50_ns, "#1f77b4"},
                              {"p90", &LatencySummary::p90_ns, "#2ca02c"},
                              {"p99", &LatencySummary::p99_ns, "#ff7f0e"},
                              {"p99.9", &LatencySummary::p999_ns, "#d62728"}};

// The canvas, in pixels: the plot area is inset by the margins (the legend on the right).
constexpr double kWidth = 760, kHeight = 480, kLeft = 80, kRight = 130, kTop = 40, kBottom = 60;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks up to `max`.
double TickStep(double max, int ticks) {
  const double raw = max / ticks;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

std::string Escape(absl::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else if (c == '&') {
      out += "&amp;";
    } else {
      out += c;
    }
  }
  return out;
}

// The axes: throughput (tokens/s) from 0 to max_x, latency (ms) from 0 to max_y, rounded up
// to whole tick steps, and their mapping to pixels.
struct Axes {
  double max_x = 1, max_y = 0.001;
  double step_x = 0, step_y = 0;

  double Px(double x) const { return kLeft + x / max_x * kPlotW; }
  double Py(double y) const { return kTop + kPlotH - y / max_y * kPlotH; }
};

// The steps with a successful request, by throughput.
std::vector<const StepReport*> PlottedSteps(const std::vector<StepReport>& reports) {
  std::vector<const StepReport*> points;
  for (const StepReport& r : reports)
    if (r.latency.has_value()) points.push_back(&r);
  std::sort(points.begin(), points.end(), [](const StepReport* a, const StepReport* b) {
    return a->TokensPerSecond() < b->TokensPerSecond();
  });
  return points;
}

// Axes 5% beyond the largest throughput and p99.9 latency.
Axes AxesFor(const std::vector<const StepReport*>& points) {
  Axes a;
  for (const StepReport* r : points) {
    a.max_x = std::max(a.max_x, r->TokensPerSecond());
    a.max_y = std::max(a.max_y, static_cast<double>(r->latency->p999_ns) / 1e6);
  }
  a.step_x = TickStep(a.max_x * 1.05, 6);
  a.step_y = TickStep(a.max_y * 1.05, 6);
  a.max_x = std::ceil(a.max_x * 1.05 / a.step_x) * a.step_x;
  a.max_y = std::ceil(a.max_y * 1.05 / a.step_y) * a.step_y;
  return a;
}

// The opening tag, the white background and the title.
std::string SvgHeader(absl::string_view title) {
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">%s</text>\n",
      kWidth, kHeight, kLeft + kPlotW / 2, Escape(title));
}

// Grid lines with their tick labels, the plot area's border and the axis titles.
void AppendGrid(const Axes& a, std::string* out) {
  for (double x = 0; x <= a.max_x + a.step_x / 2; x += a.step_x) {
    absl::StrAppendFormat(out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                          a.Px(x), a.Py(0), a.Px(x), a.Py(a.max_y), a.Px(x), a.Py(0) + 18, x);
  }
  for (double y = 0; y <= a.max_y + a.step_y / 2; y += a.step_y) {
    absl::StrAppendFormat(out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                          a.Px(0), a.Py(y), a.Px(a.max_x), a.Py(y), a.Px(0) - 6, a.Py(y) + 4, y);
  }
  absl::StrAppendFormat(out,
                        "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                        "stroke=\"black\"/>\n"
                        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">throughput "
                        "(tokens/s)</text>\n"
                        "<text x=\"18\" y=\"%.1f\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 18 %.1f)\">latency (ms)</text>\n",
                        kLeft, kTop, kPlotW, kPlotH, kLeft + kPlotW / 2, kHeight - 15,
                        kTop + kPlotH / 2, kTop + kPlotH / 2);
}

// Series `s` of kSeries: its line through the points, a marker per point, its legend entry.
void AppendSeries(const Axes& a, const std::vector<const StepReport*>& points, size_t s,
                  std::string* out) {
  const Series& se = kSeries[s];
  std::string path;
  for (const StepReport* r : points) {
    absl::StrAppendFormat(&path, "%s%.1f,%.1f", path.empty() ? "" : " ", a.Px(r->TokensPerSecond()),
                          a.Py(static_cast<double>((*r->latency).*se.field) / 1e6));
  }
  absl::StrAppendFormat(out,
                        "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" "
                        "stroke-width=\"2\"/>\n",
                        path, se.color);
  for (const StepReport* r : points) {
    absl::StrAppendFormat(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
                          a.Px(r->TokensPerSecond()),
                          a.Py(static_cast<double>((*r->latency).*se.field) / 1e6), se.color);
  }
  const double ly = kTop + 10 + 20 * static_cast<double>(s);
  absl::StrAppendFormat(out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                        "stroke-width=\"2\"/><text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                        kWidth - kRight + 15, ly, kWidth - kRight + 40, ly, se.color,
                        kWidth - kRight + 46, ly + 4, se.name);
}

// Each point's step: concurrency or offered rate, beside the p50 marker.
void AppendStepLabels(const Axes& a, const std::vector<const StepReport*>& points,
                      std::string* out) {
  for (const StepReport* r : points) {
    const std::string label = r->mode == LoadMode::kClosedLoop
                                  ? absl::StrCat("c=", r->concurrency)
                                  : absl::StrFormat("%.4g/s", r->rate_per_s);
    absl::StrAppendFormat(out,
                          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" fill=\"#555\">%s</text>\n",
                          a.Px(r->TokensPerSecond()) + 5,
                          a.Py(static_cast<double>(r->latency->p50_ns) / 1e6) + 14, label);
  }
}

}  // namespace

std::string PlotSvg(const std::vector<StepReport>& reports, absl::string_view title) {
  const std::vector<const StepReport*> points = PlottedSteps(reports);
  const Axes axes = AxesFor(points);
  std::string out = SvgHeader(title);
  AppendGrid(axes, &out);
  for (size_t s = 0; s < std::size(kSeries); ++s) AppendSeries(axes, points, s, &out);
  AppendStepLabels(axes, points, &out);
  out += "</svg>\n";
  return out;
}

}  // namespace epserve::client
