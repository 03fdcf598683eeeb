#include "client/load_flags.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/infer_request.h"
#include "common/files.h"
#include "common/status.h"

namespace epserve::client {

const char kLoadUsageSummary[] =
    "Load generator for epserve's KServe v2 gRPC endpoint (ModelInfer or ModelStreamInfer).\n"
    "\n"
    "Each request carries one input 'hidden_states' of shape [T, H] (--dtype FP32, BF16 or\n"
    "FP16) with fresh random values in [-1, 1), and asks for output 'moe_output', which must\n"
    "come back in the same datatype and shape (otherwise the request counts as\n"
    "'bad_response').\n"
    "\n"
    "  epserve-load --target 127.0.0.1:8001 --tokens 1-128 --concurrency 1,4,16\n"
    "  epserve-load --rate 200 --arrival poisson --duration 30s --json\n"
    "  epserve-load --concurrency 1,4,16,64 --csv --plot sweep.svg\n"
    "  epserve-load --verify-model synthetic:tiny --requests 100\n"
    "\n"
    "Flag names may be written with '-' or '_' (--connect-timeout = --connect_timeout).\n"
    "Latency percentiles are nearest-rank over successful requests; requests/s and\n"
    "tokens/s count successful requests. Closed-loop latency runs from the send, open-loop\n"
    "latency from the request's intended send time on the arrival schedule. The server's\n"
    "split (queue, compute) comes from ModelStatistics read when the measured window opens\n"
    "(a closed loop's measured requests start once that read has answered) and after the\n"
    "step. Exit status: 0 run completed (even with failed requests), 1 bad\n"
    "flags or --fail-on-error with failures, 2 the run cannot start.";

namespace {

// What each request carries and where it goes.
void RegisterRequestFlags(common::FlagSet& fs, LoadFlags& f) {
  fs.Add("target", &f.target, "Server address, host:port");
  fs.Add("model", &f.model, "Model name sent in every request");
  fs.Add("tokens", &f.tokens,
         "Token rows T per request: N, or A-B for a uniform draw from [A, B] per request");
  fs.Add("hidden", &f.hidden,
         "Hidden size H of a token row; 0 asks the server (ModelMetadata: input hidden_states, "
         "shape [-1, H])");
  fs.Add("layer", &f.layer,
         "MoE layer to run, sent as the int64 request parameter 'layer'; empty: server default");
}

// How much load each step offers, and for how long.
void RegisterStepFlags(common::FlagSet& fs, LoadFlags& f) {
  fs.Add("concurrency", &f.concurrency,
         "Closed loop: N workers, each with one request in flight. A comma list (1,4,16) runs "
         "one step per value. Empty (and no --rate): 1");
  fs.Add("rate", &f.rate,
         "Open loop: send R requests/s regardless of responses; latency counts from each "
         "request's intended send time. A comma list runs one step per value. Excludes "
         "--concurrency");
  fs.Add("arrival", &f.arrival,
         "Open-loop arrivals: 'constant' (evenly spaced) or 'poisson' (exponential gaps)");
  fs.Add("duration", &f.duration,
         "Measured time per step (e.g. 30s, 2m), after the warmup. Empty (and no --requests): "
         "10s");
  fs.Add("requests", &f.requests,
         "Measure exactly this many requests per step instead of a --duration; 0: use "
         "--duration");
  fs.Add("warmup", &f.warmup, "Load sent at the start of every step and left out of its figures");
  fs.Add("timeout", &f.timeout,
         "Deadline of each request (with --stream: the request parameter 'timeout'); a late "
         "one counts as DEADLINE_EXCEEDED");
  fs.Add("connect-timeout", &f.connect_timeout,
         "How long to wait for the server at start before giving up with exit status 2");
  fs.Add("seed", &f.seed, "Seed of the payload and token-count generators");
}

// How requests travel: connections, threads, datatype, streams, shared memory.
void RegisterTransportFlags(common::FlagSet& fs, LoadFlags& f) {
  fs.Add("connections", &f.connections, "TCP connections (gRPC channels) to spread requests over");
  fs.Add("threads", &f.threads,
         "Completion-queue threads, which also build each request's fresh rows; 0: as many as "
         "the largest --concurrency (at least 4), at most the hardware threads");
  fs.Add("max-outstanding", &f.max_outstanding,
         "Open loop: most requests in flight; a send due beyond it is not made and counts as "
         "error CLIENT_BACKLOG");
  fs.Add("dtype", &f.dtype, "Datatype of hidden_states and moe_output: FP32, BF16 or FP16");
  fs.Add("stream", &f.stream,
         "Send over ModelStreamInfer streams (answers matched by request id) instead of one "
         "ModelInfer call per request");
  fs.Add("shared-memory", &f.shared_memory,
         "Closed loop: send inputs and take answers through a system shared memory region "
         "(Triton's extension; the server must run on this host) instead of in the messages");
  fs.Add("streams", &f.streams, "With --stream: streams to spread requests over; 0: --connections");
}

// TLS and the bearer token.
void RegisterSecurityFlags(common::FlagSet& fs, LoadFlags& f) {
  fs.Add("tls", &f.tls, "TLS with the system's root certificates (implied by --tls-ca)");
  fs.Add("tls-ca", &f.tls_ca, "PEM file of the CA that signed the server's certificate: TLS");
  fs.Add("tls-cert", &f.tls_cert, "PEM client certificate chain, for mutual TLS (with --tls-key)");
  fs.Add("tls-key", &f.tls_key, "PEM private key of --tls-cert");
  fs.Add("tls-server-name", &f.tls_server_name,
         "Name to check the server's certificate against instead of the target's host");
  fs.Add("token", &f.token, "Bearer token: sends 'authorization: Bearer <token>' with every call");
  fs.Add("token-file", &f.token_file,
         "File holding the bearer token (surrounding whitespace ignored); excludes --token");
}

// What is checked or shaped besides the client's own figures: the server's split,
// answers against the reference, rows aimed at experts.
void RegisterCheckFlags(common::FlagSet& fs, LoadFlags& f) {
  fs.Add("server-stats", &f.server_stats,
         "Report the server's split of each step (ModelStatistics deltas: queue, compute)");
  fs.Add("verify", &f.verify,
         "Check every answer against the reference forward pass of --verify-model; a mismatch "
         "counts as error verify_mismatch. Slows the client: not for throughput figures");
  fs.Add("verify-model", &f.verify_model,
         "The server's --model, synthetic:<preset> (implies --verify)");
  fs.Add("verify-seed", &f.verify_seed, "The server's --seed");
  fs.Add("verify-tolerance", &f.verify_tolerance,
         "Largest max|answer - reference| / max|reference| per request; 0: 1e-4 for FP32, "
         "1e-2 for BF16, 2e-3 for FP16");
  fs.Add("expert-skew", &f.expert_skew,
         "Aim every row at top-k experts drawn with this popularity instead of uniform values: "
         "uniform, zipf:S (rank r weighs r^-S) or hot:N:Q (N experts take a share Q); ranks "
         "permuted by --skew-seed. Needs the served model (--skew-model, else --verify-model; "
         "its --seed is --verify-seed)");
  fs.Add("skew-model", &f.skew_model,
         "The server's --model, for --expert-skew (default: --verify-model)");
  fs.Add("skew-seed", &f.skew_seed, "Seed of --expert-skew's ranking of the experts");
}

// What is printed or written, and the exit status on failures.
void RegisterOutputFlags(common::FlagSet& fs, LoadFlags& f) {
  fs.Add("json", &f.json, "Print one JSON object per step on stdout instead of tables");
  fs.Add("csv", &f.csv, "Print CSV on stdout (a header, one line per step) instead of tables");
  fs.Add("plot", &f.plot,
         "Write an SVG chart of latency percentiles against throughput, one point per step, "
         "to this file");
  fs.Add("progress", &f.progress,
         "Progress line on stderr once a second: auto (when stderr is a terminal), on, off");
  fs.Add("fail-on-error", &f.fail_on_error, "Exit with status 1 if any measured request failed");
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> text = common::ReadWholeFile(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(flag, ": cannot read '", path, "'"));
  return text;
}

}  // namespace

void RegisterFlags(common::FlagSet& fs, LoadFlags& f) {
  RegisterRequestFlags(fs, f);
  RegisterStepFlags(fs, f);
  RegisterTransportFlags(fs, f);
  RegisterSecurityFlags(fs, f);
  RegisterCheckFlags(fs, f);
  RegisterOutputFlags(fs, f);
}

std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (!absl::StartsWith(a, "--")) continue;
    const size_t end = std::min(a.find('='), a.size());
    std::replace(a.begin() + 2, a.begin() + static_cast<std::ptrdiff_t>(end), '_', '-');
  }
  return args;
}

