// The front-end's own cost: requests per second and latency of ModelInfer through the epserve
// front-end (validation, dynamic batcher, pipeline threads, answering) over a trivial model
// (an executor that copies each row back), beside a bare gRPC echo server with the same
// messages (the floor), both in this process, at 1, 16 and 64 concurrent clients.
//   bench_frontend [--seconds=3] [--hidden=2048] [--tokens=1] [--clients=1,16,64]
//                  [--connections=N] [--allocator=service|keep|glibc]
// --connections spreads every point's clients over N connections (default: one per client,
// at most 8); with large requests (--tokens=2048 is 16 MiB each way) and --connections=1 the
// echo is what one HTTP/2 connection carries at most. --allocator sets glibc's allocator as
// epserve's rank 0 does by default (service), as it does with --keep-request-buffers (keep), or
// leaves glibc's own adaptive thresholds (glibc); it applies to both servers and the clients,
// which share this process.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpc_service.grpc.pb.h"
#include "server/front_end.h"
#include "server/service.h"

namespace epserve::bench {
namespace {

// The floor: answers ModelInfer with a copy of the input, nothing else.
class EchoService final : public inference::GRPCInferenceService::CallbackService {
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx,
                                       const inference::ModelInferRequest* req,
                                       inference::ModelInferResponse* resp) override {
    resp->set_model_name(req->model_name());
    resp->set_id(req->id());
    auto* out = resp->add_outputs();
    out->set_name("moe_output");
    out->set_datatype("FP32");
    *out->mutable_shape() = req->inputs(0).shape();
    *resp->add_raw_output_contents() = req->raw_input_contents(0);
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

struct Result {
  double rps = 0;
  double p50_us = 0, p90_us = 0, p99_us = 0;
  int64_t errors = 0;
};

// `clients` closed-loop clients (each sends its next request when the last one is answered),
// spread over `connections` connections (0: one per client, at most 8), for `seconds` after a
// warm-up.
Result Load(const std::string& address, const inference::ModelInferRequest& request, int clients,
            int connections, double seconds) {
  std::vector<std::unique_ptr<inference::GRPCInferenceService::Stub>> stubs;
  const int n = connections > 0 ? std::min(clients, connections) : std::min(clients, 8);
  for (int c = 0; c < n; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    args.SetInt("epserve.bench.channel", c);
    stubs.push_back(inference::GRPCInferenceService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
  struct Slot {
    inference::GRPCInferenceService::Stub* stub;
    std::unique_ptr<grpc::ClientContext> ctx;
    inference::ModelInferResponse resp;
    absl::Time start;
    std::vector<float> latencies_us;
    int64_t errors = 0;
  };
  std::vector<Slot> slots(clients);
  std::atomic<bool> measuring{false}, stopping{false};
  std::atomic<int> running{clients};
  std::function<void(Slot&)> issue = [&](Slot& s) {
    s.ctx = std::make_unique<grpc::ClientContext>();
    s.resp.Clear();
    s.start = absl::Now();
    s.stub->async()->ModelInfer(s.ctx.get(), &request, &s.resp, [&](grpc::Status st) {
      if (measuring.load(std::memory_order_relaxed)) {
        s.latencies_us.push_back(
            static_cast<float>(absl::ToDoubleMicroseconds(absl::Now() - s.start)));
        if (!st.ok()) ++s.errors;
      }
      if (stopping.load()) {
        --running;
      } else {
        issue(s);
      }
    });
  };
  for (int c = 0; c < clients; ++c) {
    slots[c].stub = stubs[c % stubs.size()].get();
    issue(slots[c]);
  }
  absl::SleepFor(absl::Milliseconds(500));
  measuring = true;
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Seconds(seconds));
  measuring = false;
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - t0);
  stopping = true;
  while (running.load() > 0) absl::SleepFor(absl::Milliseconds(1));
  std::vector<float> all;
  Result r;
  for (Slot& s : slots) {
    all.insert(all.end(), s.latencies_us.begin(), s.latencies_us.end());
    r.errors += s.errors;
  }
  std::sort(all.begin(), all.end());
  auto pct = [&](double p) {
    return all.empty() ? 0.0 : all[static_cast<size_t>(p * (all.size() - 1))];
  };
  r.rps = all.size() / elapsed;
  r.p50_us = pct(0.50);
  r.p90_us = pct(0.90);
  r.p99_us = pct(0.99);
  return r;
}

int Main(int argc, char** argv) {
  double seconds = 3;
  int64_t hidden = 2048, tokens = 1;
  int connections = 0;
  std::vector<int> client_counts = {1, 16, 64};
  std::string allocator = "service";
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--seconds=")) {
      if (!absl::SimpleAtod(a, &seconds)) return 2;
    } else if (absl::ConsumePrefix(&a, "--hidden=")) {
      if (!absl::SimpleAtoi(a, &hidden)) return 2;
    } else if (absl::ConsumePrefix(&a, "--tokens=")) {
      if (!absl::SimpleAtoi(a, &tokens)) return 2;
    } else if (absl::ConsumePrefix(&a, "--connections=")) {
      if (!absl::SimpleAtoi(a, &connections) || connections < 1) return 2;
    } else if (absl::ConsumePrefix(&a, "--allocator=")) {
      allocator = std::string(a);
      if (allocator != "service" && allocator != "keep" && allocator != "glibc") {
        std::fprintf(stderr, "--allocator must be service, keep or glibc, not '%s'\n",
                     allocator.c_str());
        return 2;
      }
    } else if (absl::ConsumePrefix(&a, "--clients=")) {
      client_counts.clear();
      for (absl::string_view c : absl::StrSplit(a, ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(c, &n) || n < 1) return 2;
        client_counts.push_back(n);
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--seconds=3] [--hidden=2048] [--tokens=1] "
                   "[--clients=1,16,64] [--connections=N] [--allocator=service|keep|glibc]\n",
                   argv[0]);
      return 2;
    }
  }

