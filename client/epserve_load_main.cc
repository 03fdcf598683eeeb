// epserve-load: load generator for epserve's KServe v2 gRPC endpoint.
//
// Exit status: 0 when every step ran (even if requests failed); 1 for bad flags, or with
// --fail-on-error when any measured request failed; 2 when the run could not start (server
// unreachable within --connect-timeout, or the model's metadata unusable).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/infer_request.h"
#include "client/load_generator.h"
#include "client/load_stats.h"

ABSL_FLAG(std::string, target, "127.0.0.1:8001", "Server address, host:port.");
ABSL_FLAG(std::string, model, "moe", "Model name sent in every request.");
ABSL_FLAG(epserve::client::TokenRange, tokens, (epserve::client::TokenRange{32, 32}),
          "Token rows T per request: N, or A-B for a uniform draw from [A, B] per request.");
ABSL_FLAG(int64_t, hidden, 0,
          "Hidden size H of a token row; 0 asks the server (ModelMetadata: input "
          "hidden_states, shape [-1, H]).");
ABSL_FLAG(std::optional<int64_t>, layer, std::nullopt,
          "MoE layer to run, sent as the int64 request parameter 'layer'; unset: server default.");
ABSL_FLAG(std::vector<std::string>, concurrency, {},
          "Closed loop: N workers, each with one request in flight. A comma list (1,4,16) runs "
          "one step per value. Unset (and no --rate): 1.");
ABSL_FLAG(std::vector<std::string>, rate, {},
          "Open loop: send R requests/s regardless of responses; latency counts from each "
          "request's intended send time. A comma list runs one step per value. Excludes "
          "--concurrency.");
ABSL_FLAG(std::string, arrival, "constant",
          "Open-loop arrivals: 'constant' (evenly spaced) or 'poisson' (exponential gaps). "
          "Ignored in closed loop.");
ABSL_FLAG(std::optional<absl::Duration>, duration, std::nullopt,
          "Measured time per step (e.g. 30s, 2m), after the warmup. Unset (and no --requests): "
          "10s.");
ABSL_FLAG(int64_t, requests, 0,
          "Measure exactly this many requests per step instead of a --duration; 0: use "
          "--duration.");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(1),
          "Load sent at the start of every step and left out of its figures.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10),
          "Deadline of each request; a late one counts as DEADLINE_EXCEEDED.");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(10),
          "How long to wait for the server at start before giving up with exit status 2.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the payload and token-count generators.");
ABSL_FLAG(int, connections, 1, "TCP connections (gRPC channels) to spread requests over.");
ABSL_FLAG(int, threads, 0, "Completion-queue threads; 0: min(4, hardware threads).");
ABSL_FLAG(int64_t, max_outstanding, 4096,
          "Open loop: most requests in flight; a send due beyond it is not made and counts "
          "as error CLIENT_BACKLOG.");
ABSL_FLAG(bool, json, false, "Print one JSON object per step on stdout instead of tables.");
ABSL_FLAG(bool, fail_on_error, false, "Exit with status 1 if any measured request failed.");

namespace epserve::client {
namespace {

constexpr int kExitBadUsage = 1;
constexpr int kExitFailedRequests = 1;
constexpr int kExitCannotStart = 2;

constexpr absl::string_view kUsage =
    "Load generator for epserve's KServe v2 gRPC endpoint (ModelInfer).\n"
    "\n"
    "Each request carries one FP32 input 'hidden_states' of shape [T, H] with fresh random\n"
    "values in [-1, 1), and asks for output 'moe_output', which must come back FP32 [T, H]\n"
    "(otherwise the request counts as 'bad_response').\n"
    "\n"
    "  epserve-load --target 127.0.0.1:8001 --tokens 1-128 --concurrency 1,4,16\n"
    "  epserve-load --rate 200 --arrival poisson --duration 30s --json\n"
    "\n"
    "Flag names may be written with '-' or '_' (--connect-timeout = --connect_timeout).\n"
    "Latency percentiles are nearest-rank over successful requests; requests/s and\n"
    "tokens/s count successful requests. Exit status: 0 run completed (even with failed\n"
    "requests), 1 bad flags or --fail-on-error with failures, 2 server unreachable or\n"
    "model unusable.";

// absl flag names are identifiers; accept the Unix spelling too by turning '-' into '_'
// in the name part of every "--name[=value]" argument (values are left alone).
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    if (!absl::StartsWith(a, "--")) continue;
    const size_t end = std::min(a.find('='), a.size());
    std::replace(a.begin() + 2, a.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
  }
  return args;
}

absl::StatusOr<std::vector<StepSpec>> StepsFromFlags() {
  const bool rate_set = !absl::GetFlag(FLAGS_rate).empty();
  std::vector<std::string> concurrency = absl::GetFlag(FLAGS_concurrency);
  if (rate_set && !concurrency.empty()) {
    return absl::InvalidArgumentError(
        "--rate (open loop) and --concurrency (closed loop) exclude each other");
  }
  std::vector<StepSpec> steps;
  if (rate_set) {
    absl::StatusOr<Arrival> arrival = ParseArrival(absl::GetFlag(FLAGS_arrival));
    if (!arrival.ok()) return arrival.status();
    for (const std::string& text : absl::GetFlag(FLAGS_rate)) {
      StepSpec step;
      step.mode = LoadMode::kOpenLoop;
      step.arrival = *arrival;
      if (!absl::SimpleAtod(text, &step.rate_per_s) || !(step.rate_per_s > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("rate: '", text, "' is not a number of requests/s > 0"));
      }
      steps.push_back(step);
    }
  } else {
    if (concurrency.empty()) concurrency = {"1"};
    for (const std::string& text : concurrency) {
      StepSpec step;
      step.mode = LoadMode::kClosedLoop;
      if (!absl::SimpleAtoi(text, &step.concurrency) || step.concurrency < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("concurrency: '", text, "' is not an integer >= 1"));
      }
      steps.push_back(step);
    }
  }
  if (steps.empty())
    return absl::InvalidArgumentError("no step to run: empty --rate/--concurrency");
  return steps;
}

