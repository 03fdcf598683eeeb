#include "client/load_stats.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace epserve::client {

std::string StatusCodeName(int code) {
  static constexpr absl::string_view kNames[] = {"OK",
                                                 "CANCELLED",
                                                 "UNKNOWN",
                                                 "INVALID_ARGUMENT",
                                                 "DEADLINE_EXCEEDED",
                                                 "NOT_FOUND",
                                                 "ALREADY_EXISTS",
                                                 "PERMISSION_DENIED",
                                                 "RESOURCE_EXHAUSTED",
                                                 "FAILED_PRECONDITION",
                                                 "ABORTED",
                                                 "OUT_OF_RANGE",
                                                 "UNIMPLEMENTED",
                                                 "INTERNAL",
                                                 "UNAVAILABLE",
                                                 "DATA_LOSS",
                                                 "UNAUTHENTICATED"};
  if (code >= 0 && code < static_cast<int>(std::size(kNames))) return std::string(kNames[code]);
  return absl::StrCat("CODE_", code);
}

int64_t NearestRankPercentile(std::span<const int64_t> sorted_ns, double percentile) {
  assert(!sorted_ns.empty());
  assert(percentile >= 0 && percentile <= 100);
  const auto n = static_cast<int64_t>(sorted_ns.size());
  const double exact_rank = percentile / 100.0 * static_cast<double>(n);
  // p/100*n is computed in binary floating point: 99.9/100*1000 comes out a hair above
  // 999. A relative tolerance far below one rank keeps such exact ranks exact.
  auto rank = static_cast<int64_t>(std::ceil(exact_rank - 1e-9 * std::max(1.0, exact_rank)));
  rank = std::clamp<int64_t>(rank, 1, n);
  return sorted_ns[static_cast<size_t>(rank - 1)];
}

std::optional<LatencySummary> SummarizeLatencies(std::vector<int64_t>& samples_ns) {
  if (samples_ns.empty()) return std::nullopt;
  std::sort(samples_ns.begin(), samples_ns.end());
  LatencySummary s;
  s.p50_ns = NearestRankPercentile(samples_ns, 50);
  s.p90_ns = NearestRankPercentile(samples_ns, 90);
  s.p95_ns = NearestRankPercentile(samples_ns, 95);
  s.p99_ns = NearestRankPercentile(samples_ns, 99);
  s.p999_ns = NearestRankPercentile(samples_ns, 99.9);
  s.max_ns = samples_ns.back();
  return s;
}

void ThreadStats::RecordOk(int64_t latency_ns_value, int64_t tokens) {
  latency_ns.push_back(latency_ns_value);
  ++num_ok;
  num_ok_tokens += tokens;
}

void ThreadStats::RecordError(absl::string_view key, absl::string_view message) {
  auto [it, inserted] = errors.try_emplace(std::string(key), 0);
  ++it->second;
  if (inserted) error_examples.emplace(std::string(key), std::string(message));
}

void ThreadStats::MergeFrom(ThreadStats&& other) {
  if (latency_ns.empty()) {
    latency_ns = std::move(other.latency_ns);
  } else {
    latency_ns.insert(latency_ns.end(), other.latency_ns.begin(), other.latency_ns.end());
  }
  num_ok += other.num_ok;
  num_ok_tokens += other.num_ok_tokens;
  num_verified += other.num_verified;
  for (const auto& [key, count] : other.errors) errors[key] += count;
  for (auto& [key, message] : other.error_examples)
    error_examples.try_emplace(key, std::move(message));
  other = ThreadStats();
}

double StepReport::RequestsPerSecond() const {
  return duration_seconds > 0 ? static_cast<double>(num_ok) / duration_seconds : 0.0;
}

double StepReport::TokensPerSecond() const {
  return duration_seconds > 0 ? static_cast<double>(num_ok_tokens) / duration_seconds : 0.0;
}

StepReport MakeStepReport(LoadMode mode, int concurrency, double rate_per_s, std::string arrival,
                          ThreadStats& stats, double duration_seconds) {
  StepReport r;
  r.mode = mode;
  r.concurrency = concurrency;
  r.rate_per_s = rate_per_s;
  r.arrival = std::move(arrival);
  r.num_ok = stats.num_ok;
  r.num_ok_tokens = stats.num_ok_tokens;
  r.errors = stats.errors;
  r.error_examples = stats.error_examples;
  r.num_requests = stats.num_ok;
  for (const auto& [key, count] : stats.errors) r.num_requests += count;
  r.duration_seconds = duration_seconds;
  r.latency = SummarizeLatencies(stats.latency_ns);
  r.num_verified = stats.num_verified;
  return r;
}

