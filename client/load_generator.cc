#include "client/load_generator.h"

#include <grpc/grpc.h>
#include <grpc/support/time.h>
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace epserve::client {

absl::string_view ArrivalName(Arrival arrival) {
  return arrival == Arrival::kPoisson ? "poisson" : "constant";
}

absl::StatusOr<Arrival> ParseArrival(absl::string_view text) {
  if (text == "constant") return Arrival::kConstant;
  if (text == "poisson") return Arrival::kPoisson;
  return absl::InvalidArgumentError(
      absl::StrCat("arrival: '", text, "' is neither 'constant' nor 'poisson'"));
}

std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const std::string& target,
                                                         int num_connections) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < num_connections; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    // A private subchannel pool and a distinct argument give each channel its own
    // connection instead of sharing one through the global pool.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("epserve.load.connection_index", i);
    channels.push_back(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  return channels;
}

namespace {

absl::string_view ChannelStateName(grpc_connectivity_state state) {
  switch (state) {
    case GRPC_CHANNEL_IDLE:
      return "IDLE";
    case GRPC_CHANNEL_CONNECTING:
      return "CONNECTING";
    case GRPC_CHANNEL_READY:
      return "READY";
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return "TRANSIENT_FAILURE";
    case GRPC_CHANNEL_SHUTDOWN:
      return "SHUTDOWN";
  }
  return "UNKNOWN_STATE";
}

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             absl::ToChronoNanoseconds(timeout));
}

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

}  // namespace

absl::Status WaitForChannels(const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                             absl::string_view target, absl::Duration timeout) {
  const auto deadline = DeadlineAfter(timeout);
  for (const auto& channel : channels) {
    if (!channel->WaitForConnected(deadline)) {
      return absl::UnavailableError(absl::StrCat("cannot connect to ", target, " within ",
                                                 absl::FormatDuration(timeout), " (channel state ",
                                                 ChannelStateName(channel->GetState(false)),
                                                 "); is the server running and listening there?"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> QueryHiddenSize(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& model, absl::Duration timeout) {
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(timeout));
  inference::ModelMetadataRequest request;
  request.set_name(model);
  inference::ModelMetadataResponse response;
  grpc::Status status = stub->ModelMetadata(&context, request, &response);
  if (!status.ok()) return FromGrpc(status, absl::StrCat("ModelMetadata(\"", model, "\")"));
  for (const auto& input : response.inputs()) {
    if (input.name() != kInputName) continue;
    if (input.datatype() != kDatatype || input.shape_size() != 2 || input.shape(1) <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "model \"", model, "\" input ", kInputName, " is ", input.datatype(), " [",
          absl::StrJoin(input.shape(), ","), "]; expected ", kDatatype, " [-1,H] with H > 0"));
    }
    return input.shape(1);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("model \"", model, "\" has no input named ", kInputName));
}

LoadGenerator::LoadGenerator(std::vector<std::shared_ptr<grpc::Channel>> channels,
                             LoadOptions options)
    : options_(std::move(options)) {
  for (auto& channel : channels)
    stubs_.push_back(inference::GRPCInferenceService::NewStub(channel));
}

absl::Status LoadGenerator::Validate(const StepSpec& step) const {
  const LoadOptions& o = options_;
  if (stubs_.empty()) return absl::InvalidArgumentError("connections: need at least one channel");
  if (o.request.hidden_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: ", o.request.hidden_size, " must be > 0"));
  }
  if (o.tokens.min_tokens < 1 || o.tokens.max_tokens < o.tokens.min_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: range ", FormatTokenRange(o.tokens), " is empty"));
  }
  // A tensor must fit one protobuf bytes field (< 2 GiB).
  constexpr int64_t kMaxPayloadBytes = (int64_t{1} << 31) - (int64_t{1} << 20);
  if (o.tokens.max_tokens > kMaxPayloadBytes / kBytesPerElement / o.request.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: ", o.tokens.max_tokens,
                                                   " rows of hidden size ", o.request.hidden_size,
                                                   " exceed the 2 GiB limit of one message"));
  }
  if (o.num_requests < 0) return absl::InvalidArgumentError("requests: must be >= 0");
  if (o.num_requests == 0 && o.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("duration: must be > 0 when --requests is 0");
  }
  if (o.warmup < absl::ZeroDuration()) return absl::InvalidArgumentError("warmup: must be >= 0");
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout: must be > 0");
  if (o.num_threads < 1 || o.num_threads > 1023) {
    return absl::InvalidArgumentError("threads: must be in [1, 1023]");
  }
  if (o.max_outstanding < 1) return absl::InvalidArgumentError("max-outstanding: must be >= 1");
  if (step.mode == LoadMode::kClosedLoop) {
    if (step.concurrency < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("concurrency: ", step.concurrency, " must be >= 1"));
    }
  } else if (!(step.rate_per_s > 0) || !std::isfinite(step.rate_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat("rate: ", step.rate_per_s, " must be > 0"));
  }
  return absl::OkStatus();
}

