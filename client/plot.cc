// PlotSvg (declared in load_stats.h): latency percentiles against throughput as SVG.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/load_stats.h"

namespace epserve::client {
namespace {

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

}  // namespace

std::string PlotSvg(const std::vector<StepReport>& reports, absl::string_view title) {
  struct Series {
    const char* name;
    int64_t LatencySummary::*field;
    const char* color;
  };
  const Series series[] = {{"p50", &LatencySummary::p50_ns, "#1f77b4"},
                           {"p90", &LatencySummary::p90_ns, "#2ca02c"},
                           {"p99", &LatencySummary::p99_ns, "#ff7f0e"},
                           {"p99.9", &LatencySummary::p999_ns, "#d62728"}};
  std::vector<const StepReport*> points;
  for (const StepReport& r : reports)
    if (r.latency.has_value()) points.push_back(&r);
  std::sort(points.begin(), points.end(), [](const StepReport* a, const StepReport* b) {
    return a->TokensPerSecond() < b->TokensPerSecond();
  });
  double max_x = 1, max_y = 0.001;
  for (const StepReport* r : points) {
    max_x = std::max(max_x, r->TokensPerSecond());
    max_y = std::max(max_y, static_cast<double>(r->latency->p999_ns) / 1e6);
  }
  const double step_x = TickStep(max_x * 1.05, 6), step_y = TickStep(max_y * 1.05, 6);
  max_x = std::ceil(max_x * 1.05 / step_x) * step_x;
  max_y = std::ceil(max_y * 1.05 / step_y) * step_y;

  constexpr double kWidth = 760, kHeight = 480, kLeft = 80, kRight = 130, kTop = 40, kBottom = 60;
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + x / max_x * plot_w; };
  auto py = [&](double y) { return kTop + plot_h - y / max_y * plot_h; };

  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">%s</text>\n",
      kWidth, kHeight, kLeft + plot_w / 2, Escape(title));
  for (double x = 0; x <= max_x + step_x / 2; x += step_x) {
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                          px(x), py(0), px(x), py(max_y), px(x), py(0) + 18, x);
  }
  for (double y = 0; y <= max_y + step_y / 2; y += step_y) {
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                          px(0), py(y), px(max_x), py(y), px(0) - 6, py(y) + 4, y);
  }
  absl::StrAppendFormat(&out,
                        "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                        "stroke=\"black\"/>\n"
                        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">throughput "
                        "(tokens/s)</text>\n"
                        "<text x=\"18\" y=\"%.1f\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 18 %.1f)\">latency (ms)</text>\n",
                        kLeft, kTop, plot_w, plot_h, kLeft + plot_w / 2, kHeight - 15,
                        kTop + plot_h / 2, kTop + plot_h / 2);
  for (size_t s = 0; s < std::size(series); ++s) {
    const Series& se = series[s];
    std::string path;
    for (const StepReport* r : points) {
      absl::StrAppendFormat(&path, "%s%.1f,%.1f", path.empty() ? "" : " ", px(r->TokensPerSecond()),
                            py(static_cast<double>((*r->latency).*se.field) / 1e6));
    }
    absl::StrAppendFormat(&out,
                          "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" "
                          "stroke-width=\"2\"/>\n",
                          path, se.color);
    for (const StepReport* r : points) {
      absl::StrAppendFormat(&out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
                            px(r->TokensPerSecond()),
                            py(static_cast<double>((*r->latency).*se.field) / 1e6), se.color);
    }
    const double ly = kTop + 10 + 20 * static_cast<double>(s);
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                          "stroke-width=\"2\"/><text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                          kWidth - kRight + 15, ly, kWidth - kRight + 40, ly, se.color,
                          kWidth - kRight + 46, ly + 4, se.name);
  }
  // Each point's step: concurrency or offered rate, beside the p50 marker.
  for (const StepReport* r : points) {
    const std::string label = r->mode == LoadMode::kClosedLoop
                                  ? absl::StrCat("c=", r->concurrency)
                                  : absl::StrFormat("%.4g/s", r->rate_per_s);
    absl::StrAppendFormat(&out,
                          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" fill=\"#555\">%s</text>\n",
                          px(r->TokensPerSecond()) + 5,
                          py(static_cast<double>(r->latency->p50_ns) / 1e6) + 14, label);
  }
  out += "</svg>\n";
  return out;
}

}  // namespace epserve::client