namespace {

double NsToMs(int64_t ns) { return static_cast<double>(ns) / 1e6; }

std::string StepTitle(const StepReport& r) {
  if (r.mode == LoadMode::kClosedLoop) {
    return absl::StrCat("closed loop, concurrency ", r.concurrency);
  }
  return absl::StrFormat("open loop, %s arrivals at %.6g req/s", r.arrival, r.rate_per_s);
}

}  // namespace

std::string FormatStepTable(const StepReport& r) {
  std::string out = absl::StrCat("== ", StepTitle(r), "\n");
  const int64_t num_errors = r.num_requests - r.num_ok;
  absl::StrAppendFormat(&out, "  %-14s %.3f s\n", "duration", r.duration_seconds);
  absl::StrAppendFormat(&out, "  %-14s %d (ok %d, errors %d)\n", "requests", r.num_requests,
                        r.num_ok, num_errors);
  absl::StrAppendFormat(&out, "  %-14s %.2f req/s   %.1f tokens/s\n", "throughput",
                        r.RequestsPerSecond(), r.TokensPerSecond());
  if (r.latency.has_value()) {
    const LatencySummary& l = *r.latency;
    absl::StrAppendFormat(&out, "  %-14s %9s %9s %9s %9s %9s %9s\n", "latency (ms)", "p50", "p90",
                          "p95", "p99", "p99.9", "max");
    absl::StrAppendFormat(&out, "  %-14s %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f\n", "",
                          NsToMs(l.p50_ns), NsToMs(l.p90_ns), NsToMs(l.p95_ns), NsToMs(l.p99_ns),
                          NsToMs(l.p999_ns), NsToMs(l.max_ns));
  } else {
    absl::StrAppendFormat(&out, "  %-14s - (no successful request)\n", "latency (ms)");
  }
  if (r.num_verified > 0) {
    absl::StrAppendFormat(&out, "  %-14s %d answers match the reference\n", "verified",
                          r.num_verified);
  }
  if (r.server.has_value()) {
    const ServerSplit& s = *r.server;
    absl::StrAppendFormat(&out, "  %-14s %9s %9s %9s %9s   %d requests, %d batches of %.1f rows\n",
                          "server (ms)", "queue", "input", "infer", "output", s.requests, s.batches,
                          s.mean_batch_rows);
    absl::StrAppendFormat(&out, "  %-14s %9.3f %9.3f %9.3f %9.3f\n", "  mean", s.queue_ms,
                          s.compute_input_ms, s.compute_infer_ms, s.compute_output_ms);
  }
  for (const auto& [key, count] : r.errors) {
    std::string example;
    if (auto it = r.error_examples.find(key); it != r.error_examples.end() && !it->second.empty()) {
      example = absl::StrCat("  e.g. \"", it->second, "\"");
    }
    absl::StrAppendFormat(&out, "  %-14s %-20s %d%s\n", "error", key, count, example);
  }
  return out;
}

