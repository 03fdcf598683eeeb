// The epserve-load engine: drives ModelInfer load at a server, closed loop (N slots, one
// request in flight each) or open loop (requests at a fixed or Poisson rate), and
// measures it. Reaching the server and its metadata and statistics: server_queries.h.
//
// Measurement rules, the same for every step:
//  * A step first runs `warmup`, whose requests are sent but not counted. The measured
//    window opens at start + warmup.
//  * A request is measured if it is sent inside the window: in duration mode, before
//    start + warmup + duration; in request-count mode, among the first `num_requests`
//    sent after the window opened. Every measured request is waited for (each is bounded
//    by its deadline) and counted exactly once: OK, an error by gRPC code, or
//    "bad_response" (see CheckInferResponse). Open loop also counts "CLIENT_BACKLOG": a
//    request not sent because max_outstanding requests were already in flight.
//  * Closed-loop latency runs from the moment a request is handed to gRPC to the moment
//    its completion is dequeued. Open-loop latency runs from the request's *intended* send
//    time on the arrival schedule, so a slow server or a late client shows up as latency
//    instead of silently lowering the offered rate (no coordinated omission).
//  * duration_s runs from the window's start to the later of its nominal end (duration
//    mode) and the last measured completion; requests_per_s and tokens_per_s count
//    successful requests over it.
//  * With server_stats, the server's ModelStatistics are read when the window opens and
//    after the step. A closed loop's measured requests start once the first read has
//    answered (one round trip at the window's opening), so that the server's split covers
//    them however late a busy host runs that read; an open loop keeps its schedule, and a
//    late read leaves the window's first answers out of the split.
//
//  * With `stream`, requests travel over ModelStreamInfer streams instead of one
//    ModelInfer call each; answers are matched to requests by id (the server answers in
//    order of completion). A request's deadline is then the request parameter "timeout",
//    which the server enforces; a stream that breaks fails its unanswered requests with
//    the stream's status.
//  * With a verifier, every successful answer is checked against the reference forward
//    pass on the lane thread that received it (so the client's own throughput drops);
//    a mismatch counts as the error "verify_mismatch".
//
// Threads: `num_threads` completion-queue threads each own a ThreadStats for the whole
// step (no lock shared by requests); in open loop one more thread paces the sends. In
// stream mode each stream has a reader thread (owning a ThreadStats) and a writer thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/infer_request.h"
#include "client/load_stats.h"
#include "client/shm_slots.h"
#include "client/verify.h"
#include "grpc_service.grpc.pb.h"

namespace epserve::client {

// Inter-arrival times of the open loop.
enum class Arrival {
  kConstant,  // exactly 1/rate apart
  kPoisson,   // exponentially distributed with mean 1/rate
};
absl::string_view ArrivalName(Arrival arrival);
absl::StatusOr<Arrival> ParseArrival(absl::string_view text);

// What a running step has done so far, for a progress line.
struct Progress {
  double elapsed_s = 0;  // since the step started, warmup included
  double warmup_s = 0;
  double window_s = 0;          // measured window (0 in request-count mode)
  int64_t target_requests = 0;  // request-count mode: measured requests wanted
  int64_t ok = 0;               // measured requests answered so far
  int64_t errors = 0;           // measured requests failed so far
  int64_t ok_tokens = 0;
};

// Settings shared by every step of a run.
struct LoadOptions {
  RequestTemplate request;                      // hidden_size must already be known (> 0)
  TokenRange tokens;                            // token rows per request
  absl::Duration duration = absl::Seconds(10);  // measured window, when num_requests == 0
  int64_t num_requests = 0;                     // > 0: measure this many requests instead
  absl::Duration warmup = absl::Seconds(1);     // unmeasured lead-in of every step
  absl::Duration timeout = absl::Seconds(10);   // deadline of each request
  uint64_t seed = 1;                            // seeds every thread's payload generator
  int num_threads = 2;                          // completion-queue threads, 1..1023
  int64_t max_outstanding = 4096;               // open loop: cap on requests in flight
  std::string token;                            // bearer token sent with every call, or ""
  bool stream = false;                          // ModelStreamInfer instead of ModelInfer
  int num_streams = 1;                          // stream mode: streams, spread over channels
  std::shared_ptr<const Verifier> verifier;     // checks every answer when set
  // Closed loop only: the i-th request in flight sends its input and takes its answer through slot
  // i of this registered region (Triton's system shared memory) instead of inside the messages.
  // Slots must hold tokens.max_tokens rows each way and number at least the step's concurrency.
  const SharedMemorySlots* shared_memory = nullptr;
  bool server_stats = true;  // read ModelStatistics around the window
  // Called about once a second while a step runs, from a thread of the step's own.
  std::function<void(const Progress&)> progress;
};

// One step of a run.
struct StepSpec {
  LoadMode mode = LoadMode::kClosedLoop;
  int concurrency = 1;    // closed loop: slots (requests kept in flight), >= 1
  double rate_per_s = 0;  // open loop: requests per second, > 0
  Arrival arrival = Arrival::kConstant;
};

// Runs load steps over a fixed set of channels. Not thread-safe: one step at a time.
class LoadGenerator {
 public:
  LoadGenerator(std::vector<std::shared_ptr<grpc::Channel>> channels, LoadOptions options);

  // Checks `step` and the options against each other; INVALID_ARGUMENT naming the field.
  absl::Status Validate(const StepSpec& step) const;

  // Runs `step` (warmup, then the measured window), waits for every request it sent and
  // reports the measured ones. Blocks for about warmup + duration (+ the slowest request).
  // `step_index` only makes request ids unique across steps. Precondition: Validate(step).
  StepReport RunStep(const StepSpec& step, int step_index);

 private:
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<inference::GRPCInferenceService::Stub>> stubs_;
  LoadOptions options_;
};

}  // namespace epserve::client
