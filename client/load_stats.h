// Load-test statistics: exact latency samples, nearest-rank percentiles, and the report of
// one load step as a human table or one JSON object. Pure functions and plain values, no
// I/O and no gRPC, so that tests can check them directly.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace epserve::client {

// Error key for a response that arrived with status OK but failed CheckInferResponse.
inline constexpr absl::string_view kBadResponse = "bad_response";
// Error key for an answer that differs from the reference forward pass (--verify).
inline constexpr absl::string_view kVerifyMismatch = "verify_mismatch";

// Canonical upper-case name of a gRPC status code ("OK", "UNAVAILABLE", ...), or
// "CODE_<n>" for a value outside the 17 defined codes.
std::string StatusCodeName(int code);

// Nearest-rank percentile of `sorted_ns` (ascending; must not be empty): the sample at
// 1-based rank ceil(percentile / 100 * n), clamped to [1, n]. It is always one of the
// samples, never an interpolation: at least `percentile`% of the samples are <= it.
// percentile 0 gives the minimum, 100 the maximum. `percentile` must be in [0, 100].
// Example: samples {10, 20, 30, 40}: p50 = 20 (rank 2), p90 = 40 (rank ceil(3.6) = 4).
int64_t NearestRankPercentile(std::span<const int64_t> sorted_ns, double percentile);

// Latency percentiles of one step, in nanoseconds.
struct LatencySummary {
  int64_t p50_ns = 0;
  int64_t p90_ns = 0;
  int64_t p95_ns = 0;
  int64_t p99_ns = 0;
  int64_t p999_ns = 0;
  int64_t max_ns = 0;
};

// Sorts `samples_ns` in place and summarises them; nullopt when there are none.
std::optional<LatencySummary> SummarizeLatencies(std::vector<int64_t>& samples_ns);

// What one thread of the load generator (a completion-queue lane, a stream reader or the
// open-loop pacer) observed during the measured part of a step.
// Not thread-safe: each instance has one owning thread until the step ends, when the
// owners' instances are merged on the main thread.
struct ThreadStats {
  std::vector<int64_t> latency_ns;        // one sample per successful request
  int64_t num_ok = 0;                     // successful requests
  int64_t num_verified = 0;               // of them, checked against the reference
  int64_t num_ok_tokens = 0;              // token rows carried by successful requests
  std::map<std::string, int64_t> errors;  // failed requests by StatusCodeName or kBadResponse
  // The first error message seen per key, to show the user why requests failed.
  std::map<std::string, std::string> error_examples;

  void RecordOk(int64_t latency_ns_value, int64_t tokens);
  void RecordError(absl::string_view key, absl::string_view message);
  // Moves `other`'s samples and counts into this one.
  void MergeFrom(ThreadStats&& other);
};

// Where the server says the time of a step's requests went: differences of ModelStatistics
// between the opening of the measured window and the step's end. Means are per
// successful request (Triton's queue and compute_* durations), in milliseconds.
struct ServerSplit {
  int64_t requests = 0;  // successful requests the server finished in between
  int64_t failed = 0;    // requests it failed in between
  double queue_ms = 0;
  double compute_input_ms = 0;
  double compute_infer_ms = 0;
  double compute_output_ms = 0;
  int64_t batches = 0;         // batches the workers ran
  double mean_batch_rows = 0;  // token rows per batch
};

// How a step offered its load.
enum class LoadMode {
  kClosedLoop,  // `concurrency` slots, each with one request in flight
  kOpenLoop,    // requests sent at `rate_per_s`, whatever the responses do
};

// The figures of one step, as printed.
struct StepReport {
  LoadMode mode = LoadMode::kClosedLoop;
  int concurrency = 0;       // closed loop only
  double rate_per_s = 0;     // open loop only: offered requests per second
  std::string arrival;       // open loop only: "constant" or "poisson"
  int64_t num_requests = 0;  // measured requests completed: num_ok + sum(errors)
  int64_t num_ok = 0;
  int64_t num_ok_tokens = 0;
  std::map<std::string, int64_t> errors;
  std::map<std::string, std::string> error_examples;
  double duration_seconds = 0;            // length of the measured window (see load_generator.h)
  std::optional<LatencySummary> latency;  // over successful requests; nullopt if none
  int64_t num_verified = 0;               // successful answers checked by --verify
  std::optional<ServerSplit> server;      // nullopt when not asked for or not available

  // Successful requests per second and their token rows per second; 0 for an empty window.
  double RequestsPerSecond() const;
  double TokensPerSecond() const;
};

// Builds a step's report from its merged stats. Sorts stats.latency_ns.
StepReport MakeStepReport(LoadMode mode, int concurrency, double rate_per_s, std::string arrival,
                          ThreadStats& stats, double duration_seconds);

// A human-readable table for one step, ending in a newline.
std::string FormatStepTable(const StepReport& report);

// One JSON object on one line (no trailing newline), with stable keys:
//   {"mode":"closed"|"open","concurrency":N|null,"rate":R|null,"arrival":S|null,
//    "requests":N,"ok":N,"errors":{"UNAVAILABLE":3,...},"duration_s":X,
//    "requests_per_s":X,"tokens_per_s":X,
//    "latency_ms":{"p50":X,"p90":X,"p95":X,"p99":X,"p999":X,"max":X},
//    "error_examples":{"UNAVAILABLE":"..."},"tokens":N,"verified":N,
//    "server":{"requests":N,"failed":N,"queue_ms":X,"compute_input_ms":X,
//              "compute_infer_ms":X,"compute_output_ms":X,"batches":N,
//              "mean_batch_rows":X}|null}
// Latency values are null when no request succeeded. "tokens" counts the token rows of
// successful requests.
std::string FormatStepJson(const StepReport& report);

// CSV: a header line, then one line per step (both without trailing newline). Columns:
// mode, concurrency, rate, arrival, requests, ok, errors (total), duration_s,
// requests_per_s, tokens_per_s, p50_ms .. max_ms, server_queue_ms,
// server_compute_input_ms, server_compute_infer_ms, server_compute_output_ms,
// server_mean_batch_rows, error_breakdown ("CODE=n;CODE=n"). Empty fields where a value
// does not apply.
std::string CsvHeader();
std::string FormatStepCsv(const StepReport& report);

// A self-contained SVG chart of the steps: latency percentiles (p50, p90, p99, p99.9, in
// ms) against throughput (tokens/s), one point per step, one line per percentile.
// Steps without a successful request are left out.
std::string PlotSvg(const std::vector<StepReport>& reports, absl::string_view title);

// `text` as a JSON string literal, quotes included.
std::string JsonQuote(absl::string_view text);

}  // namespace epserve::client