std::string JsonQuote(absl::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

std::string FormatStepJson(const StepReport& r) {
  const bool closed = r.mode == LoadMode::kClosedLoop;
  std::string out = absl::StrCat("{\"mode\":", closed ? "\"closed\"" : "\"open\"");
  absl::StrAppend(&out, ",\"concurrency\":", closed ? absl::StrCat(r.concurrency) : "null");
  absl::StrAppend(&out, ",\"rate\":", closed ? "null" : absl::StrFormat("%.6g", r.rate_per_s));
  absl::StrAppend(&out, ",\"arrival\":", closed ? "null" : JsonQuote(r.arrival));
  absl::StrAppend(&out, ",\"requests\":", r.num_requests, ",\"ok\":", r.num_ok);
  absl::StrAppend(&out, ",\"errors\":{",
                  absl::StrJoin(r.errors, ",",
                                [](std::string* o, const auto& kv) {
                                  absl::StrAppend(o, JsonQuote(kv.first), ":", kv.second);
                                }),
                  "}");
  absl::StrAppendFormat(&out, ",\"duration_s\":%.6f,\"requests_per_s\":%.3f,\"tokens_per_s\":%.3f",
                        r.duration_seconds, r.RequestsPerSecond(), r.TokensPerSecond());
  out += ",\"latency_ms\":{";
  const std::pair<const char*, int64_t LatencySummary::*> fields[] = {
      {"p50", &LatencySummary::p50_ns},   {"p90", &LatencySummary::p90_ns},
      {"p95", &LatencySummary::p95_ns},   {"p99", &LatencySummary::p99_ns},
      {"p999", &LatencySummary::p999_ns}, {"max", &LatencySummary::max_ns}};
  for (size_t i = 0; i < std::size(fields); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ",", "\"", fields[i].first, "\":",
                    r.latency.has_value()
                        ? absl::StrFormat("%.6f", NsToMs((*r.latency).*fields[i].second))
                        : std::string("null"));
  }
  out += "}";
  absl::StrAppend(&out, ",\"error_examples\":{",
                  absl::StrJoin(r.error_examples, ",",
                                [](std::string* o, const auto& kv) {
                                  absl::StrAppend(o, JsonQuote(kv.first), ":",
                                                  JsonQuote(kv.second));
                                }),
                  "}");
  absl::StrAppend(&out, ",\"tokens\":", r.num_ok_tokens, ",\"verified\":", r.num_verified);
  if (r.server.has_value()) {
    const ServerSplit& s = *r.server;
    absl::StrAppendFormat(&out,
                          ",\"server\":{\"requests\":%d,\"failed\":%d,\"queue_ms\":%.6f,"
                          "\"compute_input_ms\":%.6f,\"compute_infer_ms\":%.6f,"
                          "\"compute_output_ms\":%.6f,\"batches\":%d,\"mean_batch_rows\":%.3f}",
                          s.requests, s.failed, s.queue_ms, s.compute_input_ms, s.compute_infer_ms,
                          s.compute_output_ms, s.batches, s.mean_batch_rows);
  } else {
    out += ",\"server\":null";
  }
  out += "}";
  return out;
}

std::string CsvHeader() {
  return "mode,concurrency,rate,arrival,requests,ok,errors,duration_s,requests_per_s,"
         "tokens_per_s,p50_ms,p90_ms,p95_ms,p99_ms,p999_ms,max_ms,server_queue_ms,"
         "server_compute_input_ms,server_compute_infer_ms,server_compute_output_ms,"
         "server_mean_batch_rows,error_breakdown";
}

std::string FormatStepCsv(const StepReport& r) {
  const bool closed = r.mode == LoadMode::kClosedLoop;
  std::string out = absl::StrCat(
      closed ? "closed" : "open", ",", closed ? absl::StrCat(r.concurrency) : "", ",",
      closed ? "" : absl::StrFormat("%.6g", r.rate_per_s), ",", closed ? "" : r.arrival, ",",
      r.num_requests, ",", r.num_ok, ",", r.num_requests - r.num_ok);
  absl::StrAppendFormat(&out, ",%.6f,%.3f,%.3f", r.duration_seconds, r.RequestsPerSecond(),
                        r.TokensPerSecond());
  for (int64_t LatencySummary::*field :
       {&LatencySummary::p50_ns, &LatencySummary::p90_ns, &LatencySummary::p95_ns,
        &LatencySummary::p99_ns, &LatencySummary::p999_ns, &LatencySummary::max_ns}) {
    out += ",";
    if (r.latency.has_value()) absl::StrAppendFormat(&out, "%.6f", NsToMs((*r.latency).*field));
  }
  if (r.server.has_value()) {
    absl::StrAppendFormat(&out, ",%.6f,%.6f,%.6f,%.6f,%.3f", r.server->queue_ms,
                          r.server->compute_input_ms, r.server->compute_infer_ms,
                          r.server->compute_output_ms, r.server->mean_batch_rows);
  } else {
    out += ",,,,,";
  }
  absl::StrAppend(&out, ",", absl::StrJoin(r.errors, ";", [](std::string* o, const auto& kv) {
    absl::StrAppend(o, kv.first, "=", kv.second);
  }));
  return out;
}

}  // namespace epserve::client