std::string DescribeRun(const std::string& target, const LoadOptions& o, int connections) {
  return absl::StrCat(
      "epserve-load: target ", target, ", model \"", o.request.model_name, "\", hidden ",
      o.request.hidden_size, ", tokens ", FormatTokenRange(o.tokens), ", layer ",
      o.request.layer.has_value() ? absl::StrCat(*o.request.layer) : std::string("-"), ", warmup ",
      absl::FormatDuration(o.warmup), ", ",
      o.num_requests > 0 ? absl::StrCat(o.num_requests, " requests")
                         : absl::StrCat("duration ", absl::FormatDuration(o.duration)),
      " per step, timeout ", absl::FormatDuration(o.timeout), ", connections ", connections,
      ", threads ", o.num_threads);
}

int Main(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  // --help lists the flags of this file (absl would otherwise look for a file named after
  // the binary, epserve-load).
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "epserve_load_main");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  usage_config.normalize_filename = [](absl::string_view file) {
    const size_t slash = file.rfind('/');
    return std::string(slash == absl::string_view::npos ? file : file.substr(slash + 1));
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(kUsage);

  std::vector<std::string> args = NormalizeFlagNames(argc, argv);
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(arg_ptrs.size()), arg_ptrs.data());
  if (positional.size() > 1) {
    std::cerr << "epserve-load: unexpected argument '" << positional[1] << "'; see --help\n";
    return kExitBadUsage;
  }

  absl::StatusOr<std::vector<StepSpec>> steps = StepsFromFlags();
  if (!steps.ok()) {
    std::cerr << "epserve-load: " << steps.status().message() << "\n";
    return kExitBadUsage;
  }
  const std::optional<absl::Duration> duration = absl::GetFlag(FLAGS_duration);
  if (duration.has_value() && absl::GetFlag(FLAGS_requests) > 0) {
    std::cerr << "epserve-load: --duration and --requests exclude each other\n";
    return kExitBadUsage;
  }

  LoadOptions options;
  options.request.model_name = absl::GetFlag(FLAGS_model);
  options.request.hidden_size = absl::GetFlag(FLAGS_hidden);
  options.request.layer = absl::GetFlag(FLAGS_layer);
  options.tokens = absl::GetFlag(FLAGS_tokens);
  options.duration = duration.value_or(absl::Seconds(10));
  options.num_requests = absl::GetFlag(FLAGS_requests);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.max_outstanding = absl::GetFlag(FLAGS_max_outstanding);
  options.num_threads = absl::GetFlag(FLAGS_threads);
  if (options.num_threads == 0) {
    options.num_threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  }
  const std::string target = absl::GetFlag(FLAGS_target);
  const int connections = absl::GetFlag(FLAGS_connections);
  if (options.request.hidden_size < 0) {
    std::cerr << "epserve-load: --hidden must be >= 0 (0 asks the server)\n";
    return kExitBadUsage;
  }
  if (connections < 1) {
    std::cerr << "epserve-load: --connections must be >= 1\n";
    return kExitBadUsage;
  }

  auto channels = MakeChannels(target, connections);
  if (absl::Status s = WaitForChannels(channels, target, absl::GetFlag(FLAGS_connect_timeout));
      !s.ok()) {
    std::cerr << "epserve-load: " << s.message() << "\n";
    return kExitCannotStart;
  }
  if (options.request.hidden_size == 0) {
    absl::StatusOr<int64_t> hidden =
        QueryHiddenSize(channels.front(), options.request.model_name, options.timeout);
    if (!hidden.ok()) {
      std::cerr << "epserve-load: cannot learn the hidden size (pass --hidden to skip): "
                << hidden.status().message() << "\n";
      return kExitCannotStart;
    }
    options.request.hidden_size = *hidden;
  }

  LoadGenerator generator(channels, options);
  for (const StepSpec& step : *steps) {
    if (absl::Status s = generator.Validate(step); !s.ok()) {
      std::cerr << "epserve-load: " << s.message() << "\n";
      return kExitBadUsage;
    }
  }

  const bool json = absl::GetFlag(FLAGS_json);
  std::cerr << DescribeRun(target, options, connections) << "\n";
  bool any_error = false;
  for (size_t i = 0; i < steps->size(); ++i) {
    const StepSpec& step = (*steps)[i];
    std::cerr << "epserve-load: step " << i + 1 << "/" << steps->size() << ": "
              << (step.mode == LoadMode::kClosedLoop
                      ? absl::StrCat("concurrency ", step.concurrency)
                      : absl::StrCat("rate ", step.rate_per_s, "/s ", ArrivalName(step.arrival)))
              << "\n";
    StepReport report = generator.RunStep(step, static_cast<int>(i));
    any_error = any_error || report.num_requests != report.num_ok;
    if (json) {
      std::cout << FormatStepJson(report) << std::endl;
    } else {
      std::cout << FormatStepTable(report) << std::flush;
    }
  }
  if (any_error && absl::GetFlag(FLAGS_fail_on_error)) return kExitFailedRequests;
  return 0;
}

}  // namespace
}  // namespace epserve::client

int main(int argc, char** argv) { return epserve::client::Main(argc, argv); }