namespace {

using Clock = std::chrono::steady_clock;
using Stub = inference::GRPCInferenceService::Stub;

int64_t ToNanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

Clock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(d));
}

// One ModelInfer call in flight. Owned by the completion queue between StartCall and the
// dequeue of its tag (the Call itself), then by the lane thread that dequeued it.
struct Call {
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<inference::ModelInferResponse>> reader;
  std::string id;
  Clock::time_point start;  // latency origin (intended send time in open loop)
  int64_t tokens = 0;
  bool measured = false;
  int slot = -1;  // closed-loop worker that sends again on completion; -1: none
};

// What a sending thread needs of its own: payload generator, request scratch (reused so
// its 2 MiB-class buffer is not reallocated per request), ids and stub rotation.
struct Sender {
  Sender(uint64_t seed, uint64_t stream, std::string prefix)
      : rng(seed, stream), id_prefix(std::move(prefix)) {}
  FastRng rng;
  inference::ModelInferRequest scratch;
  std::string id_prefix;
  uint64_t next_id = 0;
  size_t next_stub = 0;
};

// A completion queue with the thread that drains it. The thread owns `stats` and
// `sender` for the whole step; nothing else touches them until it has been joined
// (before that, only the main thread, before the thread starts).
struct Lane {
  Lane(uint64_t seed, uint64_t stream, std::string id_prefix_value)
      : sender(seed, stream, std::move(id_prefix_value)) {}
  grpc::CompletionQueue cq;
  Sender sender;
  WorkerStats stats;
  Clock::time_point last_measured_completion = Clock::time_point::min();
  std::thread thread;
};

// The state of one running step.
class StepRun {
 public:
  StepRun(const LoadOptions& options, const std::vector<std::unique_ptr<Stub>>& stubs,
          const StepSpec& step, int step_index)
      : options_(options), stubs_(stubs), step_(step) {
    for (int k = 0; k < options.num_threads; ++k) {
      // Generator streams: step i's lane k uses i * 1024 + k, its pacer i * 1024 + 1023.
      const uint64_t stream = static_cast<uint64_t>(step_index) * 1024 + static_cast<uint64_t>(k);
      lanes_.push_back(std::make_unique<Lane>(options.seed, stream,
                                              absl::StrCat("s", step_index, "-w", k, "-")));
    }
    pacer_stream_ = static_cast<uint64_t>(step_index) * 1024 + 1023;
    pacer_id_prefix_ = absl::StrCat("s", step_index, "-p-");
  }

