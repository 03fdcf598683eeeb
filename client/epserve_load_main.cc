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
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/expert_skew.h"
#include "client/infer_request.h"
#include "client/load_flags.h"
#include "client/load_generator.h"
#include "client/load_stats.h"
#include "client/server_queries.h"
#include "client/shm_slots.h"
#include "client/verify.h"
#include "common/flags.h"
#include "common/status.h"
#include "grpc_service.grpc.pb.h"

namespace epserve::client {
namespace {

constexpr int kExitBadUsage = 1;
constexpr int kExitFailedRequests = 1;
constexpr int kExitCannotStart = 2;

std::string DescribeRun(const LoadFlags& f, const LoadOptions& o) {
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

// Why a run ends before its steps: the exit status, and the message printed after
// "epserve-load: " on stderr.
struct Stop {
  int exit_code;
  std::string message;
};

Stop BadUsage(absl::string_view message) { return {kExitBadUsage, std::string(message)}; }
Stop CannotStart(absl::string_view message) { return {kExitCannotStart, std::string(message)}; }

int Exit(const Stop& stop) {
  std::cerr << "epserve-load: " << stop.message << "\n";
  return stop.exit_code;
}

// Parses the command line into `f`. The exit status when the run ends here (--help, after
// the usage on stdout: 0; flags that do not parse: 1), nullopt to go on.
std::optional<int> ParseCommandLine(int argc, char** argv, LoadFlags& f) {
  common::FlagSet fs("epserve-load", kLoadUsageSummary);
  RegisterFlags(fs, f);
  std::vector<std::string> args = NormalizeFlagNames(argc, argv);
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  if (absl::Status s = fs.Parse(static_cast<int>(arg_ptrs.size()), arg_ptrs.data()); !s.ok()) {
    return Exit(BadUsage(s.message()));
  }
  if (fs.help_requested()) {
    std::cout << fs.Usage();
    return 0;
  }
  return std::nullopt;
}

// What the steps need once the flags are checked and the server is reached.
struct RunSetup {
  std::vector<StepSpec> steps;
  LoadOptions options;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  // The region's stub outlives it (declared first): its destructor unregisters through it.
  std::unique_ptr<inference::GRPCInferenceService::Stub> shm_stub;
  std::unique_ptr<SharedMemorySlots> shm;  // with --shared-memory; options.shared_memory
};

// Channels READY, and the hidden size asked of the server unless --hidden gave it.
absl::Status Connect(const LoadFlags& f, const ChannelOptions& channel_options, RunSetup& run) {
  run.channels = MakeChannels(channel_options);
  EPSERVE_RETURN_IF_ERROR(WaitForChannels(run.channels, f.target, f.connect_timeout));
  LoadOptions& options = run.options;
  if (options.request.hidden_size == 0) {
    absl::StatusOr<int64_t> hidden = QueryHiddenSize(
        run.channels.front(), options.request.model_name, options.timeout, options.token);
    if (!hidden.ok()) {
      return absl::Status(hidden.status().code(),
                          absl::StrCat("cannot learn the hidden size (pass --hidden to skip): ",
                                       hidden.status().message()));
    }
    options.request.hidden_size = *hidden;
  }
  return absl::OkStatus();
}

// The reference of --verify-model, when given.
absl::Status AttachVerifier(const LoadFlags& f, LoadOptions& options) {
  if (f.verify_model.empty()) return absl::OkStatus();
  EPSERVE_ASSIGN_OR_RETURN(
      options.verifier,
      Verifier::Create(f.verify_model, static_cast<uint64_t>(f.verify_seed), options.request.layer,
                       options.request.dtype, f.verify_tolerance));
  return absl::OkStatus();
}

// Makes every request's rows aim at experts drawn with `skew`'s popularity, and says how
// well they hit on stderr. The error names what does not match the server.
absl::Status AimRowsAtExperts(const LoadFlags& f, const ExpertSkew& skew, LoadOptions& options) {
  const std::string& spec = f.skew_model.empty() ? f.verify_model : f.skew_model;
  absl::StatusOr<std::unique_ptr<SkewedRows>> made = SkewedRows::Create(
      spec, static_cast<uint64_t>(f.verify_seed),
      options.request.layer.has_value() ? static_cast<int>(*options.request.layer) : -1, skew,
      static_cast<uint64_t>(f.skew_seed));
  if (!made.ok() || (*made)->hidden_size() != options.request.hidden_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "expert skew: ", made.ok()
                             ? absl::StrCat("the model's hidden size ", (*made)->hidden_size(),
                                            " is not the server's ", options.request.hidden_size)
                             : std::string(made.status().message())));
  }
  std::shared_ptr<const SkewedRows> rows = *std::move(made);
  std::cerr << "epserve-load: rows aimed at experts with popularity " << skew.ToString()
            << absl::StrFormat(" (gain %.1f: %.0f%% of sampled rows routed as aimed)", rows->gain(),
                               100 * rows->aimed_fraction())
            << "\n";
  options.request.fill_rows = [rows](FastRng& rng, float* dst, int64_t num_rows) {
    rows->Fill(rng, dst, num_rows);
  };
  return absl::OkStatus();
}

// Registers a region with a slot per request in flight of the largest step.
absl::Status RegisterSharedMemory(RunSetup& run) {
  const LoadOptions& options = run.options;
  int slots = 1;
  for (const StepSpec& step : run.steps) slots = std::max(slots, step.concurrency);
  run.shm_stub = inference::GRPCInferenceService::NewStub(run.channels.front());
  absl::StatusOr<std::unique_ptr<SharedMemorySlots>> made =
      SharedMemorySlots::Create(*run.shm_stub, options.token, slots,
                                options.tokens.max_tokens * options.request.hidden_size *
                                    common::ElementBytes(options.request.dtype));
  if (!made.ok()) {
    return absl::Status(made.status().code(),
                        absl::StrCat("--shared-memory: ", made.status().message()));
  }
  run.shm = *std::move(made);
  run.options.shared_memory = run.shm.get();
  return absl::OkStatus();
}

// Checks the flags and reaches the server, in the order that decides which error a command
// line with several gets: flags (exit 1), then files, server, models (exit 2).
std::optional<Stop> Prepare(const LoadFlags& f, RunSetup& run) {
  absl::StatusOr<std::vector<StepSpec>> steps = StepsFromFlags(f);
  if (!steps.ok()) return BadUsage(steps.status().message());
  run.steps = *std::move(steps);
  if (absl::Status s = CheckFlagCombinations(f); !s.ok()) return BadUsage(s.message());
  absl::StatusOr<LoadOptions> options = LoadOptionsFromFlags(f);
  if (!options.ok()) return BadUsage(options.status().message());
  run.options = *std::move(options);
  absl::StatusOr<ChannelOptions> channel_options = ChannelOptionsFromFlags(f);
  if (!channel_options.ok()) return CannotStart(channel_options.status().message());
  absl::StatusOr<std::string> token = TokenFromFlags(f);
  if (!token.ok()) return CannotStart(token.status().message());
  run.options.token = *std::move(token);
  if (absl::Status s = Connect(f, *channel_options, run); !s.ok()) return CannotStart(s.message());
  if (absl::Status s = AttachVerifier(f, run.options); !s.ok()) return CannotStart(s.message());
  if (!f.expert_skew.empty()) {
    absl::StatusOr<ExpertSkew> skew = ExpertSkewFromFlags(f);
    if (!skew.ok()) return BadUsage(skew.status().message());
    absl::Status s = AimRowsAtExperts(f, *skew, run.options);
    if (!s.ok()) return CannotStart(s.message());
  }
  if (f.shared_memory) {
    if (absl::Status s = RegisterSharedMemory(run); !s.ok()) return CannotStart(s.message());
  }
  return std::nullopt;
}

// One step's report on stdout, in the format the flags ask for.
void PrintReport(const LoadFlags& f, const StepReport& report) {
  if (f.json) {
    std::cout << FormatStepJson(report) << std::endl;
  } else if (f.csv) {
    std::cout << FormatStepCsv(report) << std::endl;
  } else {
    std::cout << FormatStepTable(report) << std::flush;
  }
}

// --plot: the chart of every step's latency against throughput.
std::optional<Stop> WritePlot(const LoadFlags& f, const LoadOptions& options,
                              const std::vector<StepReport>& reports) {
  const std::string title = absl::StrCat(
      "epserve-load: ", f.model, ", ", FormatTokenRange(options.tokens), " tokens/request, ",
      common::KServeName(options.request.dtype), options.stream ? ", stream" : "");
  std::ofstream out(f.plot);
  out << PlotSvg(reports, title);
  if (!out) return BadUsage(absl::StrCat("cannot write --plot file '", f.plot, "'"));
  std::cerr << "epserve-load: wrote " << f.plot << "\n";
  return std::nullopt;
}

// Runs every step, printing each report as it ends; the exit status.
int RunSteps(const LoadFlags& f, RunSetup& run) {
  const bool show_progress =
      f.progress == "on" || (f.progress == "auto" && isatty(STDERR_FILENO) == 1);
  size_t current_step = 0;
  if (show_progress) {
    run.options.progress = [&current_step, num_steps = run.steps.size()](const Progress& p) {
      PrintProgress(p, current_step, num_steps);
    };
  }
  LoadGenerator generator(run.channels, run.options);
  for (const StepSpec& step : run.steps) {
    if (absl::Status s = generator.Validate(step); !s.ok()) return Exit(BadUsage(s.message()));
  }

  std::cerr << DescribeRun(f, run.options) << "\n";
  if (f.csv) std::cout << CsvHeader() << std::endl;
  bool any_error = false;
  std::vector<StepReport> reports;
  for (size_t i = 0; i < run.steps.size(); ++i) {
    const StepSpec& step = run.steps[i];
    current_step = i + 1;
    std::cerr << "epserve-load: step " << i + 1 << "/" << run.steps.size() << ": "
              << (step.mode == LoadMode::kClosedLoop
                      ? absl::StrCat("concurrency ", step.concurrency)
                      : absl::StrCat("rate ", step.rate_per_s, "/s ", ArrivalName(step.arrival)))
              << "\n";
    StepReport report = generator.RunStep(step, static_cast<int>(i));
    if (show_progress) std::cerr << "\r\033[K" << std::flush;
    any_error = any_error || report.num_requests != report.num_ok;
    PrintReport(f, report);
    reports.push_back(std::move(report));
  }
  if (!f.plot.empty()) {
    if (std::optional<Stop> stop = WritePlot(f, run.options, reports)) return Exit(*stop);
  }
  if (any_error && f.fail_on_error) return kExitFailedRequests;
  return 0;
}

int Main(int argc, char** argv) {
  LoadFlags f;
  if (std::optional<int> exit_code = ParseCommandLine(argc, argv, f)) return *exit_code;
  RunSetup run;
  if (std::optional<Stop> stop = Prepare(f, run)) return Exit(*stop);
  return RunSteps(f, run);
}

}  // namespace
}  // namespace epserve::client

int main(int argc, char** argv) { return epserve::client::Main(argc, argv); }
