// epserve-verify: a test client that checks every answer of a synthetic:tiny cluster
// against the reference forward pass while the cluster is hurt (a rank killed, overload, a
// network between namespaces), and watches grpc.health.v1 on the side.
//
//   epserve-verify --target=10.200.0.1:8001 --requests=50          # every answer correct
//   epserve-verify --target=127.0.0.1:8001 --until-file=/tmp/stop  # load until the file exists
//   epserve-verify --target=127.0.0.1:8001 --abuse=20              # cancels and disconnects
//
// Prints one JSON object on stdout: requests answered per gRPC code, wrong answers, answers
// later than their deadline, latencies, and the health transitions it saw (unix seconds).
// Exit status: 0 when no answer was wrong or late (and, with --requests, every request got
// a correct answer), 1 otherwise, 2 for bad flags or an unreachable server.
#include <grpcpp/grpcpp.h>

#include <sys/stat.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/load_stats.h"
#include "common/flags.h"
#include "grpc_service.grpc.pb.h"
#include "health.grpc.pb.h"
#include "tests/e2e/reference.h"

namespace epserve::testing {
namespace {

struct Options {
  std::string target = "127.0.0.1:8001";
  int64_t concurrency = 4;
  int64_t requests = 0;  // total; 0: run for --duration or until --until-file
  absl::Duration duration = absl::Seconds(10);
  absl::Duration deadline = absl::Seconds(5);
  absl::Duration late_slack = absl::Seconds(1);
  int64_t min_tokens = 1;
  int64_t max_tokens = 40;
  std::string until_file;
  absl::Duration health_interval = absl::Milliseconds(50);
  int64_t abuse = 0;
  absl::Duration connect_timeout = absl::Seconds(30);
};

double UnixNow() { return absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()); }

bool FileExists(const std::string& path) {
  struct stat st;
  return !path.empty() && ::stat(path.c_str(), &st) == 0;
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Reconnect fast after the server comes back (the default backoff grows to 2 minutes),
  // but give each attempt a second (the minimum is also the connect timeout).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // each channel its own connection
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

std::string CodeName(grpc::StatusCode code) {
  return ::epserve::client::StatusCodeName(static_cast<int>(code));
}

// What the request threads saw. Guarded by mu.
struct Tally {
  std::mutex mu;
  std::map<std::string, int64_t> by_code;
  std::map<std::string, std::string> first_message;
  int64_t requests = 0;
  int64_t wrong = 0;
  int64_t late = 0;
  double max_ok_latency_ms = 0;
  double max_error_latency_ms = 0;
  std::vector<double> ok_latency_ms;
  double first_error_unix = 0;
  double first_ok_after_error_unix = 0;
  double last_ok_before_error_unix = 0;
  std::string wrong_example;
};

// Health as a list of (unix time, state) transitions: SERVING, NOT_SERVING, or the gRPC
// code of a failed Check (UNAVAILABLE when the server is gone).
class HealthWatcher {
 public:
  HealthWatcher(std::string target, absl::Duration interval)
      : target_(std::move(target)),
        stub_(grpc::health::v1::Health::NewStub(NewChannel(target_))),
        interval_(interval) {
    thread_ = std::thread([this] { Run(); });
  }
  ~HealthWatcher() { Stop(); }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  std::vector<std::pair<double, std::string>> transitions() {
    std::lock_guard<std::mutex> lock(mu_);
    return transitions_;
  }

 private:
  void Run() {
    while (!stop_.load()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      grpc::health::v1::HealthCheckResponse resp;
      grpc::Status s = stub_->Check(&ctx, {}, &resp);
      std::string state;
      if (!s.ok()) {
        state = CodeName(s.error_code());
        // A channel to a server that went away may sit in backoff: start afresh.
        stub_ = grpc::health::v1::Health::NewStub(NewChannel(target_));
      } else {
        state = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? "SERVING"
                                                                                : "NOT_SERVING";
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (transitions_.empty() || transitions_.back().second != state) {
          transitions_.emplace_back(UnixNow(), state);
        }
      }
      absl::SleepFor(interval_);
    }
  }

  std::string target_;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  absl::Duration interval_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<std::pair<double, std::string>> transitions_;
  std::thread thread_;
};

void RequestLoop(const Options& o, std::shared_ptr<grpc::Channel> channel, int index,
                 std::atomic<int64_t>& issued, const absl::Time end, Tally& tally) {
  auto stub = inference::GRPCInferenceService::NewStub(std::move(channel));
  Reference ref;
  std::mt19937_64 rng(0x5eed + index);
  std::uniform_int_distribution<int64_t> tokens_of(o.min_tokens, o.max_tokens);
  int i = 0;
  absl::Time last_reconnect = absl::Now();
  while (true) {
    if (o.requests > 0) {
      if (issued.fetch_add(1) >= o.requests) return;
    } else if (absl::Now() >= end || FileExists(o.until_file)) {
      return;
    }
    const int64_t tokens = tokens_of(rng);
    std::vector<float> x = RandomRows(tokens, rng);
    const std::string id = absl::StrCat("c", index, "-", i++);
    inference::ModelInferRequest req = Request(x, tokens, id);
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::microseconds(absl::ToInt64Microseconds(o.deadline)));
    const absl::Time start = absl::Now();
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    const double latency_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    const double now = UnixNow();
    std::string wrong;
    if (s.ok()) {
      if (resp.id() != id || resp.outputs_size() != 1 || resp.raw_output_contents_size() != 1 ||
          resp.raw_output_contents(0).size() != static_cast<size_t>(tokens * kHidden * 4)) {
        wrong = absl::StrCat("request ", id, ": malformed answer (id '", resp.id(), "')");
      } else {
        std::vector<float> out(tokens * kHidden);
        std::memcpy(out.data(), resp.raw_output_contents(0).data(), out.size() * 4);
        const double err = ref.RelError(x, out.data(), tokens);
        if (!(err <= 1e-4)) {
          wrong = absl::StrCat("request ", id, " (", tokens, " tokens): relative error ", err);
        }
      }
    }
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      // The server went away: pause, and start a fresh channel (an old one may sit in
      // reconnect backoff after the server is back).
      absl::SleepFor(absl::Milliseconds(20));
      if (absl::Now() - last_reconnect > absl::Milliseconds(500)) {
        stub = inference::GRPCInferenceService::NewStub(NewChannel(o.target));
        last_reconnect = absl::Now();
      }
    }
    std::lock_guard<std::mutex> lock(tally.mu);
    ++tally.requests;
    const std::string code = CodeName(s.error_code());
    ++tally.by_code[code];
    if (!s.ok() && !tally.first_message.count(code)) tally.first_message[code] = s.error_message();
    if (latency_ms > absl::ToDoubleMilliseconds(o.deadline + o.late_slack)) ++tally.late;
    if (!wrong.empty()) {
      ++tally.wrong;
      if (tally.wrong_example.empty()) tally.wrong_example = wrong;
    }
    if (s.ok()) {
      tally.max_ok_latency_ms = std::max(tally.max_ok_latency_ms, latency_ms);
      tally.ok_latency_ms.push_back(latency_ms);
      if (tally.first_error_unix == 0) tally.last_ok_before_error_unix = now;
      if (tally.first_error_unix > 0 && tally.first_ok_after_error_unix == 0) {
        tally.first_ok_after_error_unix = now;
      }
    } else {
      tally.max_error_latency_ms = std::max(tally.max_error_latency_ms, latency_ms);
      if (tally.first_error_unix == 0) tally.first_error_unix = now;
    }
  }
}

