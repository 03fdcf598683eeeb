#include "client/load_generator.h"

#include <grpc/grpc.h>
#include <grpc/support/time.h>
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
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

std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const ChannelOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < options.num_connections; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    // A private subchannel pool and a distinct argument give each channel its own
    // connection instead of sharing one through the global pool.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("epserve.load.connection_index", i);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
    channels.push_back(grpc::CreateCustomChannel(options.target, credentials, args));
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

void AddToken(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
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
                                        const std::string& model, absl::Duration timeout,
                                        const std::string& token) {
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(timeout));
  AddToken(context, token);
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

absl::StatusOr<inference::ModelStatistics> QueryStatistics(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& model, absl::Duration timeout,
    const std::string& token) {
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(timeout));
  AddToken(context, token);
  inference::ModelStatisticsRequest request;
  request.set_name(model);
  inference::ModelStatisticsResponse response;
  grpc::Status status = stub->ModelStatistics(&context, request, &response);
  if (!status.ok()) return FromGrpc(status, absl::StrCat("ModelStatistics(\"", model, "\")"));
  for (const auto& stats : response.model_stats()) {
    if (stats.name() == model || response.model_stats_size() == 1) return stats;
  }
  return absl::NotFoundError(absl::StrCat("ModelStatistics has no entry for \"", model, "\""));
}

ServerSplit SplitBetween(const inference::ModelStatistics& before,
                         const inference::ModelStatistics& after) {
  const auto& b = before.inference_stats();
  const auto& a = after.inference_stats();
  auto count = [](const inference::StatisticDuration& x, const inference::StatisticDuration& y) {
    return static_cast<int64_t>(y.count()) - static_cast<int64_t>(x.count());
  };
  auto mean_ms = [](const inference::StatisticDuration& x, const inference::StatisticDuration& y) {
    const double n = static_cast<double>(y.count()) - static_cast<double>(x.count());
    return n > 0 ? (static_cast<double>(y.ns()) - static_cast<double>(x.ns())) / n / 1e6 : 0.0;
  };
  ServerSplit s;
  s.requests = count(b.success(), a.success());
  s.failed = count(b.fail(), a.fail());
  s.queue_ms = mean_ms(b.queue(), a.queue());
  s.compute_input_ms = mean_ms(b.compute_input(), a.compute_input());
  s.compute_infer_ms = mean_ms(b.compute_infer(), a.compute_infer());
  s.compute_output_ms = mean_ms(b.compute_output(), a.compute_output());
  s.batches = static_cast<int64_t>(after.execution_count()) -
              static_cast<int64_t>(before.execution_count());
  // Rows per batch from the per-size batch counts.
  auto rows_of = [](const inference::ModelStatistics& m) {
    double rows = 0;
    for (const auto& bs : m.batch_stats()) {
      rows +=
          static_cast<double>(bs.batch_size()) * static_cast<double>(bs.compute_infer().count());
    }
    return rows;
  };
  if (s.batches > 0) {
    s.mean_batch_rows = (rows_of(after) - rows_of(before)) / static_cast<double>(s.batches);
  }
  return s;
}

LoadGenerator::LoadGenerator(std::vector<std::shared_ptr<grpc::Channel>> channels,
                             LoadOptions options)
    : channels_(std::move(channels)), options_(std::move(options)) {
  for (auto& channel : channels_)
    stubs_.push_back(inference::GRPCInferenceService::NewStub(channel));
  // A stream has one deadline for all its requests; each request's own is the server's.
  if (options_.stream && options_.request.timeout_us == 0) {
    options_.request.timeout_us = absl::ToInt64Microseconds(options_.timeout);
  }
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
  if (o.tokens.max_tokens > kMaxPayloadBytes /
                                static_cast<int64_t>(common::ElementBytes(o.request.dtype)) /
                                o.request.hidden_size) {
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
  if (o.stream && o.num_streams < 1) return absl::InvalidArgumentError("streams: must be >= 1");
  if (o.verifier != nullptr && o.verifier->hidden_size() != o.request.hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("verify-model: hidden size ", o.verifier->hidden_size(),
                     " differs from the served model's ", o.request.hidden_size));
  }
  if (o.shared_memory != nullptr) {
    if (step.mode != LoadMode::kClosedLoop) {
      return absl::InvalidArgumentError("shared-memory: closed loop only (--concurrency)");
    }
    if (step.concurrency > o.shared_memory->slots()) {
      return absl::InvalidArgumentError(absl::StrCat("shared-memory: concurrency ",
                                                     step.concurrency, " exceeds the region's ",
                                                     o.shared_memory->slots(), " slots"));
    }
  }
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
using StreamRw =
    grpc::ClientReaderWriter<inference::ModelInferRequest, inference::ModelStreamInferResponse>;

int64_t ToNanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

Clock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(d));
}