  StepReport Run() {
    start_ = Clock::now();
    measure_begin_ = start_ + ToClock(options_.warmup);
    measure_end_ = measure_begin_ + ToClock(options_.duration);

    if (step_.mode == LoadMode::kClosedLoop) {
      // Initial sends happen on this thread before the lane threads exist, so each
      // lane's sender is only ever used by one thread at a time.
      for (int slot = 0; slot < step_.concurrency; ++slot) {
        Lane& lane = *lanes_[static_cast<size_t>(slot) % lanes_.size()];
        SendNextForSlot(lane, slot);
      }
      StartLanes();
    } else {
      StartLanes();
      std::thread pacer([this] { PaceOpenLoop(); });
      pacer.join();
    }
    while (in_flight_.load(std::memory_order_acquire) > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    for (auto& lane : lanes_) lane->cq.Shutdown();
    for (auto& lane : lanes_) lane->thread.join();
    return Report();
  }

 private:
  void StartLanes() {
    for (auto& lane : lanes_) {
      Lane* l = lane.get();
      l->thread = std::thread([this, l] { Drain(*l); });
    }
  }

  // Builds the next request of `sender` into its scratch; returns its token count.
  int64_t BuildNext(Sender& sender, std::string* id) {
    const int64_t tokens =
        options_.tokens.min_tokens +
        static_cast<int64_t>(sender.rng() % static_cast<uint64_t>(options_.tokens.max_tokens -
                                                                  options_.tokens.min_tokens + 1));
    *id = absl::StrCat(sender.id_prefix, sender.next_id++);
    BuildInferRequest(options_.request, tokens, *id, sender.rng, &sender.scratch);
    return tokens;
  }

  // Hands `call` (request already built in sender.scratch) to gRPC on `cq`.
  void Start(Sender& sender, std::unique_ptr<Call> call, grpc::CompletionQueue& cq) {
    call->context.set_deadline(DeadlineAfter(options_.timeout));
    Stub& stub = *stubs_[sender.next_stub++ % stubs_.size()];
    in_flight_.fetch_add(1, std::memory_order_acq_rel);
    // PrepareAsync serializes the request, so the scratch may be rebuilt right after.
    call->reader = stub.PrepareAsyncModelInfer(&call->context, sender.scratch, &cq);
    call->reader->StartCall();
    Call* raw = call.release();
    raw->reader->Finish(&raw->response, &raw->status, raw);
  }

  // Closed loop: decides whether `slot` sends again now, and if so sends from `lane`.
  void SendNextForSlot(Lane& lane, int slot) {
    Clock::time_point now = Clock::now();
    bool measured = false;
    if (options_.num_requests == 0) {
      if (now >= measure_end_) return;
      measured = now >= measure_begin_;
    } else if (now >= measure_begin_) {
      if (tickets_.fetch_add(1, std::memory_order_relaxed) >= options_.num_requests) return;
      measured = true;
    }
    auto call = std::make_unique<Call>();
    call->tokens = BuildNext(lane.sender, &call->id);
    call->measured = measured;
    call->slot = slot;
    call->start = Clock::now();
    Start(lane.sender, std::move(call), lane.cq);
  }

  // Open loop: sends on the arrival schedule until the window (or the request count) is
  // exhausted. Runs on its own thread with its own sender.
  void PaceOpenLoop() {
    Sender sender(options_.seed, pacer_stream_, pacer_id_prefix_);
    const double mean_gap_s = 1.0 / step_.rate_per_s;
    Clock::time_point intended = start_;
    int64_t measured_sent = 0;
    size_t next_lane = 0;
    for (;;) {
      if (options_.num_requests == 0 && intended >= measure_end_) break;
      const bool measured = intended >= measure_begin_;
      if (measured && options_.num_requests > 0 && measured_sent >= options_.num_requests) break;
      if (measured) ++measured_sent;

      if (in_flight_.load(std::memory_order_acquire) >= options_.max_outstanding) {
        // Not sent: counted, never silently skipped. The pacer records it itself;
        // its stats are merged after it has been joined.
        std::this_thread::sleep_until(intended);
        if (measured) {
          pacer_stats_.RecordError("CLIENT_BACKLOG",
                                   absl::StrCat(options_.max_outstanding,
                                                " requests already in flight (--max-outstanding)"));
          pacer_last_measured_ = std::max(pacer_last_measured_, Clock::now());
        }
      } else {
        auto call = std::make_unique<Call>();
        call->tokens = BuildNext(sender, &call->id);  // built ahead of its send time
        call->measured = measured;
        call->start = intended;
        std::this_thread::sleep_until(intended);
        Start(sender, std::move(call), lanes_[next_lane++ % lanes_.size()]->cq);
      }

      double gap_s = mean_gap_s;
      if (step_.arrival == Arrival::kPoisson)
        gap_s = -std::log1p(-sender.rng.UniformUnit()) * mean_gap_s;
      intended += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap_s));
    }
  }

  // Lane thread: records each completion and, in closed loop, sends the slot's next
  // request. Completions already waiting are dequeued and timestamped before any of them
  // is acted on, so that building the next payloads does not delay their timestamps.
  void Drain(Lane& lane) {
    constexpr size_t kMaxBatch = 64;
    std::vector<std::pair<std::unique_ptr<Call>, Clock::time_point>> batch;
    batch.reserve(kMaxBatch);
    void* tag = nullptr;
    bool ok = false;
    while (lane.cq.Next(&tag, &ok)) {
      batch.emplace_back(static_cast<Call*>(tag), Clock::now());
      // No shutdown can race this poll: Shutdown waits for in_flight_ == 0, and these
      // calls still count as in flight.
      while (batch.size() < kMaxBatch &&
             lane.cq.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) ==
                 grpc::CompletionQueue::GOT_EVENT) {
        batch.emplace_back(static_cast<Call*>(tag), Clock::now());
      }
      for (auto& [call, done] : batch) {
        if (!call->measured) continue;
        Record(lane, *call, done);
        lane.last_measured_completion = std::max(lane.last_measured_completion, done);
      }
      for (auto& [call, done] : batch) {
        if (call->slot >= 0) SendNextForSlot(lane, call->slot);
        call.reset();
        in_flight_.fetch_sub(1, std::memory_order_acq_rel);
      }
      batch.clear();
    }
  }

  void Record(Lane& lane, const Call& call, Clock::time_point done) {
    if (!call.status.ok()) {
      lane.stats.RecordError(StatusCodeName(call.status.error_code()), call.status.error_message());
      return;
    }
    absl::Status check =
        CheckInferResponse(call.response, call.tokens, options_.request.hidden_size, call.id);
    if (!check.ok()) {
      lane.stats.RecordError(kBadResponse, check.message());
      return;
    }
    lane.stats.RecordOk(ToNanos(done - call.start), call.tokens);
  }

  StepReport Report() {
    WorkerStats merged;
    Clock::time_point last = pacer_last_measured_;
    merged.MergeFrom(std::move(pacer_stats_));
    for (auto& lane : lanes_) {
      merged.MergeFrom(std::move(lane->stats));
      last = std::max(last, lane->last_measured_completion);
    }
    Clock::time_point end = options_.num_requests == 0 ? measure_end_ : measure_begin_;
    end = std::max(end, last);
    const double duration_s = std::chrono::duration<double>(end - measure_begin_).count();
    return MakeStepReport(
        step_.mode, step_.concurrency, step_.rate_per_s,
        step_.mode == LoadMode::kOpenLoop ? std::string(ArrivalName(step_.arrival)) : std::string(),
        merged, duration_s);
  }

  const LoadOptions& options_;
  const std::vector<std::unique_ptr<Stub>>& stubs_;
  const StepSpec step_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  uint64_t pacer_stream_ = 0;
  std::string pacer_id_prefix_;
  Clock::time_point start_;
  Clock::time_point measure_begin_;
  Clock::time_point measure_end_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> tickets_{0};  // closed loop, request-count mode: measured sends
  // Written by the pacer thread only; read after it has been joined.
  WorkerStats pacer_stats_;
  Clock::time_point pacer_last_measured_ = Clock::time_point::min();
};

}  // namespace

StepReport LoadGenerator::RunStep(const StepSpec& step, int step_index) {
  StepRun run(options_, stubs_, step, step_index);
  return run.Run();
}

}  // namespace epserve::client