// Clients that give up: streams cancelled with requests in flight, unary calls cancelled
// mid-flight, deadlines too short to be met. Returns how many calls it made.
int64_t Abuse(const Options& o, std::shared_ptr<grpc::Channel> channel, int64_t rounds) {
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  std::mt19937_64 rng(7);
  int64_t calls = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    {  // a stream cancelled after its first answer, with more requests in flight
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      auto stream = stub->ModelStreamInfer(&ctx);
      for (int i = 0; i < 8; ++i) {
        stream->Write(Request(RandomRows(32, rng), 32, absl::StrCat("s", r, "-", i)));
      }
      inference::ModelStreamInferResponse resp;
      stream->Read(&resp);
      ctx.TryCancel();
      stream->Finish().IgnoreError();
      ++calls;
    }
    {  // a stream whose client half-closes nothing and just goes away
      grpc::ClientContext ctx;
      auto stream = stub->ModelStreamInfer(&ctx);
      stream->Write(Request(RandomRows(64, rng), 64, "gone"));
      ctx.TryCancel();
      stream->Finish().IgnoreError();
      ++calls;
    }
    {  // unary calls cancelled while queued or running
      std::vector<std::thread> threads;
      for (int i = 0; i < 4; ++i) {
        threads.emplace_back([&, i] {
          grpc::ClientContext ctx;
          std::mt19937_64 local(r * 16 + i);
          inference::ModelInferRequest req = Request(RandomRows(128, local), 128);
          inference::ModelInferResponse resp;
          std::thread canceller([&ctx, i] {
            absl::SleepFor(absl::Microseconds(200 * (i + 1)));
            ctx.TryCancel();
          });
          stub->ModelInfer(&ctx, req, &resp).error_code();
          canceller.join();
        });
      }
      for (auto& t : threads) t.join();
      calls += 4;
    }
    {  // a deadline shorter than the work
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::microseconds(300));
      inference::ModelInferResponse resp;
      stub->ModelInfer(&ctx, Request(RandomRows(256, rng), 256), &resp).error_code();
      ++calls;
    }
  }
  return calls;
}