  if (allocator != "glibc") server::ConfigureAllocator(allocator == "keep");

  EchoService echo;
  grpc::ServerBuilder builder;
  int echo_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &echo_port);
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.RegisterService(&echo);
  std::unique_ptr<grpc::Server> echo_server = builder.BuildAndStart();

  server::FrontEndOptions options;
  options.grpc_address = "127.0.0.1:0";
  options.metrics.address = "127.0.0.1:0";
  options.batching.max_queue_delay_us = 0;
  options.batching.max_batch_tokens = std::max<int64_t>(256, tokens);
  server::ServedModel model;
  model.hidden_size = hidden;
  model.layers = {0};
  absl::StatusOr<std::unique_ptr<server::FrontEnd>> fe = server::FrontEnd::StartWithExecutor(
      options, model, [hidden](int, std::span<const worker::RowChunk> chunks) {
        for (const worker::RowChunk& c : chunks) {
          std::memcpy(c.output, c.input, c.rows * hidden * sizeof(float));
        }
        return absl::OkStatus();
      });
  if (!fe.ok()) {
    std::fprintf(stderr, "front-end: %s\n", fe.status().ToString().c_str());
    return 1;
  }

  std::vector<float> x(tokens * hidden, 0.5f);
  inference::ModelInferRequest req;
  req.set_model_name("moe");
  auto* in = req.add_inputs();
  in->set_name("hidden_states");
  in->set_datatype("FP32");
  in->add_shape(tokens);
  in->add_shape(hidden);
  req.add_raw_input_contents(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));

  std::printf(
      "ModelInfer, %lld token(s) x H=%lld FP32 (%lld bytes each way), %.0f s per point, "
      "%u hardware threads shared by clients and server, %s, allocator: %s\n\n",
      static_cast<long long>(tokens), static_cast<long long>(hidden),
      static_cast<long long>(x.size() * 4), seconds, std::thread::hardware_concurrency(),
      connections > 0 ? absl::StrCat(connections, " connection(s) per point").c_str()
                      : "one connection per client (at most 8)",
      allocator == "service" ? "epserve's default (server::ConfigureAllocator)"
      : allocator == "keep"  ? "epserve's with --keep-request-buffers"
                             : "glibc's adaptive thresholds");
  std::printf(
      "| clients | echo req/s | echo p50 us | echo p99 us | epserve req/s | epserve p50 us "
      "| epserve p99 us | added p50 us | req/s ratio | echo MB/s each way | epserve MB/s each way "
      "|\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  const double mb = static_cast<double>(x.size() * 4) / 1e6;
  int failed_targets = 0;
  std::string verdicts;
  for (int clients : client_counts) {
    const Result e =
        Load(absl::StrCat("127.0.0.1:", echo_port), req, clients, connections, seconds);
    const Result f = Load((*fe)->grpc_address(), req, clients, connections, seconds);
    const double ratio = f.rps / std::max(e.rps, 1.0);
    std::printf("| %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %+.0f | %.2f | %.0f | %.0f |\n",
                clients, e.rps, e.p50_us, e.p99_us, f.rps, f.p50_us, f.p99_us, f.p50_us - e.p50_us,
                ratio, e.rps * mb, f.rps * mb);
    std::fflush(stdout);
    if (e.errors + f.errors > 0) {
      std::printf("errors: echo %lld, epserve %lld\n", static_cast<long long>(e.errors),
                  static_cast<long long>(f.errors));
      ++failed_targets;
    }
    if (clients == 1) {
      const bool met = f.p50_us <= e.p50_us + 50;
      verdicts +=
          absl::StrCat("target 1 client: p50 <= echo p50 + 50 us: ", met ? "met" : "NOT met", "\n");
    }
    if (clients == 64) {
      const bool met = ratio >= 0.5;
      verdicts +=
          absl::StrCat("target 64 clients: req/s >= 0.5 x echo: ", met ? "met" : "NOT met", "\n");
    }
  }
  std::printf("\n%s", verdicts.c_str());
  (*fe)->Shutdown().IgnoreError();
  echo_server->Shutdown();
  return failed_targets == 0 ? 0 : 1;
}

}  // namespace
}  // namespace epserve::bench

int main(int argc, char** argv) { return epserve::bench::Main(argc, argv); }