// The gRPC code named by the prefix of a stream's in-band error ("RESOURCE_EXHAUSTED:
// ..."), or UNKNOWN.
grpc::StatusCode CodeOfStreamError(absl::string_view message) {
  const absl::string_view name = message.substr(0, message.find(':'));
  for (int code = 1; code <= 16; ++code) {
    if (StatusCodeName(code) == name) return static_cast<grpc::StatusCode>(code);
  }
  return grpc::StatusCode::UNKNOWN;
}

// One request in flight. Unary: owned by the completion queue between StartCall and the
// dequeue of its tag (the Call itself), then by the lane thread that dequeued it. Stream:
// owned by its stream's pending map until the reader thread takes it out.
struct Call {
  grpc::ClientContext context;  // unary only
  inference::ModelInferResponse response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<inference::ModelInferResponse>> reader;
  std::string id;
  Clock::time_point start;  // latency origin (intended send time in open loop)
  int64_t tokens = 0;
  bool measured = false;
  int slot = -1;             // closed-loop worker that sends again on completion; -1: none
  std::vector<float> input;  // the values sent, kept for the verifier
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

// What a completion thread records into: its own stats, for the whole step.
struct Recorder {
  WorkerStats stats;
  Clock::time_point last_measured_completion = Clock::time_point::min();
};

// A completion queue with the thread that drains it. The thread owns `recorder` and
// `sender` for the whole step; nothing else touches them until it has been joined
// (before that, only the main thread, before the thread starts).
struct Lane {
  Lane(uint64_t seed, uint64_t stream, std::string id_prefix_value)
      : sender(seed, stream, std::move(id_prefix_value)) {}
  grpc::CompletionQueue cq;
  Sender sender;
  Recorder recorder;
  std::thread thread;
};

// One ModelStreamInfer stream with its writer and reader threads. The reader owns
// `recorder` and `sender` (closed loop sends from it); `mu` guards the queue, the
// pending map and the flags.
struct StreamConn {
  StreamConn(uint64_t seed, uint64_t stream, std::string id_prefix_value)
      : sender(seed, stream, std::move(id_prefix_value)) {}
  grpc::ClientContext context;
  std::unique_ptr<StreamRw> rw;
  Sender sender;
  Recorder recorder;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<inference::ModelInferRequest>> queue;  // guarded by mu
  std::unordered_map<std::string, std::unique_ptr<Call>> pending;   // guarded by mu
  bool closing = false;  // guarded by mu: no more requests; half-close when drained
  bool broken = false;   // guarded by mu: a write failed or the stream ended
  bool dead = false;     // guarded by mu: the reader has failed every pending call
  std::thread writer, reader;
};

// The state of one running step.
class StepRun {
 public:
  StepRun(const LoadOptions& options, const std::vector<std::shared_ptr<grpc::Channel>>& channels,
          const std::vector<std::unique_ptr<Stub>>& stubs, const StepSpec& step, int step_index)
      : options_(options), channels_(channels), stubs_(stubs), step_(step) {
    for (int k = 0; k < options.num_threads && !options.stream; ++k) {
      // Generator streams: step i's lane k uses i * 1024 + k, its pacer i * 1024 + 1023.
      const uint64_t stream = static_cast<uint64_t>(step_index) * 1024 + static_cast<uint64_t>(k);
      lanes_.push_back(std::make_unique<Lane>(options.seed, stream,
                                              absl::StrCat("s", step_index, "-w", k, "-")));
    }
    for (int k = 0; k < options.num_streams && options.stream; ++k) {
      const uint64_t stream = static_cast<uint64_t>(step_index) * 1024 + static_cast<uint64_t>(k);
      conns_.push_back(std::make_unique<StreamConn>(options.seed, stream,
                                                    absl::StrCat("s", step_index, "-t", k, "-")));
    }
    pacer_stream_ = static_cast<uint64_t>(step_index) * 1024 + 1023;
    pacer_id_prefix_ = absl::StrCat("s", step_index, "-p-");
  }