std::string Quote(const std::string& s) { return ::epserve::client::JsonQuote(s); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, rank == 0 ? 0 : rank - 1)];
}

int Run(const Options& o) {
  auto channel = NewChannel(o.target);
  if (!channel->WaitForConnected(
          std::chrono::system_clock::now() +
          std::chrono::microseconds(absl::ToInt64Microseconds(o.connect_timeout)))) {
    std::fprintf(stderr, "epserve-verify: cannot connect to %s\n", o.target.c_str());
    return 2;
  }
  HealthWatcher health(o.target, o.health_interval);
  Tally tally;
  int64_t abuse_calls = 0;
  if (o.abuse > 0) abuse_calls = Abuse(o, channel, o.abuse);
  std::atomic<int64_t> issued{0};
  const absl::Time end = absl::Now() + o.duration;
  std::vector<std::thread> threads;
  const bool load = o.abuse == 0 || o.requests > 0;
  // Separate channels: one stuck connection does not hold every client. Each is connected
  // before its first request, as the first channel was above: a request on a channel whose
  // first connection attempt is still failing fails at once (UNAVAILABLE, "failed to connect
  // to all addresses"), which says nothing about the server's answers. Later failures, once
  // a channel was up (a killed server), still count.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; load && i < o.concurrency; ++i) {
    channels.push_back(NewChannel(o.target));
    if (!channels.back()->WaitForConnected(
            std::chrono::system_clock::now() +
            std::chrono::microseconds(absl::ToInt64Microseconds(o.connect_timeout)))) {
      std::fprintf(stderr, "epserve-verify: cannot connect client %d to %s\n", i, o.target.c_str());
      return 2;
    }
  }
  for (int i = 0; i < static_cast<int>(channels.size()); ++i) {
    threads.emplace_back(RequestLoop, std::cref(o), channels[i], i, std::ref(issued), end,
                         std::ref(tally));
  }
  for (auto& t : threads) t.join();
  health.Stop();

  std::vector<std::string> codes, messages, transitions;
  for (const auto& [code, n] : tally.by_code) codes.push_back(absl::StrCat(Quote(code), ":", n));
  for (const auto& [code, m] : tally.first_message) {
    messages.push_back(absl::StrCat(Quote(code), ":", Quote(m)));
  }
  for (const auto& [t, state] : health.transitions()) {
    transitions.push_back(absl::StrCat("[", absl::StrFormat("%.3f", t), ",", Quote(state), "]"));
  }
  std::printf(
      "{\"requests\":%lld,\"codes\":{%s},\"wrong\":%lld,\"late\":%lld,"
      "\"max_ok_latency_ms\":%.1f,\"p50_ok_latency_ms\":%.1f,\"p99_ok_latency_ms\":%.1f,"
      "\"max_error_latency_ms\":%.1f,\"last_ok_before_error_unix\":%.3f,"
      "\"first_error_unix\":%.3f,\"first_ok_after_error_unix\":%.3f,\"abuse_calls\":%lld,"
      "\"health\":[%s],\"error_examples\":{%s},\"wrong_example\":%s}\n",
      static_cast<long long>(tally.requests), absl::StrJoin(codes, ",").c_str(),
      static_cast<long long>(tally.wrong), static_cast<long long>(tally.late),
      tally.max_ok_latency_ms, Percentile(tally.ok_latency_ms, 0.5),
      Percentile(tally.ok_latency_ms, 0.99), tally.max_error_latency_ms,
      tally.last_ok_before_error_unix, tally.first_error_unix, tally.first_ok_after_error_unix,
      static_cast<long long>(abuse_calls), absl::StrJoin(transitions, ",").c_str(),
      absl::StrJoin(messages, ",").c_str(), Quote(tally.wrong_example).c_str());
  std::fflush(stdout);
  const bool all_answered = o.requests == 0 || tally.by_code["OK"] == o.requests;
  return tally.wrong == 0 && tally.late == 0 && all_answered ? 0 : 1;
}

}  // namespace
}  // namespace epserve::testing

