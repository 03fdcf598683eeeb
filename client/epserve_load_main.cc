// epserve-load: load generator for epserve's KServe v2 gRPC endpoint.
//
// Exit status: 0 when every step ran (even if requests failed) and for --help; 1 for bad
// flags, or with --fail-on-error when any measured request failed; 2 when the run could
// not start (server unreachable within --connect-timeout, the model's metadata unusable,
// a TLS or token file unreadable, the verify model unavailable).

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/expert_skew.h"
#include "client/infer_request.h"
#include "client/load_generator.h"
#include "client/load_stats.h"
#include "client/verify.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/status.h"

namespace epserve::client {
namespace {

constexpr int kExitBadUsage = 1;
constexpr int kExitFailedRequests = 1;
constexpr int kExitCannotStart = 2;

constexpr char kSummary[] =
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
    "and after the step. Exit status: 0 run completed (even with failed requests), 1 bad\n"
    "flags or --fail-on-error with failures, 2 the run cannot start.";

struct Flags {
  std::string target = "127.0.0.1:8001";
  std::string model = "moe";
  std::string tokens = "32";
  int64_t hidden = 0;
  std::string layer;
  std::string concurrency;
  std::string rate;
  std::string arrival = "constant";
  std::string duration;
  int64_t requests = 0;
  absl::Duration warmup = absl::Seconds(1);
  absl::Duration timeout = absl::Seconds(10);
  absl::Duration connect_timeout = absl::Seconds(10);
  int64_t seed = 1;
  int connections = 1;
  int threads = 0;
  int64_t max_outstanding = 4096;
  std::string dtype = "FP32";
  bool stream = false;
  int streams = 0;
  bool shared_memory = false;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_server_name;
  bool tls = false;
  std::string token;
  std::string token_file;
  bool server_stats = true;
  bool verify = false;
  std::string verify_model;
  int64_t verify_seed = 0;
  double verify_tolerance = 0;
  std::string expert_skew;
  std::string skew_model;
  int64_t skew_seed = 1;
  bool json = false;
  bool csv = false;
  std::string plot;
  std::string progress = "auto";
  bool fail_on_error = false;
};

void Register(common::FlagSet& fs, Flags& f) {
  fs.Add("target", &f.target, "Server address, host:port");
  fs.Add("model", &f.model, "Model name sent in every request");
  fs.Add("tokens", &f.tokens,
         "Token rows T per request: N, or A-B for a uniform draw from [A, B] per request");
  fs.Add("hidden", &f.hidden,
         "Hidden size H of a token row; 0 asks the server (ModelMetadata: input hidden_states, "
         "shape [-1, H])");
  fs.Add("layer", &f.layer,
         "MoE layer to run, sent as the int64 request parameter 'layer'; empty: server default");
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
  fs.Add("connections", &f.connections, "TCP connections (gRPC channels) to spread requests over");
  fs.Add("threads", &f.threads, "Completion-queue threads; 0: min(4, hardware threads)");
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
  fs.Add("tls", &f.tls, "TLS with the system's root certificates (implied by --tls-ca)");
  fs.Add("tls-ca", &f.tls_ca, "PEM file of the CA that signed the server's certificate: TLS");
  fs.Add("tls-cert", &f.tls_cert, "PEM client certificate chain, for mutual TLS (with --tls-key)");
  fs.Add("tls-key", &f.tls_key, "PEM private key of --tls-cert");
  fs.Add("tls-server-name", &f.tls_server_name,
         "Name to check the server's certificate against instead of the target's host");
  fs.Add("token", &f.token, "Bearer token: sends 'authorization: Bearer <token>' with every call");
  fs.Add("token-file", &f.token_file,
         "File holding the bearer token (surrounding whitespace ignored); excludes --token");
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
  fs.Add("json", &f.json, "Print one JSON object per step on stdout instead of tables");
  fs.Add("csv", &f.csv, "Print CSV on stdout (a header, one line per step) instead of tables");
  fs.Add("plot", &f.plot,
         "Write an SVG chart of latency percentiles against throughput, one point per step, "
         "to this file");
  fs.Add("progress", &f.progress,
         "Progress line on stderr once a second: auto (when stderr is a terminal), on, off");
  fs.Add("fail-on-error", &f.fail_on_error, "Exit with status 1 if any measured request failed");
}

// Flag names may use '_' (absl's spelling, which earlier versions took): "--a_b[=v]" and
// "--no_a_b" become "--a-b[=v]" and "--no-a-b". Values are left alone.
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

absl::StatusOr<std::vector<StepSpec>> StepsFromFlags(const Flags& f) {
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

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> text = common::ReadWholeFile(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(flag, ": cannot read '", path, "'"));
  return text;
}

std::string DescribeRun(const Flags& f, const LoadOptions& o) {
  return absl::StrCat(
      "epserve-load: target ", f.target, o.token.empty() ? "" : " (token)",
      f.tls || !f.tls_ca.empty() ? " (TLS)" : "", ", model \"", o.request.model_name, "\", hidden ",
      o.request.hidden_size, ", ", common::KServeName(o.request.dtype), ", tokens ",
      FormatTokenRange(o.tokens), ", layer ",
      o.request.layer.has_value() ? absl::StrCat(*o.request.layer) : std::string("-"), ", ",
      o.stream ? absl::StrCat("stream x", o.num_streams) : std::string("unary"), ", warmup ",
      absl::FormatDuration(o.warmup), ", ",
      o.num_requests > 0 ? absl::StrCat(o.num_requests, " requests")
                         : absl::StrCat("duration ", absl::FormatDuration(o.duration)),
      " per step, timeout ", absl::FormatDuration(o.timeout), ", connections ", f.connections,
      ", threads ", o.num_threads,
      o.verifier != nullptr
          ? absl::StrFormat(", verifying against %s seed %d layer %d (tolerance %.3g)",
                            f.verify_model, f.verify_seed, o.verifier->layer(),
                            o.verifier->tolerance())
          : std::string());
}

void PrintProgress(const Progress& p, size_t step, size_t steps) {
  const double measured_s = std::max(0.0, p.elapsed_s - p.warmup_s);
  std::string where;
  if (p.elapsed_s < p.warmup_s) {
    where = absl::StrFormat("warmup %.0f/%.0f s", p.elapsed_s, p.warmup_s);
  } else if (p.target_requests > 0) {
    where = absl::StrFormat("%d/%d requests", p.ok + p.errors, p.target_requests);
  } else {
    where = absl::StrFormat("%.0f/%.0f s", std::min(measured_s, p.window_s), p.window_s);
  }
  const double rate = measured_s > 0 ? static_cast<double>(p.ok_tokens) / measured_s : 0;
  std::fprintf(stderr, "\r\033[Kstep %zu/%zu: %s, %lld ok, %lld errors, %.0f tokens/s", step, steps,
               where.c_str(), static_cast<long long>(p.ok), static_cast<long long>(p.errors), rate);
  std::fflush(stderr);
}

int Main(int argc, char** argv) {
  Flags f;
  common::FlagSet fs("epserve-load", kSummary);
  Register(fs, f);
  std::vector<std::string> args = NormalizeFlagNames(argc, argv);
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  if (absl::Status s = fs.Parse(static_cast<int>(arg_ptrs.size()), arg_ptrs.data()); !s.ok()) {
    std::cerr << "epserve-load: " << s.message() << "\n";
    return kExitBadUsage;
  }
  if (fs.help_requested()) {
    std::cout << fs.Usage();
    return 0;
  }
  auto bad_usage = [](absl::string_view message) {
    std::cerr << "epserve-load: " << message << "\n";
    return kExitBadUsage;
  };

  absl::StatusOr<std::vector<StepSpec>> steps = StepsFromFlags(f);
  if (!steps.ok()) return bad_usage(steps.status().message());
  if (!f.duration.empty() && f.requests > 0) {
    return bad_usage("--duration and --requests exclude each other");
  }
  if (f.json && f.csv) return bad_usage("--json and --csv exclude each other");
  if (!f.token.empty() && !f.token_file.empty()) {
    return bad_usage("--token and --token-file exclude each other");
  }
  if (f.tls_cert.empty() != f.tls_key.empty()) {
    return bad_usage("--tls-cert and --tls-key go together");
  }
  if (f.progress != "auto" && f.progress != "on" && f.progress != "off") {
    return bad_usage(absl::StrCat("progress: '", f.progress, "' is none of auto, on, off"));
  }
  if (f.verify && f.verify_model.empty()) {
    return bad_usage("--verify needs --verify-model (the server's --model, synthetic:<preset>)");
  }

  LoadOptions options;
  options.request.model_name = f.model;
  options.request.hidden_size = f.hidden;
  if (!f.layer.empty()) {
    int64_t layer = 0;
    if (!absl::SimpleAtoi(f.layer, &layer)) {
      return bad_usage(absl::StrCat("layer: '", f.layer, "' is not an integer"));
    }
    options.request.layer = layer;
  }
  absl::StatusOr<common::ElementType> dtype = ParseDtype(f.dtype);
  if (!dtype.ok()) return bad_usage(dtype.status().message());
  options.request.dtype = *dtype;
  absl::StatusOr<TokenRange> tokens = ParseTokenRange(f.tokens);
  if (!tokens.ok()) return bad_usage(tokens.status().message());
  options.tokens = *tokens;
  options.duration = absl::Seconds(10);
  if (!f.duration.empty() && !absl::ParseDuration(f.duration, &options.duration)) {
    return bad_usage(absl::StrCat("duration: '", f.duration, "' is not a duration (e.g. 30s)"));
  }
  options.num_requests = f.requests;
  options.warmup = f.warmup;
  options.timeout = f.timeout;
  options.seed = static_cast<uint64_t>(f.seed);
  options.max_outstanding = f.max_outstanding;
  options.num_threads = f.threads;
  if (options.num_threads == 0) {
    options.num_threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  }
  options.stream = f.stream;
  options.num_streams = f.streams > 0 ? f.streams : f.connections;
  options.server_stats = f.server_stats;
  if (options.request.hidden_size < 0)
    return bad_usage("--hidden must be >= 0 (0 asks the server)");
  if (f.connections < 1) return bad_usage("--connections must be >= 1");

  ChannelOptions channel_options;
  channel_options.target = f.target;
  channel_options.num_connections = f.connections;
  channel_options.tls = f.tls || !f.tls_ca.empty() || !f.tls_cert.empty();
  channel_options.tls_server_name = f.tls_server_name;
  for (auto [path, flag, dst] : {std::tuple{&f.tls_ca, "tls-ca", &channel_options.tls_ca_pem},
                                 std::tuple{&f.tls_cert, "tls-cert", &channel_options.tls_cert_pem},
                                 std::tuple{&f.tls_key, "tls-key", &channel_options.tls_key_pem}}) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> pem = ReadWholeFile(*path, flag);
    if (!pem.ok()) {
      std::cerr << "epserve-load: " << pem.status().message() << "\n";
      return kExitCannotStart;
    }
    *dst = *std::move(pem);
  }
  options.token = f.token;
  if (!f.token_file.empty()) {
    absl::StatusOr<std::string> token = ReadWholeFile(f.token_file, "token-file");
    if (!token.ok()) {
      std::cerr << "epserve-load: " << token.status().message() << "\n";
      return kExitCannotStart;
    }
    options.token = std::string(absl::StripAsciiWhitespace(*token));
  }

