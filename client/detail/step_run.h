// One step of LoadGenerator::RunStep (load_generator.h states the measurement rules): the
// requests in flight, the threads that send and receive them, and what those record.
// Private to client/. StepRun's lifecycle (threads started and joined, progress, the
// report) is in step_run.cc; the sending side (payloads, unary calls, stream queues, the
// open-loop pacer, stream writers) in step_send.cc; the receiving side (completion-queue
// lanes, stream readers, recording an answer) in step_receive.cc.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/support/async_unary_call.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/sync_stream.h>

#include "client/infer_request.h"
#include "client/load_generator.h"
#include "client/load_stats.h"
#include "grpc_service.grpc.pb.h"

namespace epserve::client::detail {

using Clock = std::chrono::steady_clock;
using Stub = inference::GRPCInferenceService::Stub;
using StreamRw =
    grpc::ClientReaderWriter<inference::ModelInferRequest, inference::ModelStreamInferResponse>;

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
  int slot = -1;             // closed-loop slot that sends again on completion; -1: none
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
  ThreadStats stats;
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

// The state of one running step. Run() once, from the thread that constructed it.
class StepRun {
 public:
  // `options`, `channels` and `stubs` must outlive the StepRun.
  StepRun(const LoadOptions& options, const std::vector<std::shared_ptr<grpc::Channel>>& channels,
          const std::vector<std::unique_ptr<Stub>>& stubs, const StepSpec& step, int step_index);

  // Warmup, the measured window, every request waited for; then the step's report.
  StepReport Run();

 private:
  // step_run.cc: the lifecycle.
  void StartServerStatsThread();
  void StartCompletionThreads();
  void OfferLoad();           // closed loop's initial sends, or the open loop's pacer
  void WaitForCompletions();  // every request answered, then every thread joined
  void ReportProgress();      // progress thread: options_.progress about once a second
  StepReport Report();        // the merged stats of every thread, and the server's split

  // step_send.cc: building and sending requests.
  void OpenStreams();
  // Builds the next request of `sender` into its scratch.
  void BuildNext(Sender& sender, Call& call);
  // Unary: hands `call` (request already built in sender.scratch) to gRPC on `cq`.
  void StartUnary(Sender& sender, std::unique_ptr<Call> call, grpc::CompletionQueue& cq);
  // Stream: queues `call` (request in sender.scratch) on `conn`. A dead stream fails it at
  // once into `recorder` (the caller's own).
  void StartStream(Sender& sender, std::unique_ptr<Call> call, StreamConn& conn,
                   Recorder& recorder);
  // Closed loop: decides whether `slot` sends again now, and if so sends it through its
  // lane or stream (whose thread, or the main thread before those start, calls this).
  void SendNextForSlot(int slot);
  // Blocks until the window's first ModelStatistics read has answered (OpenWindow).
  void AwaitWindow();
  void OpenWindow();
  // Open loop: sends on the arrival schedule until the window (or the request count) is
  // exhausted. Runs on its own thread with its own sender.
  void PaceOpenLoop();
  // Stream writer thread: writes queued requests in order; half-closes once told to
  // close and the queue is empty; stops when the stream breaks.
  void WriteStream(StreamConn& conn);

  // step_receive.cc: completions.
  // Lane thread: records each completion and, in closed loop, sends the slot's next
  // request. Completions already waiting are dequeued and timestamped before any of them
  // is acted on, so that building the next payloads does not delay their timestamps.
  void Drain(Lane& lane);
  // Stream reader thread: matches answers to pending calls by id and records them; when
  // the stream ends, fails whatever is still pending with the stream's status.
  void ReadStream(StreamConn& conn);
  // Counts a measured call's outcome into `recorder` (the calling thread's own): its
  // error, or its answer checked (and verified, with a verifier) and its latency.
  void Record(Recorder& recorder, const Call& call, Clock::time_point done);

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
  // Written by stats_thread_ when the window opens; read after it has been joined.
  std::optional<inference::ModelStatistics> stats_before_;
  // Whether stats_before_ has been read (or its read failed, or server_stats is off): the
  // closed loop's measured sends wait for it (AwaitWindow).
  std::mutex window_mu_;
  std::condition_variable window_cv_;
  std::atomic<bool> window_open_{false};  // set under window_mu_
  std::thread stats_thread_;              // reads stats_before_ (with server_stats)
  std::thread progress_thread_;           // runs ReportProgress (with a progress callback)
};

}  // namespace epserve::client::detail