int main(int argc, char** argv) {
  epserve::testing::Options o;
  epserve::common::FlagSet fs("epserve-verify",
                              "Checks a synthetic:tiny cluster's answers against the reference "
                              "while it is hurt; prints a JSON summary.");
  fs.Add("target", &o.target, "Server address host:port");
  fs.Add("concurrency", &o.concurrency, "Client threads, each with one request in flight");
  fs.Add("requests", &o.requests, "Total requests (0: run for --duration or --until-file)");
  fs.Add("duration", &o.duration, "How long to send requests when --requests is 0");
  fs.Add("until-file", &o.until_file,
         "Stop sending once this file exists (or --duration has passed, whichever is first)");
  fs.Add("deadline", &o.deadline, "Deadline of every request");
  fs.Add("late-slack", &o.late_slack, "An answer later than deadline + this counts as late");
  fs.Add("min-tokens", &o.min_tokens, "Fewest token rows in a request");
  fs.Add("max-tokens", &o.max_tokens, "Most token rows in a request");
  fs.Add("health-interval", &o.health_interval, "How often grpc.health.v1 Check is asked");
  fs.Add("abuse", &o.abuse, "Rounds of cancelled streams and calls before the load (0: none)");
  fs.Add("connect-timeout", &o.connect_timeout, "How long to wait for the server at start");
  absl::Status s = fs.Parse(argc, argv);
  if (fs.help_requested()) {
    std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
  if (!s.ok() || o.concurrency < 1 || o.min_tokens < 1 || o.max_tokens < o.min_tokens) {
    std::fprintf(stderr, "epserve-verify: %s\n",
                 s.ok() ? "bad --concurrency or token range" : std::string(s.message()).c_str());
    return 2;
  }
  return epserve::testing::Run(o);
}
