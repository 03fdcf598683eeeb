// StepRun's receiving side: completion-queue lanes, stream readers, and what an answer
// counts as.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <grpc/support/time.h>

#include "absl/strings/str_cat.h"
#include "client/detail/step_run.h"
#include "client/shm_slots.h"
#include "client/verify.h"
#include "common/element_type.h"

namespace epserve::client::detail {
namespace {

int64_t ToNanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
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

}  // namespace

void StepRun::Drain(Lane& lane) {
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

void StepRun::ReadStream(StreamConn& conn) {
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

void StepRun::Record(Recorder& recorder, const Call& call, Clock::time_point done) {
  recorder.last_measured_completion = std::max(recorder.last_measured_completion, done);
  ThreadStats& stats = recorder.stats;
  if (!call.status.ok()) {
    stats.RecordError(StatusCodeName(call.status.error_code()), call.status.error_message());
    live_errors_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const SharedMemorySlots* shm = options_.shared_memory;
  absl::Status check = CheckInferResponse(call.response, call.tokens, options_.request.hidden_size,
                                          call.id, options_.request.dtype, shm != nullptr);
  if (check.ok() && options_.verifier != nullptr) {
    std::vector<float> output;
    if (shm != nullptr) {  // read before the slot's next request reuses it
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

}  // namespace epserve::client::detail