  auto channels = MakeChannels(channel_options);
  if (absl::Status s = WaitForChannels(channels, f.target, f.connect_timeout); !s.ok()) {
    std::cerr << "epserve-load: " << s.message() << "\n";
    return kExitCannotStart;
  }
  if (options.request.hidden_size == 0) {
    absl::StatusOr<int64_t> hidden = QueryHiddenSize(channels.front(), options.request.model_name,
                                                     options.timeout, options.token);
    if (!hidden.ok()) {
      std::cerr << "epserve-load: cannot learn the hidden size (pass --hidden to skip): "
                << hidden.status().message() << "\n";
      return kExitCannotStart;
    }
    options.request.hidden_size = *hidden;
  }
  if (!f.verify_model.empty()) {
    absl::StatusOr<std::unique_ptr<Verifier>> verifier =
        Verifier::Create(f.verify_model, static_cast<uint64_t>(f.verify_seed),
                         options.request.layer, options.request.dtype, f.verify_tolerance);
    if (!verifier.ok()) {
      std::cerr << "epserve-load: " << verifier.status().message() << "\n";
      return kExitCannotStart;
    }
    options.verifier = *std::move(verifier);
  }

  if (!f.expert_skew.empty()) {
    absl::StatusOr<ExpertSkew> skew = ParseExpertSkew(f.expert_skew);
    const std::string& spec = f.skew_model.empty() ? f.verify_model : f.skew_model;
    if (!skew.ok() || spec.empty()) {
      std::cerr << "epserve-load: "
                << (skew.ok() ? "--expert-skew needs --skew-model or --verify-model (the "
                                "server's --model)"
                              : std::string(skew.status().message()))
                << "\n";
      return kExitBadUsage;
    }
    absl::StatusOr<std::unique_ptr<SkewedRows>> made = SkewedRows::Create(
        spec, static_cast<uint64_t>(f.verify_seed),
        options.request.layer.has_value() ? static_cast<int>(*options.request.layer) : -1, *skew,
        static_cast<uint64_t>(f.skew_seed));
    if (!made.ok() || (*made)->hidden_size() != options.request.hidden_size) {
      std::cerr << "epserve-load: expert skew: "
                << (made.ok() ? absl::StrCat("the model's hidden size ", (*made)->hidden_size(),
                                             " is not the server's ", options.request.hidden_size)
                              : std::string(made.status().message()))
                << "\n";
      return kExitCannotStart;
    }
    std::shared_ptr<const SkewedRows> rows = *std::move(made);
    std::cerr << "epserve-load: rows aimed at experts with popularity " << skew->ToString()
              << absl::StrFormat(" (gain %.1f: %.0f%% of sampled rows routed as aimed)",
                                 rows->gain(), 100 * rows->aimed_fraction())
              << "\n";
    options.request.fill_rows = [rows](FastRng& rng, float* dst, int64_t num_rows) {
      rows->Fill(rng, dst, num_rows);
    };
  }