absl::StatusOr<std::vector<StepSpec>> StepsFromFlags(const LoadFlags& f) {
  const std::vector<std::string> rates = absl::StrSplit(f.rate, ',', absl::SkipWhitespace());
  std::vector<std::string> concurrency = absl::StrSplit(f.concurrency, ',', absl::SkipWhitespace());
  if (!rates.empty() && !concurrency.empty()) {
    return absl::InvalidArgumentError(
        "--rate (open loop) and --concurrency (closed loop) exclude each other");
  }
  std::vector<StepSpec> steps;
  if (!rates.empty()) {
    EPSERVE_ASSIGN_OR_RETURN(Arrival arrival, ParseArrival(f.arrival));
    for (const std::string& text : rates) {
      StepSpec step;
      step.mode = LoadMode::kOpenLoop;
      step.arrival = arrival;
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
  return steps;
}

absl::Status CheckFlagCombinations(const LoadFlags& f) {
  if (!f.duration.empty() && f.requests > 0) {
    return absl::InvalidArgumentError("--duration and --requests exclude each other");
  }
  if (f.json && f.csv) return absl::InvalidArgumentError("--json and --csv exclude each other");
  if (!f.token.empty() && !f.token_file.empty()) {
    return absl::InvalidArgumentError("--token and --token-file exclude each other");
  }
  if (f.tls_cert.empty() != f.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (f.progress != "auto" && f.progress != "on" && f.progress != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("progress: '", f.progress, "' is none of auto, on, off"));
  }
  if (f.verify && f.verify_model.empty()) {
    return absl::InvalidArgumentError(
        "--verify needs --verify-model (the server's --model, synthetic:<preset>)");
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadOptions> LoadOptionsFromFlags(const LoadFlags& f) {
  LoadOptions options;
  options.request.model_name = f.model;
  options.request.hidden_size = f.hidden;
  if (!f.layer.empty()) {
    int64_t layer = 0;
    if (!absl::SimpleAtoi(f.layer, &layer)) {
      return absl::InvalidArgumentError(absl::StrCat("layer: '", f.layer, "' is not an integer"));
    }
    options.request.layer = layer;
  }
  EPSERVE_ASSIGN_OR_RETURN(options.request.dtype, ParseDtype(f.dtype));
  EPSERVE_ASSIGN_OR_RETURN(options.tokens, ParseTokenRange(f.tokens));
  options.duration = absl::Seconds(10);
  if (!f.duration.empty() && !absl::ParseDuration(f.duration, &options.duration)) {
    return absl::InvalidArgumentError(
        absl::StrCat("duration: '", f.duration, "' is not a duration (e.g. 30s)"));
  }
  options.num_requests = f.requests;
  options.warmup = f.warmup;
  options.timeout = f.timeout;
  options.seed = static_cast<uint64_t>(f.seed);
  options.max_outstanding = f.max_outstanding;
  options.num_threads = f.threads;
  if (options.num_threads == 0) {
    // A few threads building 16 MiB requests bound a closed loop of many long requests below
    // what a many-core server answers (measured: 4 threads, 16 clients of 4096-token BF16
    // requests, 479k tokens/s; 16 threads, 762k, on a 32-thread host).
    int most = 4;
    if (absl::StatusOr<std::vector<StepSpec>> steps = StepsFromFlags(f); steps.ok()) {
      for (const StepSpec& step : *steps) {
        if (step.mode == LoadMode::kClosedLoop) most = std::max(most, step.concurrency);
      }
    }
    const int hardware = static_cast<int>(std::max(std::thread::hardware_concurrency(), 1u));
    options.num_threads = std::clamp(most, 1, std::min(hardware, 1023));
  }
  options.stream = f.stream;
  options.num_streams = f.streams > 0 ? f.streams : f.connections;
  options.server_stats = f.server_stats;
  if (options.request.hidden_size < 0) {
    return absl::InvalidArgumentError("--hidden must be >= 0 (0 asks the server)");
  }
  if (f.connections < 1) return absl::InvalidArgumentError("--connections must be >= 1");
  return options;
}

absl::StatusOr<ChannelOptions> ChannelOptionsFromFlags(const LoadFlags& f) {
  ChannelOptions channel_options;
  channel_options.target = f.target;
  channel_options.num_connections = f.connections;
  channel_options.tls = f.tls || !f.tls_ca.empty() || !f.tls_cert.empty();
  channel_options.tls_server_name = f.tls_server_name;
  for (auto [path, flag, dst] : {std::tuple{&f.tls_ca, "tls-ca", &channel_options.tls_ca_pem},
                                 std::tuple{&f.tls_cert, "tls-cert", &channel_options.tls_cert_pem},
                                 std::tuple{&f.tls_key, "tls-key", &channel_options.tls_key_pem}}) {
    if (path->empty()) continue;
    EPSERVE_ASSIGN_OR_RETURN(*dst, ReadWholeFile(*path, flag));
  }
  return channel_options;
}

absl::StatusOr<std::string> TokenFromFlags(const LoadFlags& f) {
  if (f.token_file.empty()) return f.token;
  EPSERVE_ASSIGN_OR_RETURN(std::string token, ReadWholeFile(f.token_file, "token-file"));
  return std::string(absl::StripAsciiWhitespace(token));
}

absl::StatusOr<ExpertSkew> ExpertSkewFromFlags(const LoadFlags& f) {
  EPSERVE_ASSIGN_OR_RETURN(ExpertSkew skew, ParseExpertSkew(f.expert_skew));
  if (f.skew_model.empty() && f.verify_model.empty()) {
    return absl::InvalidArgumentError(
        "--expert-skew needs --skew-model or --verify-model (the server's --model)");
  }
  return skew;
}

}  // namespace epserve::client