  StepReport Run() {
    start_ = Clock::now();
    measure_begin_ = start_ + ToClock(options_.warmup);
    measure_end_ = measure_begin_ + ToClock(options_.duration);

    // ModelStatistics at the opening of the window, taken on a thread of its own.
    std::optional<inference::ModelStatistics> stats_before;
    std::thread stats_thread;
    if (options_.server_stats) {
      stats_thread = std::thread([this, &stats_before] {
        std::this_thread::sleep_until(measure_begin_);
        auto s = QueryStatistics(channels_.front(), options_.request.model_name, absl::Seconds(10),
                                 options_.token);
        if (s.ok()) stats_before = *std::move(s);
      });
    }
    std::thread progress_thread;
    if (options_.progress) progress_thread = std::thread([this] { ReportProgress(); });

    if (options_.stream) OpenStreams();
    if (step_.mode == LoadMode::kClosedLoop) {
      // Initial sends happen on this thread before the completion threads exist, so each
      // sender is only ever used by one thread at a time.
      for (int slot = 0; slot < step_.concurrency; ++slot) SendNextForSlot(slot);
      StartCompletionThreads();
    } else {
      StartCompletionThreads();
      std::thread pacer([this] { PaceOpenLoop(); });
      pacer.join();
    }
    while (in_flight_.load(std::memory_order_acquire) > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    for (auto& lane : lanes_) lane->cq.Shutdown();
    for (auto& lane : lanes_) lane->thread.join();
    for (auto& conn : conns_) {
      {
        std::lock_guard<std::mutex> lock(conn->mu);
        conn->closing = true;
      }
      conn->cv.notify_all();
    }
    for (auto& conn : conns_) {
      conn->reader.join();
      if (conn->writer.joinable()) conn->writer.join();
    }
    done_.store(true);
    if (progress_thread.joinable()) progress_thread.join();
    if (stats_thread.joinable()) stats_thread.join();

    StepReport report = Report();
    if (stats_before.has_value()) {
      auto after = QueryStatistics(channels_.front(), options_.request.model_name,
                                   absl::Seconds(10), options_.token);
      if (after.ok()) report.server = SplitBetween(*stats_before, *after);
    }
    return report;
  }

 private:
  void StartCompletionThreads() {
    for (auto& lane : lanes_) {
      Lane* l = lane.get();
      l->thread = std::thread([this, l] { Drain(*l); });
    }
    for (auto& conn : conns_) {
      StreamConn* c = conn.get();
      c->writer = std::thread([this, c] { WriteStream(*c); });
      c->reader = std::thread([this, c] { ReadStream(*c); });
    }
  }

  // Builds the next request of `sender` into its scratch.
  void BuildNext(Sender& sender, Call& call) {
    const int64_t tokens =
        options_.tokens.min_tokens +
        static_cast<int64_t>(sender.rng() % static_cast<uint64_t>(options_.tokens.max_tokens -
                                                                  options_.tokens.min_tokens + 1));
    call.id = absl::StrCat(sender.id_prefix, sender.next_id++);
    call.tokens = tokens;
    BuildInferRequest(options_.request, tokens, call.id, sender.rng, &sender.scratch,
                      options_.verifier != nullptr ? &call.input : nullptr);
    if (const SharedMemorySlots* shm = options_.shared_memory; shm != nullptr) {
      // The rows go into the worker's slot; the request names it, and the answer's place.
      inference::ModelInferRequest& r = sender.scratch;
      const std::string& raw = r.raw_input_contents(0);
      const int64_t bytes = static_cast<int64_t>(raw.size());
      std::memcpy(shm->at(shm->input_offset(call.slot)), raw.data(), raw.size());
      r.clear_raw_input_contents();
      auto place = [&](google::protobuf::Map<std::string, inference::InferParameter>& p,
                       int64_t offset) {
        p["shared_memory_region"].set_string_param(shm->region());
        p["shared_memory_byte_size"].set_int64_param(bytes);
        p["shared_memory_offset"].set_int64_param(offset);
      };
      place(*r.mutable_inputs(0)->mutable_parameters(), shm->input_offset(call.slot));
      place(*r.mutable_outputs(0)->mutable_parameters(), shm->output_offset(call.slot));
    }
  }

  // Unary: hands `call` (request already built in sender.scratch) to gRPC on `cq`.
  void StartUnary(Sender& sender, std::unique_ptr<Call> call, grpc::CompletionQueue& cq) {
    call->context.set_deadline(DeadlineAfter(options_.timeout));
    AddToken(call->context, options_.token);
    Stub& stub = *stubs_[sender.next_stub++ % stubs_.size()];
    in_flight_.fetch_add(1, std::memory_order_acq_rel);
    // PrepareAsync serializes the request, so the scratch may be rebuilt right after.
    call->reader = stub.PrepareAsyncModelInfer(&call->context, sender.scratch, &cq);
    call->reader->StartCall();
    Call* raw = call.release();
    raw->reader->Finish(&raw->response, &raw->status, raw);
  }

  // Stream: queues `call` (request in sender.scratch) on `conn`. A dead stream fails it at
  // once into `recorder` (the caller's own).
  void StartStream(Sender& sender, std::unique_ptr<Call> call, StreamConn& conn,
                   Recorder& recorder) {
    auto request = std::make_unique<inference::ModelInferRequest>(std::move(sender.scratch));
    sender.scratch.Clear();
    {
      std::lock_guard<std::mutex> lock(conn.mu);
      if (!conn.dead && !conn.broken) {
        in_flight_.fetch_add(1, std::memory_order_acq_rel);
        const std::string id = call->id;
        conn.pending.emplace(id, std::move(call));
        conn.queue.push_back(std::move(request));
      }
    }
    if (call != nullptr) {  // not queued
      call->status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream has ended");
      if (call->measured) Record(recorder, *call, Clock::now());
      return;
    }
    conn.cv.notify_one();
  }

  void OpenStreams() {
    for (size_t i = 0; i < conns_.size(); ++i) {
      StreamConn& conn = *conns_[i];
      AddToken(conn.context, options_.token);
      // Past this the stream is abandoned; each request is bounded by its "timeout".
      const absl::Duration window = options_.num_requests > 0 ? absl::Hours(24) : options_.duration;
      conn.context.set_deadline(
          DeadlineAfter(options_.warmup + window + options_.timeout + absl::Seconds(30)));
      conn.rw = stubs_[i % stubs_.size()]->ModelStreamInfer(&conn.context);
    }
  }

  // Closed loop: decides whether `slot` sends again now, and if so sends it through its
  // lane or stream (whose thread, or the main thread before those start, calls this).
  void SendNextForSlot(int slot) {
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
    call->measured = measured;
    call->slot = slot;
    if (options_.stream) {
      StreamConn& conn = *conns_[static_cast<size_t>(slot) % conns_.size()];
      BuildNext(conn.sender, *call);
      call->start = Clock::now();
      StartStream(conn.sender, std::move(call), conn, conn.recorder);
    } else {
      Lane& lane = *lanes_[static_cast<size_t>(slot) % lanes_.size()];
      BuildNext(lane.sender, *call);
      call->start = Clock::now();
      StartUnary(lane.sender, std::move(call), lane.cq);
    }
  }

  // Open loop: sends on the arrival schedule until the window (or the request count) is
  // exhausted. Runs on its own thread with its own sender.
  void PaceOpenLoop() {
    Sender sender(options_.seed, pacer_stream_, pacer_id_prefix_);
    const double mean_gap_s = 1.0 / step_.rate_per_s;
    Clock::time_point intended = start_;
    int64_t measured_sent = 0;
    size_t next = 0;
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
          pacer_.stats.RecordError("CLIENT_BACKLOG",
                                   absl::StrCat(options_.max_outstanding,
                                                " requests already in flight (--max-outstanding)"));
          pacer_.last_measured_completion = std::max(pacer_.last_measured_completion, Clock::now());
          live_errors_.fetch_add(1, std::memory_order_relaxed);
        }
      } else {
        auto call = std::make_unique<Call>();
        BuildNext(sender, *call);  // built ahead of its send time
        call->measured = measured;
        call->start = intended;
        std::this_thread::sleep_until(intended);
        if (options_.stream) {
          StartStream(sender, std::move(call), *conns_[next++ % conns_.size()], pacer_);
        } else {
          StartUnary(sender, std::move(call), lanes_[next++ % lanes_.size()]->cq);
        }
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
        if (call->measured) Record(lane.recorder, *call, done);
      }
      for (auto& [call, done] : batch) {
        if (call->slot >= 0) SendNextForSlot(call->slot);
        call.reset();
        in_flight_.fetch_sub(1, std::memory_order_acq_rel);
      }
      batch.clear();
    }
  }

  // Stream writer thread: writes queued requests in order; half-closes once told to
  // close and the queue is empty; stops when the stream breaks.
  void WriteStream(StreamConn& conn) {
    std::unique_lock<std::mutex> lock(conn.mu);
    for (;;) {
      conn.cv.wait(lock, [&] { return !conn.queue.empty() || conn.closing || conn.broken; });
      if (conn.broken) return;
      if (!conn.queue.empty()) {
        std::unique_ptr<inference::ModelInferRequest> request = std::move(conn.queue.front());
        conn.queue.pop_front();
        lock.unlock();
        const bool ok = conn.rw->Write(*request);
        request.reset();
        lock.lock();
        if (!ok) {
          conn.broken = true;
          return;
        }
        continue;
      }
      lock.unlock();
      conn.rw->WritesDone();
      return;
    }
  }

  // Stream reader thread: matches answers to pending calls by id and records them; when
  // the stream ends, fails whatever is still pending with the stream's status.
  void ReadStream(StreamConn& conn) {
    inference::ModelStreamInferResponse response;
    while (conn.rw->Read(&response)) {
      const Clock::time_point done = Clock::now();
      std::unique_ptr<Call> call;
      {
        std::lock_guard<std::mutex> lock(conn.mu);
        auto it = conn.pending.find(response.infer_response().id());
        if (it != conn.pending.end()) {
          call = std::move(it->second);
          conn.pending.erase(it);
        }
      }
      if (call == nullptr) {
        ++unmatched_answers_;
        continue;
      }
      if (!response.error_message().empty()) {
        call->status =
            grpc::Status(CodeOfStreamError(response.error_message()), response.error_message());
      } else {
        call->response = std::move(*response.mutable_infer_response());
      }
      if (call->measured) Record(conn.recorder, *call, done);
      if (call->slot >= 0) SendNextForSlot(call->slot);
      in_flight_.fetch_sub(1, std::memory_order_acq_rel);
    }
    {
      std::lock_guard<std::mutex> lock(conn.mu);
      conn.broken = true;
    }
    conn.cv.notify_all();
    if (conn.writer.joinable()) conn.writer.join();
    grpc::Status status = conn.rw->Finish();
    if (status.ok()) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream ended without an answer");
    }
    std::unordered_map<std::string, std::unique_ptr<Call>> lost;
    {
      std::lock_guard<std::mutex> lock(conn.mu);
      conn.dead = true;
      lost.swap(conn.pending);
    }
    const Clock::time_point now = Clock::now();
    for (auto& [id, call] : lost) {
      call->status = status;
      if (call->measured) Record(conn.recorder, *call, now);
      in_flight_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void Record(Recorder& recorder, const Call& call, Clock::time_point done) {
    recorder.last_measured_completion = std::max(recorder.last_measured_completion, done);
    WorkerStats& stats = recorder.stats;
    if (!call.status.ok()) {
      stats.RecordError(StatusCodeName(call.status.error_code()), call.status.error_message());
      live_errors_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    const SharedMemorySlots* shm = options_.shared_memory;
    absl::Status check =
        CheckInferResponse(call.response, call.tokens, options_.request.hidden_size, call.id,
                           options_.request.dtype, shm != nullptr);
    if (check.ok() && options_.verifier != nullptr) {
      std::vector<float> output;
      if (shm != nullptr) {  // read before the worker's next request reuses the slot
        DecodeOutputBytes(
            absl::string_view(shm->at(shm->output_offset(call.slot)),
                              static_cast<size_t>(call.tokens * options_.request.hidden_size *
                                                  common::ElementBytes(options_.request.dtype))),
            options_.request.dtype, &output);
      } else {
        DecodeOutput(call.response, options_.request.dtype, &output);
      }
      check = options_.verifier->Check(call.input.data(), output.data(), call.tokens);
      if (!check.ok()) {
        stats.RecordError(kVerifyMismatch, absl::StrCat(call.id, ": ", check.message()));
        live_errors_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      ++stats.num_verified;
    }
    if (!check.ok()) {
      stats.RecordError(kBadResponse, check.message());
      live_errors_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    stats.RecordOk(ToNanos(done - call.start), call.tokens);
    live_ok_.fetch_add(1, std::memory_order_relaxed);
    live_tokens_.fetch_add(call.tokens, std::memory_order_relaxed);
  }

  void ReportProgress() {
    while (!done_.load()) {
      for (int i = 0; i < 20 && !done_.load(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      if (done_.load()) break;
      Progress p;
      p.elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
      p.warmup_s = absl::ToDoubleSeconds(options_.warmup);
      p.window_s = options_.num_requests > 0 ? 0 : absl::ToDoubleSeconds(options_.duration);
      p.target_requests = options_.num_requests;
      p.ok = live_ok_.load(std::memory_order_relaxed);
      p.errors = live_errors_.load(std::memory_order_relaxed);
      p.ok_tokens = live_tokens_.load(std::memory_order_relaxed);
      options_.progress(p);
    }
  }

  StepReport Report() {
    WorkerStats merged;
    Clock::time_point last = pacer_.last_measured_completion;
    merged.MergeFrom(std::move(pacer_.stats));
    for (auto& lane : lanes_) {
      merged.MergeFrom(std::move(lane->recorder.stats));
      last = std::max(last, lane->recorder.last_measured_completion);
    }
    for (auto& conn : conns_) {
      merged.MergeFrom(std::move(conn->recorder.stats));
      last = std::max(last, conn->recorder.last_measured_completion);
    }
    if (unmatched_answers_.load() > 0) {
      merged.RecordError(kBadResponse, absl::StrCat(unmatched_answers_.load(),
                                                    " stream answers matched no request id"));
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
  const std::vector<std::shared_ptr<grpc::Channel>>& channels_;
  const std::vector<std::unique_ptr<Stub>>& stubs_;
  const StepSpec step_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::vector<std::unique_ptr<StreamConn>> conns_;
  uint64_t pacer_stream_ = 0;
  std::string pacer_id_prefix_;
  Clock::time_point start_;
  Clock::time_point measure_begin_;
  Clock::time_point measure_end_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> tickets_{0};  // closed loop, request-count mode: measured sends
  std::atomic<int64_t> live_ok_{0}, live_errors_{0}, live_tokens_{0};  // for progress only
  std::atomic<int64_t> unmatched_answers_{0};
  std::atomic<bool> done_{false};
  // Written by the pacer thread only (errors of requests it could not send); read after
  // it has been joined.
  Recorder pacer_;
};

}  // namespace

StepReport LoadGenerator::RunStep(const StepSpec& step, int step_index) {
  StepRun run(options_, channels_, stubs_, step, step_index);
  return run.Run();
}

}  // namespace epserve::client