  const bool show_progress =
      f.progress == "on" || (f.progress == "auto" && isatty(STDERR_FILENO) == 1);
  size_t current_step = 0;
  if (show_progress) {
    options.progress = [&current_step, &steps](const Progress& p) {
      PrintProgress(p, current_step, steps->size());
    };
  }

  // The region's stub outlives it (declared first): its destructor unregisters through it.
  std::unique_ptr<inference::GRPCInferenceService::Stub> shm_stub;
  std::unique_ptr<SharedMemorySlots> shm;
  if (f.shared_memory) {
    int slots = 1;
    for (const StepSpec& step : *steps) slots = std::max(slots, step.concurrency);
    shm_stub = inference::GRPCInferenceService::NewStub(channels.front());
    absl::StatusOr<std::unique_ptr<SharedMemorySlots>> made =
        SharedMemorySlots::Create(*shm_stub, options.token, slots,
                                  options.tokens.max_tokens * options.request.hidden_size *
                                      common::ElementBytes(options.request.dtype));
    if (!made.ok()) {
      std::cerr << "epserve-load: --shared-memory: " << made.status().message() << "\n";
      return kExitCannotStart;
    }
    shm = *std::move(made);
    options.shared_memory = shm.get();
  }
  LoadGenerator generator(channels, options);
  for (const StepSpec& step : *steps) {
    if (absl::Status s = generator.Validate(step); !s.ok()) return bad_usage(s.message());
  }

  std::cerr << DescribeRun(f, options) << "\n";
  if (f.csv) std::cout << CsvHeader() << std::endl;
  bool any_error = false;
  std::vector<StepReport> reports;
  for (size_t i = 0; i < steps->size(); ++i) {
    const StepSpec& step = (*steps)[i];
    current_step = i + 1;
    std::cerr << "epserve-load: step " << i + 1 << "/" << steps->size() << ": "
              << (step.mode == LoadMode::kClosedLoop
                      ? absl::StrCat("concurrency ", step.concurrency)
                      : absl::StrCat("rate ", step.rate_per_s, "/s ", ArrivalName(step.arrival)))
              << "\n";
    StepReport report = generator.RunStep(step, static_cast<int>(i));
    if (show_progress) std::cerr << "\r\033[K" << std::flush;
    any_error = any_error || report.num_requests != report.num_ok;
    if (f.json) {
      std::cout << FormatStepJson(report) << std::endl;
    } else if (f.csv) {
      std::cout << FormatStepCsv(report) << std::endl;
    } else {
      std::cout << FormatStepTable(report) << std::flush;
    }
    reports.push_back(std::move(report));
  }
  if (!f.plot.empty()) {
    const std::string title = absl::StrCat(
        "epserve-load: ", f.model, ", ", FormatTokenRange(options.tokens), " tokens/request, ",
        common::KServeName(options.request.dtype), options.stream ? ", stream" : "");
    std::ofstream out(f.plot);
    out << PlotSvg(reports, title);
    if (!out) {
      std::cerr << "epserve-load: cannot write --plot file '" << f.plot << "'\n";
      return kExitBadUsage;
    }
    std::cerr << "epserve-load: wrote " << f.plot << "\n";
  }
  if (any_error && f.fail_on_error) return kExitFailedRequests;
  return 0;
}

}  // namespace
}  // namespace epserve::client

int main(int argc, char** argv) { return epserve::client::Main(argc, argv); }
